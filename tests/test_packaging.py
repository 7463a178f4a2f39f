"""The built extension loads and registers every op; the version carries a CUDA local label."""

import ast
import importlib.metadata
from pathlib import Path

import pytest
import torch

import primemoe

OPS = ("moe_forward", "moe_backward", "dispatch_layout", "gather_rows", "combine_reduce", "slot_dot", "gather_scalars",
       "take_error", "describe_error", "fc1_swiglu", "expert_gemm", "fc2_dgrad_swiglu", "expert_wgrad",
       "expert_gemm_unsupported", "paired_gemm_launches")
SETUP_PY = Path(__file__).resolve().parents[1] / "setup.py"


def test_extension_loads():
    from primemoe import _C

    assert Path(_C.__file__).exists()


@pytest.mark.parametrize("name", OPS)
def test_op_is_registered(name):
    assert hasattr(torch.ops.primemoe, name)
    assert getattr(torch.ops.primemoe, name).default._schema.name == f"primemoe::{name}"


def test_gemm_instantiation_files_are_current():
    """csrc/gemm/instantiations/ is generated: the checked-in files match the generator."""
    import subprocess
    import sys

    script = SETUP_PY.parent / "scripts" / "gen_gemm_instantiations.py"
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0


def test_take_error_is_empty_on_a_fresh_device_index():
    # No kernel ever ran against device 7 in this process: there is no record to report.
    assert torch.ops.primemoe.take_error(7) == []
    assert torch.ops.primemoe.take_error(1 << 32) == []  # not device 0's record, cast


def test_no_paired_gemm_launch_is_counted_without_one():
    # Nothing launched on device 7 in this process; indices outside the per-device counters read 0 too.
    assert [torch.ops.primemoe.paired_gemm_launches(d) for d in (7, -1, 1 << 20, 1 << 32)] == [0, 0, 0, 0]


def test_check_errors_is_quiet_without_errors():
    primemoe.check_errors()


def test_public_api():
    for name in primemoe.__all__:
        assert hasattr(primemoe, name), name
    assert issubclass(primemoe.DeviceError, RuntimeError)


def local_version_from_setup_py(archs):
    """setup.py's local_version(), without running setup()."""
    tree = ast.parse(SETUP_PY.read_text())
    keep = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name == "local_version")
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "VERSION" for t in node.targets))]
    namespace = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(SETUP_PY), "exec"), namespace)
    return namespace["local_version"](archs)


def torch_major_minor():
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(torch.version.cuda is None, reason="the wheel is built with a CUDA torch")
def test_setup_py_version_has_cuda_local_label():
    version = local_version_from_setup_py(["90a", "100a"])
    assert version.startswith("0.1.0+cu"), version
    cuda = torch.version.cuda.replace(".", "")
    for part in (f"+cu{cuda}", f"torch{torch_major_minor()}", "sm90a", "sm100a"):
        assert part in version, f"{part} missing from {version}"


def test_installed_version_has_cuda_local_label():
    try:
        version = importlib.metadata.version("primemoe")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("primemoe is not installed (running from the source tree)")
    assert "+cu" in version and f"torch{torch_major_minor()}" in version, version
    assert primemoe.__version__ == version
