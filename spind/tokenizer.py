"""Tokenizer and chat template from a model directory, without torch or transformers (the coordinator's
process never imports torch; `tokenizers` loads in ~0.1 s where transformers' AutoTokenizer takes ~4 s).

Reads `tokenizer.json` (the fast tokenizer every HF model and our GGUF cache carries), the chat template
from `chat_template.jinja` or `tokenizer_config.json`, and special tokens from `tokenizer_config.json`.

Chat message text is text: content that happens to contain a special token's spelling (`<|im_end|>`)
is encoded as plain characters, never as the special token, so a user cannot forge a role turn.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import tokenizers

SENTINEL = "\x00spind-message-{}\x00"  # stands for a message's content while the template renders


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (spind reads fast tokenizers only)")
        self.tk = tokenizers.Tokenizer.from_file(str(path))
        self._text_tk = tokenizers.Tokenizer.from_file(str(path))  # encodes special-token spellings as text
        self._text_tk.encode_special_tokens = True
        cfg = _read_json(model_dir / "tokenizer_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        eos = model_cfg.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.eos_token and self.tk.token_to_id(self.eos_token) is not None:
            ids.add(self.tk.token_to_id(self.eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        # no token spans more characters: a text over max_model_len * this cannot fit, whatever it tokenizes to
        self.max_token_chars = max(1, max(len(t) for t in self.tk.get_vocab(with_added_tokens=True)))
        template = model_dir / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else cfg.get("chat_template")
        added = self.tk.get_added_tokens_decoder()
        self._special = tuple(t.content for t in added.values() if t.special)
        self._added_ids = frozenset(added)
        self._byte_level = type(self.tk.decoder).__name__ == "ByteLevel"
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)  # logprobs ask for the same ones
        self._compiled = None
        self.prompt_prefix: tuple[int, ...] = self._prompt_prefix()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str) -> list[int]:
        """The text's tokens alone (chat templates and callers place their own special tokens)."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt as the model's own tokenizer encodes it: with BOS where that adds one (LLaMA-2 and
        LLaMA-3 base models degrade without it). Never with a trailing EOS, where the template appends one: a prompt to
        continue must not end the document."""
        return [*self.prompt_prefix, *self.encode(text)]

    def _prompt_prefix(self) -> tuple[int, ...]:
        """The special tokens transformers puts before a text (AutoTokenizer(dir)(text).input_ids): those of
        tokenizer.json's post-processor template. transformers 5 drops tokenizer_config.json's add_bos_token and
        add_eos_token when tokenizer.json exists (its LLaMA-class tokenizers of 4.x rebuilt the template from them
        instead; LLaMA-2, LLaMA-3 and Mistral checkpoints ship both in agreement)."""
        enc = self.tk.encode("a", add_special_tokens=True)  # the template's own tokens are flagged special
        lead = next((i for i, special in enumerate(enc.special_tokens_mask) if not special), None)
        return () if lead is None else tuple(enc.ids[:lead])  # None: "a" has no token here, nothing to tell

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def _token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a byte-level token may hold part of a UTF-8 character, which
        decoding it alone would turn into U+FFFD): byte-level BPE (GPT-2, LLaMA-3, SmolLM) through GPT-2's byte map,
        SentencePiece pieces with "▁" for a space and <0xNN> byte fallbacks (LLaMA-2, Mistral); an added token
        (special or not) is its own spelling."""
        piece = self.tk.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids:
            if self._byte_level and all(c in _GPT2_BYTES for c in piece):
                return bytes(_GPT2_BYTES[c] for c in piece)
            if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
                return bytes([int(m.group(1), 16)])
            piece = piece.replace("\u2581", " ")
        return piece.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """A token's text alone (OpenAI's logprobs "token"): its bytes as UTF-8, a partial character as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages -> prompt ids, with the generation prompt appended. Message contents are encoded
        as text; only the template's own scaffolding may produce special tokens."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use a plain completion prompt")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        if not any(s in m["content"] for m in messages for s in self._special):
            return self.encode(self._render(messages))  # the common case: one pass over the whole text
        sentinels = [SENTINEL.format(i) for i in range(len(messages))]
        text = self._render([{**m, "content": s} for m, s in zip(messages, sentinels)])
        ids: list[int] = []
        for i, s in enumerate(sentinels):
            scaffold, _, text = text.partition(s)
            ids += self.encode(scaffold)
            ids += self._text_tk.encode(messages[i]["content"], add_special_tokens=False).ids
        return ids + self.encode(text)

    def _render(self, messages: list[dict]) -> str:
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "")

    def fingerprint(self) -> tuple[int, str]:
        """What two models must share for one to draft for the other: the whole id -> token map
        (vocab size and a digest of every entry; a sample would miss two swapped ids)."""
        vocab = sorted(self.tk.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        digest = hashlib.sha256("\n".join(f"{i}\t{tok}" for tok, i in vocab).encode()).hexdigest()
        return len(vocab), digest


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies spell bytes so), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_GPT2_BYTES = _gpt2_bytes()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")
