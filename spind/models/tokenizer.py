"""Tokenizer + chat template from the model directory (never a hub)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        cfg = json.loads((model_dir / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.vocab_size = len(self.hf)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages -> prompt ids (with the generation prompt appended)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use a plain completion prompt")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)

    def fingerprint(self) -> tuple[int, str]:
        """What two models must share for one to draft for the other: the whole id -> token map
        (vocab size and a digest of every entry; a sample would miss two swapped ids)."""
        vocab = sorted(self.hf.get_vocab().items(), key=lambda kv: kv[1])
        digest = hashlib.sha256("\n".join(f"{i}\t{tok}" for tok, i in vocab).encode()).hexdigest()
        return len(vocab), digest

