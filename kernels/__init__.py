"""spind's CPU and GPU kernels, installed as `spind.kernels` (pyproject.toml maps this folder there).

Run from a checkout with the repository root on sys.path (`python -m ...` or `python -c` in it, as the README's test
command does), this folder is also importable as a top-level `kernels`, the import name of PyPI's `kernels` (Hugging
Face's hub kernels), which transformers >= 5.25 depends on and imports with its models: this folder would then stand in
for it and every transformers model would fail to import. So where this is imported as `kernels` and that package is
installed, the import is handed over to it; where it is not installed, this folder stays what `kernels` finds (an
empty package, as transformers before 5.25 saw it)."""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import returns what sys.modules holds once this file has run
        _spec.loader.exec_module(_module)
