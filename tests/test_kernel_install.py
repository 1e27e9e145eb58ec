"""The CPU kernels an install builds (setup.py -> kernels/prebuilt): an import loads them only where they match this
checkout's sources and this torch, and otherwise compiles on first use and says so; a torch build lock left behind by
a killed compile no longer hangs every later import. No compiler runs here: the libraries are the ones the install
built, or none."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from spind.kernels import cpu_ext

ISAS = cpu_ext.supported_isas()
needs_x86 = pytest.mark.skipif(not ISAS, reason="no AVX2 or AVX-512 VNNI: no kernel builds on this CPU")


@needs_x86
def test_the_install_builds_what_this_cpu_serves_with() -> None:
    isas = cpu_ext.install_isas()
    assert isas[0] == ISAS[0]
    assert isas == (ISAS[:2] if ISAS[0] == "avx512amx" else ISAS[:1])  # AMX: with the VNNI build it falls back to


@needs_x86
def test_a_manifest_serves_only_its_own_sources_and_torch(tmp_path: Path, monkeypatch) -> None:
    isa, prebuilt = ISAS[0], tmp_path / "prebuilt"
    monkeypatch.setattr(cpu_ext, "PREBUILT", prebuilt)
    assert cpu_ext._prebuilt(isa) == (None, "the install built none")  # a folder the install never made
    prebuilt.mkdir()
    lib = prebuilt / f"spind_cpu_{isa}.so"
    lib.write_bytes(b"\x7fELF")
    manifest = prebuilt / f"spind_cpu_{isa}.json"

    def write(fingerprint: str, torch_version: str) -> None:
        manifest.write_text(json.dumps({"isa": isa, "fingerprint": fingerprint, "torch": torch_version}))

    write(cpu_ext.fingerprint(isa), torch.__version__)
    assert cpu_ext._prebuilt(isa) == (lib, "")
    write("0" * 16, "1.0.0")
    path, why = cpu_ext._prebuilt(isa)
    assert path is None and why == f"the install built it against torch 1.0.0, this is torch {torch.__version__}"
    write("0" * 16, torch.__version__)
    assert cpu_ext._prebuilt(isa) == (None, "its sources changed since the install")
    other = "avx2" if isa != "avx2" else "avx512vnni"
    assert cpu_ext._prebuilt(other) == (None, f"the install built no {other} library")


def test_the_fingerprint_covers_sources_headers_flags_and_torch(monkeypatch) -> None:
    base = cpu_ext.fingerprint("avx2")
    assert cpu_ext.fingerprint("avx512vnni") != base  # another build's flags
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_ext.fingerprint("avx2") != base


@needs_x86
def test_this_install_loads_its_build_without_compiling() -> None:
    """What `pip install -e .` (README command 1, .ci/run) left in kernels/prebuilt serves this checkout: no import
    compiles. Skipped where the checkout was never installed with the build (SPIND_SKIP_KERNEL_BUILD, no compiler)."""
    if not cpu_ext.PREBUILT.is_dir():
        pytest.skip(f"no install-time build in {cpu_ext.PREBUILT} (SPIND_SKIP_KERNEL_BUILD, or no compiler)")
    for isa in cpu_ext.install_isas():
        path, why = cpu_ext._prebuilt(isa)
        assert path is not None, f"{isa}: {why}: run `pip install -e .` again after editing kernels/csrc"


def test_a_slow_step_is_said_and_a_quick_one_is_not(capsys) -> None:
    with cpu_ext._said_if_slow("compiling something", after_s=0.05):
        time.sleep(0.4)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "spind: compiling something" and err[1].startswith("spind: done in ")
    with cpu_ext._said_if_slow("compiling something", after_s=30):
        pass
    assert capsys.readouterr().err == ""


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "spind_cpu_test" / "lock"
    lock.parent.mkdir()
    lock.touch()
    cpu_ext._remove_stale_lock("spind_cpu_test")
    assert lock.exists()  # a compile running now holds it
    old = time.time() - cpu_ext.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_ext._remove_stale_lock("spind_cpu_test")
    assert not lock.exists()


def test_another_checkout_run_beside_an_editable_install_is_named(tmp_path: Path) -> None:
    # `spind.kernels` resolves through the install's finder, so a checkout run by PYTHONPATH runs the install's kernels
    mine, other = tmp_path / "mine", tmp_path / "other"
    for checkout in (mine, other):
        (checkout / "spind").mkdir(parents=True)
        (checkout / "kernels" / "csrc").mkdir(parents=True)
    assert cpu_ext.foreign_checkout(other / "spind", mine / "kernels") == other / "kernels"
    assert cpu_ext.foreign_checkout(mine / "spind", mine / "kernels") is None
    assert cpu_ext.foreign_checkout(tmp_path / "site-packages" / "spind", mine / "kernels") is None  # a wheel's
    assert cpu_ext.foreign_checkout(Path(cpu_ext.__file__).parent.parent / "spind") is None  # this checkout
