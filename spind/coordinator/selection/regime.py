"""Whether selection's speculation beats plain decoding, measured end to end: a two-armed trial per batch size.

Selection chooses drafts by what it predicts (each draft token's chance to survive against the seconds it adds).
Where a draft token is worth nearly what it costs, the predictions' errors decide, and the slot pays costs no
prediction sees: the coordinator's selecting and bookkeeping, the shadow drafts, a forward slowed by the
coordinator's Python on a CPU whose cores the target uses, larger messages. On a 2-core Xeon at batch 4 (gsm8k,
n-gram and suffix decoding, with the start-up profile timing the target on the cores it serves with) selection
drafted on ~75% of the slots, at an accepted length of 1.2, and ran 0.93-0.95x plain decoding, while every forward
it predicted paid. Comparing a drafting forward with a plain one cannot see that (the loss is in the regime's
overhead, not in its forwards).

So the regimes themselves are compared, as a user would see them: windows of a batch-size bucket's slots run either
as selection chooses (SELECT) or with every request left to selection decoding plainly and no selecting at all
(PLAIN: what `none` does), and each window is measured by its tokens against its slots' wall seconds: its value is
log(tokens / plain-step equivalents), where a slot of B requests that took s seconds is worth B x s / plain_s(B)
plain steps (plain_s: the cost model's plain forward at B, read as each pair completes, per batch size its windows
ran at; within a bucket a window at batch 3 then compares with one at batch 4, and an error of plain_s is the same
for both regimes of a pair). A window holds `window` request-steps (a slot of B requests is B of them), not a number
of slots: what varies from window to window is the text of its requests, so a window of as many request-steps is
about as precise at any batch, and the trial's share of slots shrinks as the batch grows (64 request-steps: 32
slots at batch 2, 16 at batch 4, 4 at batch 16).

Windows are compared in pairs, one of each regime back to back in random order: what a window makes depends far
more on its text (a request copying its prompt makes 1.5x what the next one does) than on the regime, and adjacent
windows share their requests, so the pair's difference sees the regime where two unpaired means would see mostly
the text. A bucket runs MIN_PAIRS pairs; then each window decision runs another pair with the chance the evidence is
still in doubt (twice the chance of the less likely sign of the mean difference, decayed over the latest ~`memory`
pairs; at least EXPLORE_MIN, so the evidence follows a workload that changes), and otherwise one window of SELECT,
or of PLAIN where SELECT is likely the worse (its chance to be better below PLAIN_BELOW). Where speculation clearly
pays or clearly loses, ~2-4% of the slots run the other regime; where the two are within the noise, both run, which
costs little. Batch 1 is left to selection alone (MIN_BATCH).

Pure: numbers in, a regime out; its randomness is seeded.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

SELECT, PLAIN = "select", "plain"
REGIMES = (SELECT, PLAIN)
# the least batch the trial runs at. At batch 1 the start-up profile has timed every draft length (each draft position
# is priced at what it adds), and the drafts that pay there pay by a wide margin on text that repeats, while the text
# of one request changes from window to window: measured (`bench e2e`, 2-core Xeon), a pair's difference spread
# ~0.3 in log there against ~0.13 at batch 4, and the pairs needed to tell the regimes apart cost `spin` 6-10% of the
# best fixed drafter's speed on humaneval (two runs), more than the trial saved anywhere at batch 1
MIN_BATCH = 2
MIN_PAIRS = 3  # pairs of windows a bucket runs before it exploits
EXPLORE_MIN = 1 / 48  # the least share of a bucket's window decisions that run a pair (the evidence must stay fresh)
PLAIN_BELOW = 0.25  # a window is exploited plain only where SELECT beats PLAIN with less than this chance: selection
#                    is what the daemon is for, and a few pairs at a start, read through a cost model that is still
#                    learning, can make it look worse than it is
SD_FLOOR = 0.02  # the least spread assumed of a pair's difference (a few pairs that happen to agree are not proof)


class _Bucket:
    __slots__ = ("plan", "pair", "regime", "left", "tokens", "seconds", "n", "sum", "sum2", "pairs", "exploited")

    def __init__(self) -> None:
        self.plan: list[str] = []  # the regimes of the windows queued next (a pair's second)
        self.pair: dict[str, tuple[int, dict[int, float]]] = {}  # the running pair's measured windows: regime ->
        #                                                             (tokens, wall seconds per batch size)
        self.regime: str | None = None  # the running window's regime (None: none running)
        self.left = 0  # its request-steps still to run
        self.tokens = 0  # what its measured slots committed ...
        self.seconds: dict[int, float] = {}  # ... and their wall seconds, per batch size
        self.n = self.sum = self.sum2 = 0.0  # decayed sums of the pairs' differences, SELECT's less PLAIN's
        self.pairs = 0  # pairs measured
        self.exploited = 0  # windows run on the evidence alone

    @property
    def mean(self) -> float:
        return self.sum / self.n if self.n > 0 else 0.0

    @property
    def se(self) -> float:
        """The standard error of the mean difference (each pair's spread at least SD_FLOOR)."""
        if self.n <= 1.0:
            return 1.0
        var = max(0.0, self.sum2 / self.n - self.mean ** 2) * self.n / (self.n - 1.0)
        return max(SD_FLOOR, math.sqrt(var)) / math.sqrt(self.n)


class RegimeTrial:
    """Per batch-size bucket: SELECT or PLAIN for the next slot, from pairs of measured windows."""

    def __init__(self, num_buckets: int, plain_s: Callable[[int], float | None], window: int = 64, memory: int = 32,
                 seed: int = 0) -> None:
        """plain_s: a plain forward's predicted seconds at a batch size (None: unknown; read once a window per batch
        size); window: request-steps per window (its slots' batch sizes, summed: a window keeps its regime for slots
        until they reach it; 64 is the 16 slots at batch 4 the trial was measured with); memory: the
        bucket's pairs the mean difference remembers (each pair's weight decays by 1 - 1/memory at every later
        one)."""
        if num_buckets < 1 or window < 1 or memory < 2:
            raise ValueError("need num_buckets >= 1, window >= 1 and memory >= 2")
        self.plain_s = plain_s
        self.window = window
        self._decay = 1.0 - 1.0 / memory
        self._buckets = [_Bucket() for _ in range(num_buckets)]
        self._rng = np.random.default_rng(seed)
        self.slots = {r: 0 for r in REGIMES}  # slots run in each regime (describe)

    def regime(self, bucket: int, batch_size: int) -> str:
        """The regime of the bucket's next slot, of `batch_size` requests: its running window's, or a new window's."""
        b = self._buckets[bucket]
        if b.regime is None or b.left <= 0:
            self._close(b)
            if not b.plan:
                b.plan = self._plan(b)
            b.regime, b.left = b.plan.pop(0), self.window
        b.left -= max(1, batch_size)
        self.slots[b.regime] += 1
        return b.regime

    def record(self, bucket: int, regime: str, tokens: int, batch_size: int, seconds: float) -> None:
        """A slot of `batch_size` requests that ran in `regime` committed `tokens` in `seconds` of wall time. A slot of
        another regime than the bucket's running window, or of no seconds, is not counted."""
        b = self._buckets[bucket]
        if regime != b.regime or seconds <= 0 or batch_size < 1:
            return
        b.tokens += tokens
        b.seconds[batch_size] = b.seconds.get(batch_size, 0.0) + seconds

    def _close(self, b: _Bucket) -> None:
        """The bucket's running window, if it was a pair's, into the pair; a pair with both windows into the mean
        difference. A window with nothing measured voids its pair."""
        window, b.tokens, b.seconds = (b.tokens, b.seconds), 0, {}
        if b.regime is None or (not b.plan and not b.pair):  # a window run on the evidence: not measured into it
            return
        if window[0] <= 0 or not window[1]:
            b.pair.clear()
            b.plan.clear()
            return
        b.pair[b.regime] = window
        if len(b.pair) < len(REGIMES):
            return
        values = {r: self._log_rate(*w) for r, w in b.pair.items()}
        b.pair.clear()
        if None in values.values():
            return
        d = values[SELECT] - values[PLAIN]
        b.n, b.sum, b.sum2 = self._decay * b.n + 1.0, self._decay * b.sum + d, self._decay * b.sum2 + d * d
        b.pairs += 1

    def _log_rate(self, tokens: int, seconds: dict[int, float]) -> float | None:
        """A window's value: log(its tokens / the plain steps its seconds were worth), the plain steps read when its
        pair is complete, so that both of a pair's windows are measured by the same prediction (the cost model
        learns as they run: at a start, ~40% within the first pairs); None where a batch size has no prediction."""
        steps = 0.0
        for batch_size, secs in seconds.items():
            plain_s = self.plain_s(batch_size)
            if not plain_s or plain_s <= 0:
                return None
            steps += batch_size * secs / plain_s
        return math.log(tokens / steps) if steps > 0 else None

    def _plan(self, b: _Bucket) -> list[str]:
        """The next windows: a pair (both regimes, in random order, so that a workload's drift falls on either
        first), until MIN_PAIRS were measured and then with the chance that the evidence is still in doubt (twice
        the chance of the less likely sign of the mean difference, at least EXPLORE_MIN); else one window of
        SELECT, or of PLAIN where SELECT is likely worse (PLAIN_BELOW)."""
        if b.pairs >= MIN_PAIRS:
            p = 0.5 * math.erfc(-b.mean / (b.se * math.sqrt(2.0)))  # P(SELECT beats PLAIN)
            if self._rng.random() >= max(EXPLORE_MIN, 2.0 * min(p, 1.0 - p)):
                b.exploited += 1
                return [SELECT if p > PLAIN_BELOW else PLAIN]
        return list(REGIMES) if self._rng.random() < 0.5 else [PLAIN, SELECT]

    def advantage(self, bucket: int) -> float | None:
        """SELECT's measured gain over PLAIN at the bucket (a ratio of tokens per second, 1 = even; None: no pair
        measured yet)."""
        b = self._buckets[bucket]
        return math.exp(b.mean) if b.pairs else None

    def describe(self) -> dict:
        """slots {regime: slots run}; buckets {bucket: {pairs, exploited (windows run on the evidence), advantage
        (SELECT over PLAIN), spread (its standard error, in log), regime (the running window's)}} for buckets that
        ran a window."""
        out = {}
        for i, b in enumerate(self._buckets):
            if b.regime is None:
                continue
            adv = self.advantage(i)
            out[str(i)] = {"pairs": b.pairs, "exploited": b.exploited,
                           "advantage": None if adv is None else round(adv, 4),
                           "spread": round(b.se, 4) if b.pairs else None, "regime": b.regime}
        return {"slots": dict(self.slots), "buckets": out}
