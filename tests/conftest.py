"""Markers ``gpu`` / ``ep`` / ``multigpu``: skipped automatically without enough CUDA devices; ``slow``: soak tests."""

import sys
from pathlib import Path

import pytest
import torch

# tests/gpu/* import helpers.py and naive.py from here, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "ep: expert-parallel test spawning ranks; needs one CUDA GPU (the ranks share "
                                       "cuda:0 over a gloo group when there are fewer GPUs than ranks, else one GPU "
                                       "each over NCCL); skipped without a GPU")
    config.addinivalue_line("markers", "multigpu: needs two or more distinct CUDA GPUs (skipped otherwise)")
    config.addinivalue_line("markers", "slow: long-running (soak) test; deselect with -m 'not slow'")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        # Markers, not keywords: every test under tests/gpu has the keyword "gpu" (its directory's name), also the
        # unmarked CPU tests there.
        marked = {name for name in ("gpu", "ep", "multigpu") if item.get_closest_marker(name) is not None}
        if "multigpu" in marked and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus}"))
        elif marked & {"gpu", "ep"} and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
