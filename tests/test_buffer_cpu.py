"""primemoe.Buffer without a GPU: the workspace layout, argument checks (all before CUDA and
NVSHMEM are touched), the NVSHMEM environment rules and moe(buffer=...) argument errors."""

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

from helpers import PRIMEMOE_ROOT, make_problem

import primemoe
from primemoe import buffer as buffer_module
from primemoe._validate import MoeShape
from primemoe.buffer import (SYMMETRIC_HEAP_MARGIN, EpConfig, buffer_config, ep_arrivals_per_epoch, ep_layout,
                             ep_region, ep_transport, nvshmem_environment)
from primemoe.ep import check_buffer_problem
from primemoe.ops import layout_max_rows

GOOD_SIZES = dict(max_tokens_per_rank=64, hidden=32, intermediate=16, num_experts=8, top_k=2)


# ---------------------------------------------------------------- workspace layout


HAND_SIZES = dict(world=2, max_tokens=3, hidden=8, top_k=2, local_experts=3, row_align=4)


def test_layout_matches_a_hand_computation():
    # W=2, max_tokens=3, H=8, K=2, E_local=3, row_align=4: S = 6 slots, R = 2*6 + 3*3 = 21 rows.
    config = EpConfig(**HAND_SIZES, put_peers=False)
    assert (config.max_slots, config.max_recv_rows) == (6, 21)
    expected = {  # name: (offset, dtype, shape); each region starts 16-byte aligned after the previous one
        "count_matrix": (0, torch.int32, (2, 2, 3)),  # 48 bytes
        "count_flags": (48, torch.int64, (2,)),  # 16
        "expert_arrivals": (64, torch.int64, (3,)),  # 24 -> 96
        "combine_flags": (96, torch.int64, (2,)),  # 16
        "recv_rows": (112, torch.bfloat16, (21, 8)),  # 336
        "recv_meta": (448, torch.int32, (21,)),  # 84 -> 544
        "recv_weights": (544, torch.float32, (21,)),  # 84 -> 640
        "combine_rows": (640, torch.bfloat16, (6, 8)),  # 96
        "combine_scalars": (736, torch.float32, (6,)),  # 24 -> 768
        "combine_map": (768, torch.int32, (6,)),  # 24 -> 800
        "send_counts": (800, torch.int32, (6,)),  # W * E: 24 -> 832
        "send_offsets": (832, torch.int32, (7,)),  # 28 -> 864
        "send_row_to_slot": (864, torch.int32, (6,)),  # 24 -> 896
        "result_flags": (896, torch.int64, (1,)),  # one per 64 receive rows (+ 1): 8 -> 912
        "result_counts": (912, torch.int32, (1,)),  # 4 -> 928
        "scratch": (928, torch.int32, (6, 10)),  # (W + 1) * E + 1 = 10 per row: 240 -> 1168
        "tile_counter": (1168, torch.int32, (1,)),  # 4 -> 1184
        "stage_rows": (1184, torch.bfloat16, (0, 8)),  # no rank sends by puts: empty
    }
    layout, total = ep_layout(config)
    assert layout == expected
    assert total == 1184
    assert ep_arrivals_per_epoch(config) == 3  # one per source rank, one for this rank's padding


def test_put_peers_add_only_the_staging_region_at_the_end():
    stores, stores_total = ep_layout(EpConfig(**HAND_SIZES, put_peers=False))
    puts, puts_total = ep_layout(EpConfig(**HAND_SIZES, put_peers=True))
    assert puts.pop("stage_rows") == (1184, torch.bfloat16, (21, 8))  # R x H bf16: 336 bytes
    assert puts_total == 1184 + 336
    stores.pop("stage_rows")
    assert puts == stores



def test_layout_is_the_extensions():
    """ep_layout parses the kernels' own table (ep_regions of ep_workspace.cuh): a line per region, the arrival
    counters' gain per dispatch, then the total."""
    config = EpConfig(**HAND_SIZES, put_peers=False)
    lines = torch.ops.primemoe._ep_workspace_layout(*dataclasses.astuple(config)).splitlines()
    assert lines[4] == "recv_rows bfloat16 112 21,8" and lines[-1] == "total 1184"
    assert lines[-2] == "arrivals_per_epoch 3"
    layout, _ = ep_layout(config)
    assert list(layout) == [line.split()[0] for line in lines[:-2]]
    assert layout["recv_rows"][2][0] == config.max_recv_rows

@pytest.mark.parametrize("put_peers", [False, True])
def test_regions_are_views_at_their_offsets(put_peers):
    sizes = dict(HAND_SIZES, put_peers=put_peers)
    layout, total = ep_layout(EpConfig(**sizes))
    workspace = torch.zeros(total, dtype=torch.uint8)
    expected = torch.zeros(total, dtype=torch.uint8)
    for mark, (name, (offset, dtype, shape)) in enumerate(layout.items(), start=1):
        view = ep_region(workspace, name, **sizes)
        assert (view.dtype, tuple(view.shape)) == (dtype, shape), name
        view.view(torch.uint8).fill_(mark)  # a view into the workspace, not a copy
        expected[offset:offset + torch.Size(shape).numel() * dtype.itemsize] = mark
    assert torch.equal(workspace, expected)


@pytest.mark.parametrize("sizes", [
    dict(world=1, max_tokens=1, hidden=8, top_k=1, local_experts=1, row_align=1),
    dict(world=2, max_tokens=3, hidden=8, top_k=2, local_experts=3, row_align=4),
    dict(world=8, max_tokens=4096, hidden=7168, top_k=8, local_experts=32, row_align=1),
    dict(world=4, max_tokens=17, hidden=2048, top_k=6, local_experts=5, row_align=128),
])
@pytest.mark.parametrize("put_peers", [False, True])
def test_regions_are_aligned_disjoint_and_fit(sizes, put_peers):
    layout, total = ep_layout(EpConfig(**sizes, put_peers=put_peers))
    end = 0
    for name, (offset, dtype, shape) in layout.items():
        assert offset % 16 == 0 and offset >= end, name
        end = offset + torch.Size(shape).numel() * dtype.itemsize
    assert end <= total and total % 16 == 0


def test_ep_region_rejects_unknown_names_and_small_workspaces():
    sizes = dict(world=2, max_tokens=3, hidden=8, top_k=2, local_experts=3, row_align=1, put_peers=False)
    _, total = ep_layout(EpConfig(**sizes))
    with pytest.raises(KeyError, match="unknown region 'recv'"):
        ep_region(torch.zeros(total, dtype=torch.uint8), "recv", **sizes)
    with pytest.raises(ValueError, match=f"at least {total} bytes"):
        ep_region(torch.zeros(total - 16, dtype=torch.uint8), "recv_rows", **sizes)
    with pytest.raises(ValueError, match="uint8 workspace"):
        ep_region(torch.zeros(total, dtype=torch.int32), "recv_rows", **sizes)


# ---------------------------------------------------------------- Buffer arguments


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process (no GPU needed)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def no_nvshmem(monkeypatch):
    """Fails the test if the Buffer gets as far as bootstrapping NVSHMEM."""
    def forbidden(*args, **kwargs):
        raise AssertionError("Buffer touched NVSHMEM before rejecting its arguments")
    monkeypatch.setattr(buffer_module, "_start_nvshmem", forbidden)


def test_buffer_needs_a_process_group(no_nvshmem):
    with pytest.raises(TypeError, match="group: expected a torch.distributed.ProcessGroup, got NoneType"):
        primemoe.Buffer(None, **GOOD_SIZES)


@pytest.mark.parametrize("name, value, error, pattern", [
    ("max_tokens_per_rank", 0, ValueError, "max_tokens_per_rank: expected a positive int, got 0"),
    ("hidden", -8, ValueError, "hidden: expected a positive int, got -8"),
    ("intermediate", 16.0, TypeError, "intermediate: expected an int, got float"),
    ("num_experts", True, TypeError, "num_experts: expected an int, got bool"),
    ("top_k", None, TypeError, "top_k: expected an int, got NoneType"),
    ("row_align", 0, ValueError, "row_align: expected a positive int"),
    ("num_sms", -1, ValueError, "num_sms: expected a positive int"),
    ("hidden", 12, ValueError, "hidden: expected a multiple of 8, got 12"),
    ("num_experts", 2048, ValueError, "num_experts: at most 1024 experts are supported, got 2048"),
    ("intermediate", 20, ValueError, "intermediate: expected a multiple of 8, got 20"),
    ("precision", "fp16", ValueError, "precision: expected one of"),
    ("precision", "mxfp8", NotImplementedError, r"precision: 'mxfp8' .* needs a Blackwell \(sm_100\) GPU"),
    ("overlap", 1, TypeError, "overlap: expected a bool, got int"),
    ("overlap_combine", None, TypeError, "overlap_combine: expected a bool, got NoneType"),
    # An FP8 Buffer: hidden, intermediate and row_align multiples of 128.
    ("precision", "fp8", ValueError, "hidden: expected a multiple of 128 with an FP8 precision .*, got 32"),
])
def test_buffer_rejects_bad_sizes(group, no_nvshmem, name, value, error, pattern):
    with pytest.raises(error, match=pattern):
        primemoe.Buffer(group, **dict(GOOD_SIZES, **{name: value}))


FP8_SIZES = dict(GOOD_SIZES, hidden=256, intermediate=128, precision="fp8")


@pytest.mark.parametrize("name, value, pattern", [
    ("intermediate", 64, "intermediate: expected a multiple of 128 with an FP8 precision .*, got 64"),
    ("row_align", 64, "row_align: expected a multiple of 128 with an FP8 precision .*, got 64"),
])
def test_fp8_buffer_rejects_sizes_off_the_fp8_tiles(group, no_nvshmem, name, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        primemoe.Buffer(group, **dict(FP8_SIZES, **{name: value}))


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_buffer_arguments_are_accepted(group, no_nvshmem, monkeypatch, precision):
    """Past the argument checks, the FP8 Buffer gets as far as the bf16 one: here, the missing GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="primemoe.Buffer: needs CUDA"):
        primemoe.Buffer(group, **dict(FP8_SIZES, precision=precision, row_align=256))


def test_buffer_needs_cuda_before_touching_nvshmem(group, no_nvshmem, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="primemoe.Buffer: needs CUDA"):
        primemoe.Buffer(group, **GOOD_SIZES)


def test_experts_must_split_evenly_over_the_ranks():
    with pytest.raises(ValueError, match="num_experts: 8 experts cannot be split evenly over the group's 3 ranks"):
        buffer_config(3, **GOOD_SIZES, row_align=1, num_sms=24)
    assert buffer_config(4, **GOOD_SIZES, row_align=1, num_sms=24).local_experts == 2


def test_max_recv_rows_bounds_the_receive_region():
    """max_recv_rows sizes the receive region (and with it the layer's row buffers) instead of the worst case; the
    kernels' layout (exported from C++) agrees; below a rank's own slots, or not an int: refused."""
    worst = buffer_config(4, **GOOD_SIZES, row_align=8, num_sms=24)
    capped = buffer_config(4, **GOOD_SIZES, row_align=8, num_sms=24, max_recv_rows=200)
    assert worst.recv_capacity == 0 and worst.recv_slots == 4 * 64 * 2
    assert capped.recv_slots == 200 and capped.max_recv_rows == layout_max_rows(200, 2, 8)
    assert ep_layout(capped)[0]["recv_rows"][2] == (capped.max_recv_rows, 32)
    assert ep_layout(capped)[0]["recv_meta"][2] == (capped.max_recv_rows,)
    assert ep_layout(capped)[1] < ep_layout(worst)[1]
    # Above the worst case it is the worst case.
    assert buffer_config(4, **GOOD_SIZES, row_align=8, num_sms=24, max_recv_rows=10 ** 6).max_recv_rows == \
        worst.max_recv_rows
    with pytest.raises(ValueError, match=r"max_recv_rows: expected at least max_tokens_per_rank \* top_k = 128"):
        buffer_config(4, **GOOD_SIZES, row_align=8, num_sms=24, max_recv_rows=127)
    with pytest.raises(TypeError, match="max_recv_rows: expected an int or None, got float"):
        buffer_config(4, **GOOD_SIZES, row_align=8, num_sms=24, max_recv_rows=200.0)
    with pytest.raises(RuntimeError, match="max_recv_rows: expected 0"):
        torch.ops.primemoe._ep_workspace_layout(4, 64, 32, 2, 2, 8, False, 100)


def test_receive_rows_must_fit_int32():
    sizes = dict(GOOD_SIZES, max_tokens_per_rank=2 ** 20, top_k=8, num_experts=256)
    with pytest.raises(ValueError, match="exceed the int32 row index"):
        buffer_config(256, **sizes, row_align=1, num_sms=24)


# ---------------------------------------------------------------- NVSHMEM environment

GIB = 1 << 30


def test_environment_defaults_on_one_host():
    updates, warns = nvshmem_environment({}, ["node0", "node0"], GIB)
    assert updates == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none",
                       "NVSHMEM_SYMMETRIC_SIZE": str(GIB + SYMMETRIC_HEAP_MARGIN)}
    assert warns == []


def test_environment_keeps_the_remote_transport_across_hosts():
    updates, _ = nvshmem_environment({}, ["node0", "node1"], GIB)
    assert "NVSHMEM_REMOTE_TRANSPORT" not in updates


def test_environment_respects_what_the_user_set():
    user = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "ibgda", "NVSHMEM_SYMMETRIC_SIZE": "4G",
            "NVSHMEM_DEBUG": "INFO"}
    assert nvshmem_environment(user, ["node0", "node0"], GIB) == ({}, [])


@pytest.mark.parametrize("value", ["0", "", "false"])
def test_environment_forces_multicast_off_with_a_warning(value):
    updates, warns = nvshmem_environment({"NVSHMEM_DISABLE_NVLS": value}, ["node0"], GIB)
    assert updates["NVSHMEM_DISABLE_NVLS"] == "1"
    assert len(warns) == 1 and "NVLink multicast must stay off" in warns[0] and repr(value) in warns[0]


# ---------------------------------------------------------------- PRIMEMOE_EP_TRANSPORT


def test_transport_is_auto_unless_set():
    assert ep_transport({}) == "auto"
    assert ep_transport({"PRIMEMOE_EP_TRANSPORT": "auto"}) == "auto"
    assert ep_transport({"PRIMEMOE_EP_TRANSPORT": "put"}) == "put"


@pytest.mark.parametrize("value", ["", "PUT", "ibgda", "stores"])
def test_transport_rejects_other_values(value):
    with pytest.raises(ValueError, match=rf"PRIMEMOE_EP_TRANSPORT: expected one of \['auto', 'put'\], got '{value}'"):
        ep_transport({"PRIMEMOE_EP_TRANSPORT": value})


def test_buffer_rejects_a_bad_transport_before_touching_nvshmem(group, no_nvshmem, monkeypatch):
    monkeypatch.setenv("PRIMEMOE_EP_TRANSPORT", "ibgda")
    with pytest.raises(ValueError, match="PRIMEMOE_EP_TRANSPORT: expected one of"):
        primemoe.Buffer(group, **GOOD_SIZES)


@pytest.mark.parametrize("force_put", [False, True])
def test_symmetric_heap_has_room_for_the_staging_region_when_puts_are_forced(group, monkeypatch, force_put):
    """The heap is sized before NVSHMEM can probe the peers: one host, so only forcing puts adds the region."""
    for name in ("NVSHMEM_DISABLE_NVLS", "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_SYMMETRIC_SIZE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever _start_nvshmem sets
    monkeypatch.setattr(buffer_module, "_bootstrap", None)
    monkeypatch.setattr(buffer_module, "_env_set_here", {})
    stub = types.SimpleNamespace(_nvshmem_unique_id=lambda: "id", _nvshmem_init=lambda *args: None,
                                 _ep_workspace_layout=torch.ops.primemoe._ep_workspace_layout)
    monkeypatch.setattr(buffer_module, "lib", stub)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    config = buffer_config(1, **GOOD_SIZES, row_align=128, num_sms=24)
    buffer_module._start_nvshmem(group, 0, 1, 0, config, force_put)
    _, workspace_bytes = ep_layout(dataclasses.replace(config, put_peers=force_put))
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(workspace_bytes + SYMMETRIC_HEAP_MARGIN)


# ---------------------------------------------------------------- moe(buffer=...)


def small_args():
    p = make_problem(5, 16, 8, 4, 2)
    return dict(x=p.x, topk_idx=p.topk_idx, topk_weights=p.topk_weights, w1=p.w1, w2=p.w2)


def test_moe_rejects_a_buffer_that_is_not_a_buffer():
    with pytest.raises(TypeError, match="buffer: expected a primemoe.Buffer or None, got object"):
        primemoe.moe(**small_args(), buffer=object())


def fake_buffer(**changes):
    """The attributes check_buffer_problem reads, for a problem H=16, I=8, K=2, E_local=4 on 2 ranks."""
    fields = dict(closed=False, precision="bf16", device=torch.device("cuda", 0), hidden=16, intermediate=8,
                  top_k=2, local_experts=4, num_experts=8, world=2)
    return types.SimpleNamespace(**dict(fields, **changes))


SHAPE = MoeShape(tokens=5, hidden=16, intermediate=8, top_k=2, local_experts=4, num_experts=8)


def test_a_matching_problem_passes():
    check_buffer_problem(SHAPE, torch.device("cuda", 0), "bf16", fake_buffer())


@pytest.mark.parametrize("changes, device, error, pattern", [
    (dict(closed=True), "cuda:0", RuntimeError, "buffer: this primemoe.Buffer is closed"),
    (dict(device=torch.device("cuda", 1)), "cuda:0", ValueError, r"x: expected a tensor on the buffer's device cuda:1"),
    ({}, "cpu", ValueError, "x: expected a tensor on the buffer's device cuda:0, got cpu"),
    (dict(hidden=32), "cuda:0", ValueError, "x: hidden size H=16 does not match the buffer's hidden=32"),
    (dict(intermediate=16), "cuda:0", ValueError, "w1: intermediate size I=8 does not match"),
    (dict(top_k=4), "cuda:0", ValueError, "topk_idx: 2 slots per token do not match the buffer's top_k=4"),
    (dict(local_experts=2, num_experts=4), "cuda:0", ValueError, "w1: expected this rank's 2 experts"),
])
def test_a_problem_the_buffer_was_not_made_for(changes, device, error, pattern):
    with pytest.raises(error, match=pattern):
        check_buffer_problem(SHAPE, torch.device(device), "bf16", fake_buffer(**changes))


def test_precision_must_be_the_buffers():
    with pytest.raises(ValueError, match="precision: got 'fp8', but the buffer was created with precision='bf16'"):
        check_buffer_problem(SHAPE, torch.device("cuda", 0), "fp8", fake_buffer())


# ---------------------------------------------------------------- collective argument check (two CPU ranks)

TWO_RANKS = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    import primemoe
    rank, store_path, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    sizes = dict(max_tokens_per_rank=64, hidden=32, intermediate=16, num_experts=8, top_k=2)
    if case == "differ" and rank == 1:
        sizes["max_tokens_per_rank"] = 128
    if case == "refused" and rank == 1:
        sizes["hidden"] = 12
    try:
        primemoe.Buffer(dist.group.WORLD, **sizes)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("case, pattern", [
    ("differ", r"ValueError: primemoe.Buffer: max_tokens_per_rank differs between the ranks of the group "
               r"\(rank 0: 64, rank 1: 128\)"),
    ("refused", None),
    ("same", r"RuntimeError: primemoe.Buffer: needs CUDA"),
])
def test_buffer_arguments_are_agreed_on_every_rank(tmp_path, case, pattern):
    """Two gloo ranks on the CPU: arguments that differ between them, or that one rank refuses, raise on both ranks
    (no rank is left waiting in the bootstrap); equal arguments pass the check (and stop at the missing GPU)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PRIMEMOE_ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("PRIMEMOE_EP_TRANSPORT", None)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), store, case], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    lines = [out.strip().splitlines()[-1] if out.strip() else err for out, err in outs]
    if case == "refused":
        assert lines[1] == "ValueError: hidden: expected a multiple of 8, got 12", lines
        assert lines[0].startswith("ValueError: primemoe.Buffer: rank 1 of the group refused its arguments (hidden: "
                                   "expected a multiple of 8, got 12)"), lines
    else:
        for line in lines:
            assert re.match(pattern, line), lines


def test_nvshmem_started_by_another_library_is_refused(group, no_nvshmem, monkeypatch):
    """NVSHMEM already up in the process without a Buffer (torch's symmetric memory on its NVSHMEM backend): a
    clear error before any bootstrap, agreed on by every rank of the group."""
    class Ops:
        def __getattr__(self, name):
            return getattr(torch.ops.primemoe, name)

        @staticmethod
        def _nvshmem_initialized():
            return True

    monkeypatch.setattr(buffer_module, "lib", Ops())
    with pytest.raises(RuntimeError, match="NVSHMEM is already initialised in this process by another library"):
        primemoe.Buffer(group, **GOOD_SIZES)
    monkeypatch.undo()
    assert torch.ops.primemoe._nvshmem_initialized() is False


def test_preloading_the_kernels_is_best_effort():
    """The Buffer loads its layer's kernels at creation (lazy loading would load each at its first launch, which
    waits for the kernels running then); where a kernel cannot load (here: no GPU) nothing is raised."""
    torch.ops.primemoe._preload_kernels()
    torch.ops.primemoe._preload_kernels()
