"""Benchmarks, run from the repository root either as `python -m bench.X` or as `python bench/X.py`.

Each script's first project import is `import _repo` (bench/_repo.py), which puts the repository
root on sys.path, so that `voicebot`, `tests` and `bench` are this checkout's either way. Run as a
file, Python puts only bench/ on sys.path, so `_repo` is found there; run as a module, this package
is imported first and puts bench/ there too (appended: it never shadows an installed name).
"""

import sys
from pathlib import Path

_BENCH_DIR = str(Path(__file__).resolve().parent)
if _BENCH_DIR not in sys.path:
    sys.path.append(_BENCH_DIR)
