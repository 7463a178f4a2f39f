"""The built extension uses PyTorch's stable ABI only, and CPython's limited API only (csrc/binding/common.h).

torch-abi-audit (PyPI; scripts/setup.sh installs it, as CI does) reads the extension's undefined symbols: any symbol
of libtorch / libc10 outside the stable C shims makes it UNSTABLE, and the extension would then load only into the
exact torch it was built against. The wheel's promise (one build for torch >= 2.10 and CPython >= 3.10) rests on it.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from primemoe import _C

# The stable ABI the binding targets (setup.py's TORCH_TARGET_VERSION): the audit's minimum may not exceed it.
TARGET_TORCH = (2, 10)


def audit_tool():
    beside = Path(sys.executable).parent / "torch-abi-audit"  # the venv's, when PATH lacks it
    return str(beside) if beside.exists() else shutil.which("torch-abi-audit")


@pytest.fixture(scope="module")
def report():
    tool = audit_tool()
    if tool is None:
        pytest.skip("torch-abi-audit is not installed (pip install torch-abi-audit; scripts/setup.sh does)")
    out = subprocess.run([tool, "--json", _C.__file__], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["error"] is None, data["error"]
    (ext,) = data["extensions"]
    assert ext["error"] is None, ext["error"]
    return ext


def test_extension_is_built_for_the_limited_api():
    assert Path(_C.__file__).name.startswith("_C.abi3."), _C.__file__


def test_only_stable_torch_symbols(report):
    torch_report = report["torch"]
    assert torch_report["uses_torch"]
    assert torch_report["stable"] and not torch_report["unstable_symbols"], (
        "unstable torch symbols (csrc/binding must use torch/csrc/stable and torch/headeronly only): "
        + ", ".join(torch_report["unstable_symbols"]))


def test_min_torch_is_the_target(report):
    version = report["torch"]["min_torch_version"]
    assert version, report["torch"]
    assert tuple(int(v) for v in version.split(".")[:2]) <= TARGET_TORCH, version


def test_cpython_limited_api_only(report):
    cpython = report["cpython"]
    assert cpython["compliant"] and not cpython["violations"], cpython["violations"]
