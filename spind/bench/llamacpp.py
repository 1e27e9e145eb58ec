"""llama.cpp's plain decoding of the same GGUF, for `spind bench decode --llama-cpp` (benchmark only).

Imports llama-cpp-python (the optional extra `bench-llamacpp`); nothing else in spind does.
"""

from __future__ import annotations

import time
from pathlib import Path


class LlamaCppDecoder:
    """Greedy decoding of token ids with llama.cpp at a fixed thread count."""

    def __init__(self, gguf_path: Path, threads: int, max_context: int) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise RuntimeError("--llama-cpp needs llama-cpp-python: pip install -e '.[bench-llamacpp]'") from e
        self.llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=max_context,
                         n_batch=512, verbose=False)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        """Exactly `max_tokens` greedy tokens (EOS ignored, as spind's side runs with ignore_eos) and the seconds
        from the prompt to the last token, prefill included."""
        tokens: list[int] = []
        self.llm.reset()  # else llama-cpp-python reuses the KV of a shared prompt prefix from the last call
        start = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            tokens.append(tok)
            if len(tokens) == max_tokens:
                break
        return tokens, time.perf_counter() - start
