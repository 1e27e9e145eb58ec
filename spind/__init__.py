"""spind: an LLM serving daemon built on speculative decoding with heterogeneous draft models."""
