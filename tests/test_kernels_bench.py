"""`spind bench verify`'s pure parts: argument checks (before any model loads), the in-flight contexts, the
memory probe, and the tables drawn from a results dict. The bench itself is a command, not a test."""

from __future__ import annotations

import argparse

import pytest
import torch

from spind.bench.cli import verify_settings
from spind.bench.verify import interleaved, peak_bytes, render_tables, with_generated


def args(**overrides) -> argparse.Namespace:
    base = dict(batch_sizes="1,16", modes=None, query_len=5, ks="1,4", num_batches=2, generated=0, repeats=3,
                rows_per_seq=2.0, no_forward=False, device="cpu", datasets_dir=None)
    return argparse.Namespace(**{**base, **overrides})


def test_settings_default_to_the_torch_modes_and_reject_bad_arguments(tmp_path) -> None:
    s = verify_settings(args(datasets_dir=tmp_path))
    assert s.modes == ("padded", "decomposed", "packed") and s.batch_sizes == (1, 16) and s.ks == (1, 4)
    for bad, message in ((dict(modes="packed,flash"), "unknown attention mode"),
                         (dict(modes="triton-packed"), "needs --device cuda"),
                         (dict(batch_sizes="1,x"), "comma-separated integers"), (dict(ks="0"), ">= 1"),
                         (dict(generated=-1), "--generated"), (dict(device="tpu"), "--device")):
        with pytest.raises(ValueError, match=message):
            verify_settings(args(datasets_dir=tmp_path, **bad))


def test_in_flight_contexts_extend_each_prompt_by_at_most_n_tokens() -> None:
    prompts = [[1, 2, 3], [4, 5], [6] * 40]
    longer = with_generated(prompts, 10)
    assert longer == with_generated(prompts, 10)  # seeded
    assert all(ids[:len(p)] == p and len(p) <= len(ids) <= len(p) + 10 for p, ids in zip(prompts, longer))
    assert with_generated(prompts, 0) == prompts


def test_peak_bytes_sees_a_temporary_that_is_freed_before_the_end() -> None:
    def step() -> None:
        big = torch.ones(1 << 20)  # 4 MiB, dropped before the small result
        del big
        torch.ones(1024)

    assert 4 << 20 <= peak_bytes(step, torch.device("cpu")) < 5 << 20


def test_interleaved_times_each_function() -> None:
    calls = {"a": 0, "b": 0}

    def bump(name: str):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    medians = interleaved({"a": bump("a"), "b": bump("b")}, repeats=3, sync=lambda: None)
    assert set(medians) == {"a", "b"} and calls == {"a": 4, "b": 4}  # one warm-up, three timed


def test_tables_show_each_mode_and_the_ratios() -> None:
    modes = ("padded", "decomposed", "packed")
    summary = [{"batch_size": b, "mode": m, "attention_ms": a, "forward_ms": 10 * a, "peak_mib": 1.0,
                "kv_slots": 100, "exact_kv": 80}
               for b in (1, 16) for m, a in zip(modes, (2.0, 1.0, 0.5))]
    ratios = [{"batch_size": 1, "mode": m, "k": 4, "decode_ms": 50.0, "verify_ms": 60.0, "ratio": 1.2} for m in modes]
    results = {"settings": {"modes": modes, "batch_sizes": (1, 16), "query_len": 5, "repeats": 3, "num_batches": 2,
                            "generated": 0, "with_forward": True},
               "environment": {"threads": 1}, "summary": summary, "ratios": ratios}
    text = render_tables(results)
    assert "decomposed/padded" in text and "packed/decomposed" in text and "k=4" in text
    row16 = next(line for line in text.splitlines() if line.startswith("16 "))
    assert row16.split()[1:6] == ["2.00", "1.00", "0.50", "0.50", "0.50"]
