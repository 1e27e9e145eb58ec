"""Builds spind's CPU kernels at install time (`pip install .`, `pip install -e .`); everything else about the package
is in pyproject.toml.

The kernels are C++ compiled against torch's headers (kernels/csrc, built by torch's extension builder), one build
per instruction set: the install compiles the one this CPU serves with (`cpu_ext.install_isas`) into the package's
`kernels/prebuilt/`, so that no import compiles. A C++ extension is tied to the torch release it was built against:
pyproject.toml pins the build's torch to the one the README installs, and at run time a library whose manifest names
another torch, or sources edited since, is compiled on first use instead (and says so). A machine that cannot build
them (no C++ compiler) still installs: spind then serves with torch's own ops, as `spind drafters` and the log say.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        # an editable install imports spind.kernels from ./kernels, a wheel from its build folder
        out = (ROOT / "kernels" if self.editable_mode else Path(self.build_lib) / "spind" / "kernels") / "prebuilt"
        if os.environ.get("SPIND_SKIP_KERNEL_BUILD"):
            print("spind: SPIND_SKIP_KERNEL_BUILD is set: the CPU kernels compile on first use instead")
            return
        try:
            spec = importlib.util.spec_from_file_location("spind_cpu_ext", ROOT / "kernels" / "cpu_ext.py")
            cpu_ext = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(cpu_ext)  # imports torch, and nothing of spind
            for isa in cpu_ext.install_isas():
                start = time.perf_counter()
                print(f"spind: compiling the {isa} CPU kernels (~{cpu_ext.BUILD_S} s) into {out}", flush=True)
                cpu_ext.prebuild(isa, out)
                print(f"spind: built {isa} in {time.perf_counter() - start:.0f} s", flush=True)
        except Exception as e:  # no compiler, no torch: install anyway; the first use compiles or falls back
            print(f"spind: WARNING: the CPU kernels were not built at install ({type(e).__name__}: {e}); "
                  f"they compile on first use, or spind serves with torch's ops")


class BinaryDistribution(Distribution):
    """A wheel carrying a compiled library is platform-specific."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
