"""A built wheel works on its own: built from a copy of this checkout, installed into a fresh virtual environment
(torch and the other dependencies from this interpreter's site-packages, nothing downloaded), then `spind generate`
run from a directory outside the checkout, on the kernels the wheel's build compiled. It reads the embedded config.toml
from the installed package, not from the checkout (which only an editable install can see)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "README.md", "config.toml", "spind", "kernels", "dashboard")


def _run(argv: list, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.e2e
def test_an_installed_wheel_generates_with_its_embedded_config(tmp_path):
    # build from a copy: an in-tree build would leave build/ and egg-info in the checkout
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():  # symlinks=True: spind/config.toml stays a link, as committed
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "prebuilt"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist,
          src], tmp_path, env)
    (wheel,) = dist.glob("spind-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp_path, env)
    python, spind = venv / "bin" / "python", venv / "bin" / "spind"
    # this interpreter's pip installs into the venv (--python needs pip >= 22.3); nothing is downloaded
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         tmp_path, env)

    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing there to import or to read a config from
    elsewhere.mkdir()
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = _run([python, "-c", "import spind, spind.config as c; print(spind.__file__); print(c.DEFAULT_CONFIG_PATH)"],
                 elsewhere, env).split()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert [Path(p) for p in where] == [site / "spind" / "__init__.py", site / "spind" / "config.toml"], where
    assert (site / "spind" / "config.toml").is_file() and not (site / "spind" / "config.toml").is_symlink()
    assert (site / "spind" / "config.toml").read_text() == (ROOT / "config.toml").read_text()

    assert {"quant_gemm.cpp", "ops.h"} <= {p.name for p in (site / "spind" / "kernels" / "csrc").iterdir()}

    # The wheel carries this CPU's kernel build (setup.py compiled it against this torch): the quantized default
    # target runs on it with no compile, in a torch extensions directory of its own that stays empty.
    from spind.kernels import cpu_ext

    if cpu_ext.supported_isas():
        built = {p.name for p in (site / "spind" / "kernels" / "prebuilt").iterdir()}
        assert {f"spind_cpu_{isa}.{ext}" for isa in cpu_ext.install_isas() for ext in ("so", "json")} <= built
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    env.pop("SPIND_CPU_ISA", None)
    out = subprocess.run([spind, "generate", "--prompt", "The capital of France is", "--max-tokens", "3",
                          "--drafter", "none", "--threads", "1"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "config file not found" not in out.stderr
    assert "compiling the" not in out.stderr and not (tmp_path / "torch_extensions").exists(), out.stderr[-2000:]
    assert out.stdout.strip(), out.stderr[-2000:]  # the generated text
    assert "[3 tokens in " in out.stderr, out.stderr[-2000:]  # and its summary line
