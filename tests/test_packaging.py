"""The built extension loads and registers every op; the version carries a CUDA local label."""

import ast
import re
from pathlib import Path

import pytest
import torch

import primemoe

# The documented surface of torch.ops.primemoe.
OPS = ("moe_forward", "moe_backward", "dispatch_layout", "gather_rows", "combine_reduce", "slot_dot",
       "gather_scalars", "copy_routed_rows", "zero_unrouted_rows", "fc1_swiglu", "expert_gemm", "fc2_dgrad_swiglu",
       "expert_wgrad", "expert_wgrad_accumulate", "expert_gemm_unsupported", "ep_dispatch", "ep_combine",
       "quantize_fp8_1x128", "quantize_fp8_128x1", "quantize_fp8_128x128", "fp8_swiglu_quant", "fp8_swiglu_backward",
       "fp8_expert_gemm", "fp8_expert_wgrad", "fp8_expert_wgrad_accumulate")
# Called by the Python package (and tests) only: a leading underscore, not documented.
INTERNAL_OPS = ("_ep_moe_forward", "_ep_moe_backward", "_layout_max_rows", "_constant", "_gemm_force_config",
                "_nvshmem_unique_id", "_nvshmem_init", "_nvshmem_finalize", "_nvshmem_initialized",
                "_nvshmem_peers_need_put", "_ep_workspace_layout", "_ep_workspace_alloc", "_ep_workspace_free",
                "_take_error", "_describe_error", "_check_args", "_set_num_sms", "_num_sms_budget",
                "_preload_kernels")
SETUP_PY = Path(__file__).resolve().parents[1] / "setup.py"


def test_extension_loads():
    from primemoe import _C

    assert Path(_C.__file__).exists()


@pytest.mark.parametrize("name", OPS + INTERNAL_OPS)
def test_op_is_registered(name):
    assert hasattr(torch.ops.primemoe, name)
    assert getattr(torch.ops.primemoe, name).default._schema.name == f"primemoe::{name}"


def test_every_op_is_documented_or_internal():
    registered = {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("primemoe::")}
    assert registered == set(OPS) | set(INTERNAL_OPS), (
        "add a new op to OPS (documented) or, named with a leading underscore, to INTERNAL_OPS")
    assert not any(name.startswith("_") for name in OPS)
    assert all(name.startswith("_") for name in INTERNAL_OPS)


def test_gemm_instantiation_files_are_current():
    """csrc/gemm/instantiations/ is generated: the checked-in files match the generator."""
    import subprocess
    import sys

    script = SETUP_PY.parent / "scripts" / "gen_gemm_instantiations.py"
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0


def test_take_error_is_empty_on_a_fresh_device_index():
    # No kernel ever ran against device 7 in this process: there is no record to report.
    assert torch.ops.primemoe._take_error(7) == []
    assert torch.ops.primemoe._take_error(1 << 32) == []  # not device 0's record, cast


def test_constants_come_from_the_extension():
    from primemoe import _constants

    lib = torch.ops.primemoe
    assert (_constants.ROW_ALIGN, _constants.TILE_N, _constants.SWIGLU_TILE_N, _constants.MAX_LOCAL_EXPERTS) == (
        lib._constant("gemm_row_align"), lib._constant("gemm_tile_n"), lib._constant("gemm_swiglu_tile_n"),
        lib._constant("layout_max_local_experts"))
    assert _constants.TILE_N % _constants.ROW_ALIGN == 0 and _constants.TILE_N == 2 * _constants.SWIGLU_TILE_N
    with pytest.raises(RuntimeError, match="name: expected one of gemm_row_align, .*, got 'tile'"):
        lib._constant("tile")


@pytest.mark.parametrize("slots, local_experts, row_align", [(0, 1, 1), (18, 4, 64), (7, 3, 128), (2 ** 31, 1024, 1)])
def test_layout_max_rows_is_the_extensions(slots, local_experts, row_align):
    """The symbolic form (torch.compile's fake kernels) gives the extension's bound."""
    from primemoe._constants import layout_max_rows

    class NotAnInt(int):  # takes the expression's path, as a SymInt would
        pass

    want = torch.ops.primemoe._layout_max_rows(slots, local_experts, row_align)
    assert layout_max_rows(slots, local_experts, row_align) == want
    assert layout_max_rows(NotAnInt(slots), local_experts, row_align) == want


@pytest.mark.parametrize("claim_tiles, merge_tails", [(1, -1), (-1, 0), (2, 0), (0, 5)])
def test_gemm_force_config_takes_both_fields(claim_tiles, merge_tails):
    with pytest.raises(RuntimeError, match="_gemm_force_config: expected claim_tiles and merge_tails both 0 or 1"):
        torch.ops.primemoe._gemm_force_config(claim_tiles, merge_tails)


def test_gemm_force_config_sets_and_clears():
    torch.ops.primemoe._gemm_force_config(1, 0)
    torch.ops.primemoe._gemm_force_config()  # cleared: the heuristics decide again


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
    from primemoe import _runtime

    version = _runtime.version()
    if version.endswith("+source"):
        pytest.skip("primemoe is not installed (running from the source tree)")
    assert "+cu" in version, version
    # The torch it was built against: any minor >= 2.10 may run it (the stable ABI, tests/test_stable_abi.py).
    built = re.search(r"\.torch(\d+)\.(\d+)\.", version)
    assert built and (2, 10) <= (int(built[1]), int(built[2])), version
    assert primemoe.__version__ == version
