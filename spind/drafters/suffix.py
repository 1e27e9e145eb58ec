"""The `suffix` drafter: model-free suffix decoding (SuffixDecoding, Oliaro et al.; vLLM's `suffix` method).

Two depth-bounded suffix tries with counts: one per request over its own prompt and output, and one shared over
the outputs of requests that finished (a cache bounded in memory, oldest request evicted first; outputs only, as
SuffixDecoding's global tree: a request's prompt is in its own trie, and the shared trie's inserts, ~35 us a token,
are paid while the target waits: with the prompts in it, the target's worker spent 3.8% of its time inserting at
batch 16 on `cp`'s ~200-token prompts, every slot decoding plainly, `py-spy`). A
node is a sequence of up to `max_depth` tokens; `count` is how often it occurred, `succ` how often something
followed it. To draft, the deepest node that matches a suffix of the request's sequence and was ever continued
is extended by its most frequent child, each step's probability estimated as count(child) / succ(node); drafting
stops where the running product falls below `min_prob` or the draft reaches min(k, `factor` x the match length),
so a long, frequent match drafts far and a short or ambiguous one little. The request's trie and the shared one
each propose; the higher score (the sum of the step probabilities) wins. Each draft token carries a confidence
(`Draft.confidence`, see `SuffixTrie.speculate`), which selection calibrates against what greedy decoding accepts.

A request's trie grows in O(max_depth) per token (the nodes of the suffixes ending at its newest token are kept
and extended). Pure Python, no torch.

Why not arctic-inference (the C++ suffix trees vLLM's `suffix` method calls): it publishes no wheels past 0.0.4,
and `pip install arctic-inference` builds 0.3.0 in an isolated environment whose requirements (torch >= 2.10,
protobuf 5.29.6, nanobind, grpcio-tools) pull PyPI's CUDA torch. It does build on CPU without isolation, from a
prepared build environment, and is cheaper: ~30 against ~100 us a draft step at depth 24, 4x less per inserted
token (60 synthetic requests of 500 tokens, AMD EPYC Zen 4, both cores shared with other work). Its shared cache is
bounded by a request count, not memory. At batch 1 this trie costs ~1-2% of a default-model step; a C++ backend is
the upgrade when that matters.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import count

from spind.drafters.base import Draft, DraftInput, Drafter

INSERT_CHUNK = 64  # finished tokens the shared cache takes a background step (4-20 us a token at depth 12), the
#                   worker's socket polled after each (an op waiting ends it)
BYTES_PER_NODE = 290  # measured (tracemalloc): a trie of 20k mixed tokens at depth 24, 461k nodes (~23 a token)
_VERSIONS = count(1)  # a shared cache's state: a new number at each change, unique across caches


class SuffixTrie:
    """Token sequences of length <= max_depth with their counts; node 0 is the empty sequence."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self.children: list[dict[int, int] | None] = [None]
        self.count: list[int] = [0]
        self.succ: list[int] = [0]
        self.depth: list[int] = [0]
        self.parent: list[int] = [-1]
        self.token: list[int] = [-1]
        self.unused: list[int] = []  # released node ids, reused first

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self.unused)

    def child(self, node: int, token: int) -> int | None:
        kids = self.children[node]
        return None if kids is None else kids.get(token)

    def _new(self, parent: int, token: int) -> int:
        depth = self.depth[parent] + 1
        if self.unused:
            node = self.unused.pop()
            self.children[node], self.count[node], self.succ[node] = None, 0, 0
            self.depth[node], self.parent[node], self.token[node] = depth, parent, token
            return node
        self.children.append(None)  # column by column: the trie's hot path (~23 new nodes a token)
        self.count.append(0)
        self.succ.append(0)
        self.depth.append(depth)
        self.parent.append(parent)
        self.token.append(token)
        return len(self.count) - 1

    def step(self, active: list[int], token: int) -> list[int]:
        """Count `token` after each node of `active` (the suffixes ending at the previous token; node 0 is the
        empty one); returns the suffixes ending at `token`."""
        out = [0]
        self.count[0] += 1
        for node in active:
            if self.depth[node] >= self.max_depth:
                continue
            kids = self.children[node]
            if kids is None:
                kids = self.children[node] = {}
            nxt = kids.get(token)
            if nxt is None:
                nxt = kids[token] = self._new(node, token)
            self.succ[node] += 1
            self.count[nxt] += 1
            out.append(nxt)
        return out

    def follow(self, active: list[int], token: int) -> list[int]:
        """`step` without counting: of the suffixes in `active` (ending at the previous token), those the trie holds
        followed by `token`, and the empty one."""
        out = [0]
        children, depth, max_depth = self.children, self.depth, self.max_depth
        for node in active:
            kids = children[node]
            if kids is not None and depth[node] < max_depth:
                nxt = kids.get(token)
                if nxt is not None:
                    out.append(nxt)
        return out

    def deepest(self, active: list[int]) -> int:
        """Of `active`, the deepest node something followed (0: none)."""
        best, succ, depth = 0, self.succ, self.depth
        for node in active:
            if succ[node] > 0 and depth[node] > depth[best]:
                best = node
        return best

    def insert(self, tokens: list[int]) -> None:
        active = [0]
        for t in tokens:
            active = self.step(active, t)

    def remove(self, tokens: list[int]) -> None:
        """Undo `insert(tokens)`: every count it added is taken back, and the nodes left at zero are released."""
        active, emptied = [0], []
        for t in tokens:
            out = [0]
            self.count[0] -= 1
            for node in active:
                if self.depth[node] >= self.max_depth:
                    continue
                nxt = self.child(node, t)
                if nxt is None:
                    raise ValueError("remove() of tokens that were not inserted")
                self.succ[node] -= 1
                self.count[nxt] -= 1
                if self.count[nxt] == 0:
                    emptied.append(nxt)
                out.append(nxt)
            active = out
        for node in emptied:  # a node's subtree counts at most its own count: all of it is empty too
            if self.parent[node] >= 0 and self.child(self.parent[node], self.token[node]) == node:
                del self.children[self.parent[node]][self.token[node]]
                self._release(node)

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if self.children[n]:
                stack.extend(self.children[n].values())
            self.children[n], self.parent[n] = None, -1
            self.unused.append(n)

    def match(self, tokens: list[int]) -> int:
        """The deepest node equal to a suffix of `tokens` that something followed (0: none). From scratch: a request
        drafting on the shared trie keeps its suffixes' nodes instead (`SuffixDrafter._shared_node`)."""
        for m in range(min(self.max_depth, len(tokens)), 0, -1):
            node = 0
            for t in tokens[len(tokens) - m:]:
                node = self.child(node, t)
                if node is None:
                    break
            if node is not None and self.succ[node] > 0:
                return node
        return 0

    def speculate(self, node: int, context: list[int], k: int, factor: float,
                  min_prob: float) -> tuple[list[int], float, list[float]]:
        """Extend `node` (a suffix of `context` that matched) by its most frequent children: (tokens, score, each
        token's confidence: the running product of count / (succ + 1 / depth), the step probability with one
        unseen continuation of weight 1 / (the matched suffix's length)). At max_depth the walk continues from the
        suffix one token shorter."""
        depth = self.depth[node]
        if depth == 0:
            return [], 0.0, []
        limit = min(k, max(1, int(factor * depth)))
        tokens: list[int] = []
        confidence: list[float] = []
        score, prob, sure = 0.0, 1.0, 1.0
        while len(tokens) < limit:
            if self.succ[node] == 0 and self.depth[node] >= self.max_depth:
                node = self.match((context + tokens)[-(self.max_depth - 1):])
            if node == 0 or self.succ[node] == 0:
                break
            token, kid = max(self.children[node].items(), key=lambda item: self.count[item[1]])
            prob *= self.count[kid] / self.succ[node]
            if prob < min_prob:
                break
            # the confidence counts one unseen continuation, worth less the longer the matched suffix: a token
            # that followed a 20-token match once is likelier next than one that followed one matching token once
            sure *= self.count[kid] / (self.succ[node] + 1.0 / self.depth[node])
            tokens.append(token)
            confidence.append(sure)
            score += prob
            node = kid
        return tokens, score, confidence


class SuffixCache:
    """The shared trie over finished requests' sequences, evicting the oldest past `max_bytes` (estimated)."""

    def __init__(self, max_depth: int, max_bytes: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, list[int]] = OrderedDict()
        self._partial: tuple[str, list[int], int, list[int]] | None = None  # (key, tokens, inserted, active)
        self.version = next(_VERSIONS)  # changes with the trie (nodes added or released): kept nodes are then stale

    @property
    def approx_bytes(self) -> int:
        return self.trie.num_nodes * BYTES_PER_NODE

    def add(self, key: str, tokens: list[int]) -> None:
        self.add_part(key, tokens, len(tokens))

    def add_part(self, key: str, tokens: list[int], max_tokens: int,
                 stop: Callable[[], bool] | None = None) -> tuple[int, bool]:
        """Insert up to max_tokens more of `tokens` (key's sequence, the one begun or a new one), ending after the
        first token where `stop()` is true: (tokens inserted now, whether it is whole). A long sequence goes in over
        several calls, so none holds up the worker's next op for long. A sequence is an entry (evictable,
        replaceable) once whole; a partial one is drafted from meanwhile."""
        if self.max_bytes <= 0 or not tokens:
            return 0, True
        self.version = next(_VERSIONS)
        if self._partial is None or self._partial[0] != key or self._partial[1] is not tokens:
            self._finish_partial()
            if key in self.entries:
                self.trie.remove(self.entries.pop(key))
            self._partial = (key, tokens, 0, [0])
        key, tokens, done, active = self._partial
        end = min(len(tokens), done + max(1, max_tokens))
        step = self.trie.step
        for i in range(done, end):
            active = step(active, tokens[i])
            if stop is not None and i + 1 < end and stop():
                end = i + 1
                break
        self._partial = (key, tokens, end, active)
        if end < len(tokens):
            return end - done, False
        self._partial = None
        self.entries[key] = list(tokens)
        while self.entries and self.approx_bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.trie.remove(old)
        return end - done, True

    def _finish_partial(self) -> None:
        """Take back a sequence left half inserted (another one begins): the trie holds only whole ones after."""
        if self._partial is not None:
            key, tokens, done, _ = self._partial
            self._partial = None
            if done:
                self.trie.remove(tokens[:done])


class _Local:
    """One request's own trie and the nodes of the suffixes ending at its newest token."""

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.active = [0]
        self.tokens: list[int] = []
        # the shared trie's nodes of the suffixes ending at tokens[shared_len - 1], as of its `version`
        self.shared_active, self.shared_len, self.shared_version = [0], -1, 0

    def sync(self, tokens: list[int]) -> None:
        """Catch up with the request's sequence. It only grows once committed; tokens a draft-ahead assumed
        (at most k + 1 of them, k <= 32) may be replaced: then the trie is rebuilt."""
        n = len(self.tokens)
        tail = max(0, n - 34)
        if len(tokens) < n or tokens[tail:n] != self.tokens[tail:n]:
            self.trie, self.active, self.tokens, n = SuffixTrie(self.trie.max_depth), [0], [], 0
            self.shared_len = -1
        for t in tokens[n:]:
            self.active = self.trie.step(self.active, t)
        self.tokens.extend(tokens[n:])

    def deepest(self) -> int:
        """The deepest suffix ending at the newest token that occurred before with a successor."""
        return self.trie.deepest(self.active)


class SuffixDrafter(Drafter):
    kind = "suffix"

    def __init__(self, name: str, max_depth: int = 12, factor: float = 1.0, min_prob: float = 0.1,
                 cache_mb: float = 64.0) -> None:
        super().__init__(name)
        self.max_depth, self.factor, self.min_prob = max_depth, factor, min_prob
        self.cache = SuffixCache(max_depth, int(cache_mb * 2 ** 20))
        self.pending: deque[tuple[str, list[int]]] = deque()  # finished sequences the cache is still to take
        self.local: dict[str, _Local] = {}

    def add_request(self, req_id, params) -> None:
        super().add_request(req_id, params)
        self.local[req_id] = _Local(self.max_depth)

    def free_request(self, req_id: str) -> None:
        super().free_request(req_id)
        self.local.pop(req_id, None)

    def observe_finished(self, req_id: str, output: list[int]) -> None:
        """A finished request's output joins the shared cache, whichever drafter served it: the next requests may
        repeat it (the worker calls this for every request it frees). Queued: inserting costs ~40 us a token, so the
        worker does it between ops (background_work)."""
        if self.cache.max_bytes > 0 and output:
            self.pending.append((req_id, list(output)))

    def forget_finished(self) -> None:
        self.pending.clear()
        self.cache = SuffixCache(self.max_depth, self.cache.max_bytes)

    @property
    def has_background_work(self) -> bool:
        return bool(self.pending)

    def background_work(self, max_tokens: int, stop: Callable[[], bool] | None = None) -> None:
        """Insert up to min(max_tokens, INSERT_CHUNK) queued tokens into the shared cache, ending after the token
        where `stop` says an op waits: the worker runs this only while no op waits, and an op that arrives meanwhile
        waits for one token's insert (~5-20 us), not for the chunk. A slot's gap between a verify's reply and the
        next op (~0.15 ms at batch 4) is about what 8 inserts take on the worker, so with a check every 8 tokens
        nearly every op waited: `spin` held to plain decoding (a scratch build), `bench e2e --workload gsm8k
        --batch-size 4`, AMD EPYC with AVX-512, 2 cores, ran 0.986x `none` with a check every 8 tokens, 1.002x with
        one every token (1.002x in each of two runs; without the cache 1.009x and 1.025x)."""
        budget = min(max_tokens, INSERT_CHUNK)
        while self.pending and budget > 0:
            key, tokens = self.pending[0]
            inserted, whole = self.cache.add_part(key, tokens, budget, stop)
            if whole:
                self.pending.popleft()
            budget -= max(1, inserted)
            if stop is not None and stop():
                return

    def _propose(self, inputs: list[DraftInput]) -> list[Draft]:
        out = []
        for x in inputs:
            local = self.local[x.req_id]
            new, start = len(x.tokens) - len(local.tokens), self.clock.now()
            local.sync(x.tokens)
            # beyond the k + 1 tokens a slot on it commits: a catch-up (its first use, or slots on other drafters)
            switch_s = (self.clock.now() - start) * max(0, new - x.k - 1) / new if new > x.k + 1 else 0.0
            best: tuple[list[int], float, list[float]] = ([], 0.0, [])
            if x.k > 0:
                node = local.deepest()
                if node:
                    best = local.trie.speculate(node, x.tokens, x.k, self.factor, self.min_prob)
                shared = self._shared_node(local, x.tokens)
                if shared:
                    other = self.cache.trie.speculate(shared, x.tokens, x.k, self.factor, self.min_prob)
                    if other[1] > best[1]:
                        best = other
            out.append(Draft(best[0], switch_s=switch_s, confidence=best[2]))
        return out

    def _shared_node(self, local: _Local, tokens: list[int]) -> int:
        """`self.cache.trie.match(tokens)`, from the request's kept nodes of the shared trie, followed over its new
        tokens (a lookup per kept node a token, against a walk per suffix length a draft: ~10 us of a ~25 us draft
        step); found again from the last max_depth tokens after the cache changed."""
        trie = self.cache.trie
        if local.shared_version != self.cache.version or not 0 <= local.shared_len <= len(tokens):
            local.shared_active, local.shared_len = [0], max(0, len(tokens) - trie.max_depth)
            local.shared_version = self.cache.version
        active = local.shared_active
        for t in tokens[local.shared_len:]:
            active = trie.follow(active, t)
        local.shared_active, local.shared_len = active, len(tokens)
        return trie.deepest(active)

    def describe(self) -> dict:
        return {**super().describe(), "cache_requests": len(self.cache.entries),
                "cache_mb": self.cache.approx_bytes / 2 ** 20}
