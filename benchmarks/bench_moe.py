"""Benchmark entry point: ``python benchmarks/bench_moe.py --help`` (same as ``python -m primemoe.bench``)."""

import sys
from pathlib import Path

try:
    import primemoe.bench
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import primemoe.bench

if __name__ == "__main__":
    sys.exit(primemoe.bench.main())
