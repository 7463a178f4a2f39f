"""MoE layer benchmark: primemoe, the PyTorch baseline and the reference, side by side.

    python -m primemoe.bench [--shapes ...] [--tokens ...] [--ep 1 2] [--precision bf16 fp8 fp8_bwd] [--impl ...]
                             [--out DIR] [--no-raw]
    python -m primemoe.bench --comm [--ep 2] [--num-sms 8 16 24] ...

Every (shape, tokens per rank, EP, precision, implementation) is timed along two paths, forward and backward
separately, with CUDA events: warm-up, then the median of ``--iters``, L2 flushed (a 256 MB write) before every
timed region.

- The user path, the headline: what training calls. ``primemoe.moe`` and ``primemoe.baseline.moe`` on inputs that
  require grad (the forward saves for backward), then ``torch.autograd.grad(y, [x, topk_weights, w1, w2], dy)``.
  The implementations of a (shape, tokens, EP, precision) run one after another, each its iterations back to back,
  with no idle time between them. One more forward+backward of each gives its peak memory
  (``torch.cuda.max_memory_allocated`` above what was allocated before it), reported beside the baseline's.
- The raw ops (``--no-raw`` skips them): each implementation's own entry points, timed alone after ``--settle``
  idle seconds (the GPU's heat from the case before would otherwise slow the next: benchmarks/RESULTS.md,
  sixteenth session): ``torch.ops.primemoe.moe_forward`` / ``moe_backward``, ``baseline.forward`` / ``backward``,
  the reference through autograd. At EP > 1 primemoe has no entry point below ``primemoe.moe(buffer=)``: its raw
  timing is that call alone.

TFLOP/s are per GPU and counted as in DESIGN.md section 6: forward 6*T*K*H*I, backward 12*T*K*H*I (T = tokens per
rank, no credit for recomputation). EP > 1 spawns one process per GPU (NCCL, multicast off); an iteration's time
there is the max over ranks, which is what a training step sees.
``--comm`` times the row exchange alone instead (dispatch and combine, EP > 1 only):
primemoe.Buffer at each ``--num-sms``, NCCL all_to_all_single and torch's symm_mem
all_to_all_vdev moving the same rows, in GB/s of the bytes that cross to other GPUs.
Writes a progress line per case, a final table, and DIR/results.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from primemoe._validate import BUILT_PRECISIONS, PRECISIONS
from primemoe.shapes import MODEL_SHAPES, TARGET_SHAPES  # TARGET_SHAPES: the default --shapes

SHAPES = {name: shape.dims for name, shape in MODEL_SHAPES.items()}  # name: (H, I, E, K), as the scripts read them
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
L2_FLUSH_BYTES = 256 << 20
MIB = 1 << 20
NCCL_TIMEOUT = datetime.timedelta(minutes=5)  # a rank that fails inside a collective must not hang the run
# The issue's numbers, printed beside --comm results: GB/s per GPU and direction.
COMM_TARGET_GBPS, COMM_TARGET_MIN_TOKENS, COMM_TARGET_MAX_SMS, NCCL_ISSUE_GBPS = 300, 8192, 24, 255
COMM_TARGETS = (f"targets (issue): primemoe >= {COMM_TARGET_GBPS} GB/s per direction at >= {COMM_TARGET_MIN_TOKENS} "
                f"tokens/rank with <= {COMM_TARGET_MAX_SMS} SMs; NCCL ~{NCCL_ISSUE_GBPS} GB/s")


# ---------------------------------------------------------------- metrics

def fwd_flops(tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """FC1 (2I x H) + FC2 (H x I) per routed row, 2 FLOPs per multiply-add."""
    return 6 * tokens * top_k * hidden * inter


def bwd_flops(tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """dgrad + wgrad of both GEMMs: twice the forward."""
    return 12 * tokens * top_k * hidden * inter


def remote_rows(topk_idx: torch.Tensor, experts_per_rank: int, rank: int) -> int:
    """Routed rows of this rank's tokens whose expert lives on another rank (-1 slots excluded)."""
    owner = torch.div(topk_idx, experts_per_rank, rounding_mode="floor")
    return int(((topk_idx >= 0) & (owner != rank)).sum())


def direction_bytes(rows: float, hidden: int, elem_bytes: int = 2) -> float:
    """Bytes ``rows`` bf16 rows of width ``hidden`` move in one direction (dispatch or combine)."""
    return rows * hidden * elem_bytes


def nvlink_bytes(rows: int, hidden: int, elem_bytes: int = 2) -> int:
    """Forward cross-rank traffic of ``rows`` remote rows: dispatch out plus combine back, bf16."""
    return 2 * rows * hidden * elem_bytes


def comm_target(case, gbps: float) -> Optional[str]:
    """The issue's number for this case, and whether ``gbps`` (the slower direction) meets it."""
    if case.impl == "nccl":
        return f"~{NCCL_ISSUE_GBPS} (NCCL, issue)"
    if case.impl == "primemoe" and case.tokens >= COMM_TARGET_MIN_TOKENS and case.num_sms <= COMM_TARGET_MAX_SMS:
        return f">= {COMM_TARGET_GBPS}: {'met' if gbps >= COMM_TARGET_GBPS else 'missed'}"
    return None


# ---------------------------------------------------------------- implementations
# An implementation has a raw runner, made from (inputs, group, case, shape context): forward() returns the state
# that backward(state, dy) needs. One with a user path also names the differentiable call training makes, made from
# (group, case, shape context). Adding an implementation is one entry in IMPLS (layer) or COMM_IMPLS (--comm:
# forward = dispatch, backward = combine).

class _UserPath:
    """What training does: ``moe`` under grad mode on leaves that require grad (the forward saves for backward),
    then torch.autograd.grad of those four leaves (nothing accumulates into .grad)."""

    def __init__(self, moe: Callable, inp):
        self.moe, self.topk_idx = moe, inp.topk_idx
        self.leaves = [t.detach().requires_grad_() for t in (inp.x, inp.topk_weights, inp.w1, inp.w2)]

    def forward(self):
        x, topk_weights, w1, w2 = self.leaves
        with torch.enable_grad():
            return self.moe(x, self.topk_idx, topk_weights, w1, w2)

    def backward(self, y, dy):
        return torch.autograd.grad(y, self.leaves, dy)


class _MainGradPath(_UserPath):
    """The user path with fp32 main gradients on w1 / w2 (gradient-accumulation fusion): the backward adds the weight
    gradients into them inside the weight-gradient GEMMs; autograd.grad of x and topk_weights."""

    def __init__(self, moe: Callable, inp):
        super().__init__(moe, inp)
        for w in self.leaves[2:]:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def backward(self, y, dy):
        return torch.autograd.grad(y, self.leaves[:2], dy)


class _SeparateMainGradPath(_UserPath):
    """The plain user path, then each weight gradient added into an fp32 main gradient: what a framework does
    without the fusion (a pass over dw1 and dw2)."""

    def __init__(self, moe: Callable, inp):
        super().__init__(moe, inp)
        self.main_grads = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in self.leaves[2:]]

    def backward(self, y, dy):
        grads = torch.autograd.grad(y, self.leaves, dy)
        for main_grad, dw in zip(self.main_grads, grads[2:]):
            main_grad.add_(dw)
        return grads[:2]


def _path_raw(path: type, user: Callable):
    def make(inp, group, case, ctx):
        return path(user(group, case, ctx), inp)
    return make


def _primemoe_moe(group, case, ctx) -> Callable:
    """primemoe.moe; EP>1: through the shape's Buffer."""
    import primemoe
    buffer = None if group is None else ctx.buffer(precision=case.precision)
    return partial(primemoe.moe, buffer=buffer, precision=case.precision)


def _buffer_moe(overlap: bool, combine: bool = False):
    def make(group, case, ctx) -> Callable:
        """primemoe.moe(buffer=) at every EP, EP = 1 over a Buffer of one rank."""
        import primemoe
        buffer = ctx.buffer(precision=case.precision, overlap=overlap, overlap_combine=combine)
        return partial(primemoe.moe, buffer=buffer, precision=case.precision)
    return make


def _buffer_raw(overlap: bool, combine: bool = False):
    def make(inp, group, case, ctx):
        return _UserPath(_buffer_moe(overlap, combine)(group, case, ctx), inp)
    return make


def _baseline_moe(group, case, ctx) -> Callable:
    from primemoe import baseline
    return partial(baseline.moe, group=group)


class _BaselineRaw:
    """baseline.forward / backward: the baseline's two halves without autograd."""

    def __init__(self, inp, group, case, ctx):
        from primemoe import baseline
        self.mod, self.inp, self.group = baseline, inp, group

    def forward(self):
        i = self.inp
        return self.mod.forward(i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, group=self.group)

    def backward(self, state, dy):
        return self.mod.backward(state[1], dy)


class _PrimemoeOps:
    """torch.ops.primemoe.moe_forward (FC1 pre-activations kept, as primemoe.moe keeps them for backward) and
    moe_backward."""

    def __init__(self, inp, case):
        import primemoe  # noqa: F401  (registers torch.ops.primemoe)
        self.inp, self.precision = inp, case.precision

    def forward(self):
        i = self.inp
        return torch.ops.primemoe.moe_forward(i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, self.precision, True)

    def backward(self, state, dy):
        i = self.inp
        return torch.ops.primemoe.moe_backward(
            dy, i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, state[1], self.precision)


def _primemoe_raw(inp, group, case, ctx):
    """EP=1: the ops themselves; EP>1: primemoe.moe(buffer=), the Buffer path's only entry point."""
    return _PrimemoeOps(inp, case) if group is None else _UserPath(_primemoe_moe(group, case, ctx), inp)


def _reference_raw(inp, group, case, ctx):
    from primemoe import reference
    return _UserPath(reference.moe, inp)


def _routed_rows(inp, group) -> tuple:
    """This rank's routed rows grouped by destination rank, and the per-rank row counts it sends and
    receives (int64 on the device; exchanged here, before any timing)."""
    world, local, top_k = dist.get_world_size(group), inp.w1.shape[0], inp.topk_idx.shape[1]
    slots = (inp.topk_idx.reshape(-1) >= 0).nonzero().view(-1)
    dest = inp.topk_idx.reshape(-1)[slots] // local
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return inp.x.index_select(0, slots[order] // top_k), send_counts, recv_counts


class _PrimemoeComm:
    """Buffer.dispatch of the routed rows, then Buffer.combine of random rows in the receive layout."""

    def __init__(self, inp, group, case, ctx):
        self.inp, self.buffer = inp, ctx.buffer(num_sms=case.num_sms)
        self.rows = torch.randn_like(self.buffer.region("recv_rows"))

    def forward(self):
        i = self.inp
        return self.buffer.dispatch(i.x, i.topk_idx, i.topk_weights)

    def backward(self, state, dy):
        self.buffer.combine(self.rows, state[1])


class _NcclComm:
    """all_to_all_single with host split sizes; the baseline's permutation and count exchange are not timed."""

    def __init__(self, inp, group, case, ctx):
        self.send, send_counts, recv_counts = _routed_rows(inp, group)
        self.send_splits, self.recv_splits = send_counts.tolist(), recv_counts.tolist()
        self.recv = self.send.new_empty(sum(self.recv_splits), self.send.shape[1])
        self.back, self.group = torch.empty_like(self.send), group

    def forward(self):
        dist.all_to_all_single(self.recv, self.send, self.recv_splits, self.send_splits, group=self.group)

    def backward(self, state, dy):
        dist.all_to_all_single(self.back, self.recv, self.send_splits, self.recv_splits, group=self.group)


class _SymmMemComm:
    """torch.ops.symm_mem.all_to_all_vdev (NVSHMEM, split sizes read on the device). Its cases run in
    processes of their own: torch's NVSHMEM and primemoe's are one library and cannot both initialise it."""

    buffers = None  # symmetric (send rows, receive rows, {direction: (in_splits, out_splits_offsets)})

    def __init__(self, inp, group, case, ctx):
        from torch.distributed import _symmetric_memory as symm_mem
        from primemoe.buffer import nvshmem_environment
        if not hasattr(torch.ops.symm_mem, "all_to_all_vdev") or not symm_mem.is_nvshmem_available():
            raise RuntimeError(f"torch {torch.__version__} lacks torch.ops.symm_mem.all_to_all_vdev or NVSHMEM")
        world, hidden, rows = dist.get_world_size(group), inp.x.shape[1], inp.topk_idx.numel()
        if _SymmMemComm.buffers is None:  # once per process, sized for the run's largest case
            elems = max(max(ctx.args.tokens) * MODEL_SHAPES[s].top_k * MODEL_SHAPES[s].hidden
                        for s in ctx.args.shapes)
            # Before torch's first allocation initialises NVSHMEM (the bench runs on one host).
            os.environ.update(nvshmem_environment(os.environ, [socket.gethostname()], (1 + world) * elems * 2)[0])
            symm_mem.set_backend("NVSHMEM")
            empty = partial(symm_mem.empty, device=inp.x.device)
            splits = {d: (empty(world, dtype=torch.int64), empty(2, world, dtype=torch.int64))
                      for d in ("dispatch", "combine")}
            _SymmMemComm.buffers = (empty(elems, dtype=torch.bfloat16), empty(world * elems, dtype=torch.bfloat16),
                                    splits)
        send_flat, recv_flat, self.splits = self.buffers
        send, send_counts, recv_counts = _routed_rows(inp, group)
        # Views of the symmetric tensors: the op finds their allocation through the storage.
        self.send = send_flat[:rows * hidden].view(rows, hidden)
        self.recv = recv_flat[:world * rows * hidden].view(world * rows, hidden)
        self.send[:send.shape[0]].copy_(send)
        self.splits["dispatch"][0].copy_(send_counts)
        self.splits["combine"][0].copy_(recv_counts)
        self.group_name = group.group_name

    def forward(self):
        torch.ops.symm_mem.all_to_all_vdev(self.send, self.recv, *self.splits["dispatch"], self.group_name)

    def backward(self, state, dy):
        torch.ops.symm_mem.all_to_all_vdev(self.recv, self.send, *self.splits["combine"], self.group_name)


@dataclass(frozen=True)
class Impl:
    make: Callable  # the raw runner
    precisions: tuple
    about: str
    user: Optional[Callable] = None  # the user path's moe call; None: timed in the raw ops only
    path: type = _UserPath  # how the user path calls it
    single_gpu: Optional[str] = None  # why it cannot run at EP > 1, if it cannot
    failure: str = "error"  # the status of a case it fails


IMPLS = {
    "baseline": Impl(_BaselineRaw, ("bf16",), "sort + torch._grouped_mm; NCCL all-to-all at EP>1. User path: "
                     "baseline.moe (a torch.autograd.Function); raw: baseline.forward / backward", user=_baseline_moe),
    "primemoe": Impl(_primemoe_raw, BUILT_PRECISIONS, "user path: primemoe.moe (EP>1: buffer=primemoe.Buffer, NVSHMEM "
                     "dispatch/combine on the Buffer's default SMs); raw: torch.ops.primemoe.moe_forward / "
                     "moe_backward (EP>1: primemoe.moe(buffer=) alone, it has no other entry point)",
                     user=_primemoe_moe),
    "buffer": Impl(_buffer_raw(True), ("bf16",), "primemoe.moe(buffer=primemoe.Buffer) at every EP (EP = 1: a Buffer "
                   "of one rank), FC1 overlapped with the dispatch; raw: the same call", user=_buffer_moe(True)),
    "buffer-seq": Impl(_buffer_raw(False), ("bf16",), "as buffer, with Buffer(overlap=False): dispatch, then FC1",
                       user=_buffer_moe(False)),
    "buffer-combine": Impl(_buffer_raw(True, True), ("bf16",), "as buffer, with Buffer(overlap_combine=True): the "
                           "combines alongside FC2 and FC1's dgrad too", user=_buffer_moe(True, True)),
    "main-grad": Impl(_path_raw(_MainGradPath, _primemoe_moe), BUILT_PRECISIONS, "primemoe.moe with fp32 "
                      "main_grad on w1 / w2: the weight-gradient GEMMs add into them (gradient-accumulation fusion); "
                      "raw: the same call", user=_primemoe_moe, path=_MainGradPath),
    "main-grad-separate": Impl(_path_raw(_SeparateMainGradPath, _primemoe_moe), BUILT_PRECISIONS, "primemoe.moe, "
                               "then main_grad.add_(dw) for w1 and w2 (the accumulation main-grad fuses); raw: the "
                               "same call", user=_primemoe_moe, path=_SeparateMainGradPath),
    "reference": Impl(_reference_raw, ("bf16",), "pure-PyTorch loop over experts (fp32), autograd backward; "
                      "raw timing only", single_gpu="single GPU only"),
}
# At EP > 1 primemoe already runs through the (overlapped) Buffer: the buffer implementations are asked for by name.
DEFAULT_IMPLS = ["baseline", "primemoe", "reference"]
COMM_IMPLS = {
    "primemoe": Impl(_PrimemoeComm, ("bf16",), "primemoe.Buffer.dispatch / combine (NVSHMEM) on num_sms SMs"),
    "nccl": Impl(_NcclComm, ("bf16",), "all_to_all_single of the rows grouped by rank, split sizes on the host"),
    "symm_mem": Impl(_SymmMemComm, ("bf16",), "torch.ops.symm_mem.all_to_all_vdev (NVSHMEM)", failure="n/a"),
}


# ---------------------------------------------------------------- cases and inputs

def _path_times(outcomes: list, path: str) -> Optional[tuple]:
    """Forward and backward ms of ``path`` (per iteration the slowest rank, then the median), if every rank timed it."""
    runs = [o.get(path) for o in outcomes]
    if not all(run and "error" not in run for run in runs):
        return None
    return tuple(statistics.median(map(max, zip(*(run[key] for run in runs)))) for key in ("fwd", "bwd"))


@dataclass
class Case:
    index: int
    shape: str
    tokens: int
    ep: int
    precision: str
    impl: str
    skip: Optional[str] = None  # why this case is not run

    # user_*: the user path (the headline); raw_*: the raw ops; memory (MiB) of one user-path forward+backward.
    METRICS = ("user_fwd_ms", "user_bwd_ms", "user_fwd_tflops", "user_bwd_tflops", "peak_mib", "saved_mib",
               "peak_vs_baseline", "raw_fwd_ms", "raw_bwd_ms", "raw_fwd_tflops", "raw_bwd_tflops",
               "user_fwd_vs_bf16", "user_bwd_vs_bf16", "nvlink_gbps", "routed_rows", "remote_rows")
    PATH_LABELS = {"user": "user path", "raw": "raw ops"}  # the timings a case can run, as notes name them

    def label(self) -> str:
        return f"{self.shape} T={self.tokens} EP={self.ep} {self.precision} {self.impl}"

    def spec(self) -> Impl:
        return IMPLS[self.impl]

    def paths(self, args) -> tuple:
        """The timings this case runs, of PATH_LABELS."""
        return (("user",) if self.spec().user else ()) + (() if args.no_raw else ("raw",))

    def metrics(self, outcomes: list) -> dict:
        """The result fields of the ranks' outcomes, from the paths every rank timed."""
        hidden, inter, _, top_k = MODEL_SHAPES[self.shape].dims
        flops = fwd_flops(self.tokens, top_k, hidden, inter), bwd_flops(self.tokens, top_k, hidden, inter)
        fields = {}
        for path in self.PATH_LABELS:
            times = _path_times(outcomes, path)
            if times is not None:
                fields.update({f"{path}_fwd_ms": times[0], f"{path}_bwd_ms": times[1],
                               f"{path}_fwd_tflops": flops[0] / times[0] / 1e9,
                               f"{path}_bwd_tflops": flops[1] / times[1] / 1e9})
        memory = [o.get("user") or {} for o in outcomes]
        if all("peak_bytes" in m for m in memory):  # the rank that needs the most
            fields.update(peak_mib=max(m["peak_bytes"] for m in memory) / MIB,
                          saved_mib=max(m["saved_bytes"] for m in memory) / MIB)
        remote = statistics.mean(o["remote_rows"] for o in outcomes)
        if self.ep > 1 and "user_fwd_ms" in fields:
            fields["nvlink_gbps"] = nvlink_bytes(remote, hidden) / fields["user_fwd_ms"] / 1e6
        return dict(fields, routed_rows=round(statistics.mean(o["routed_rows"] for o in outcomes)),
                    remote_rows=round(remote))

    def summary(self, r: dict) -> str:
        parts = []
        if r["user_fwd_ms"] is not None:
            peak = f", peak {r['peak_mib']:.0f} MiB" if r["peak_mib"] is not None else ""
            parts.append(f"fwd {r['user_fwd_ms']:.3f} ms ({r['user_fwd_tflops']:.1f} TFLOP/s), "
                         f"bwd {r['user_bwd_ms']:.3f} ms ({r['user_bwd_tflops']:.1f} TFLOP/s){peak}")
        if r["raw_fwd_ms"] is not None:
            parts.append(f"raw fwd {r['raw_fwd_ms']:.3f} ms, bwd {r['raw_bwd_ms']:.3f} ms")
        return "; ".join(parts)


@dataclass
class CommCase(Case):
    """--comm: one implementation moving this shape's routed rows; forward = dispatch, backward = combine."""

    num_sms: Optional[int] = None  # primemoe only: the Buffer's dispatch/combine SMs

    METRICS = ("dispatch_ms", "dispatch_gbps", "combine_ms", "combine_gbps", "remote_mb", "total_mb", "target")
    PATH_LABELS = {"raw": ""}  # one timing: the exchange

    def label(self) -> str:
        sms = f" {self.num_sms} SMs" if self.num_sms else ""
        return f"{self.shape} T={self.tokens} EP={self.ep} {self.impl}{sms}"

    def spec(self) -> Impl:
        return COMM_IMPLS[self.impl]

    def paths(self, args) -> tuple:
        return ("raw",)

    def metrics(self, outcomes: list) -> dict:
        """Each direction moves every remote row once: the same bytes both ways."""
        hidden = MODEL_SHAPES[self.shape].hidden
        remote_bytes = direction_bytes(statistics.mean(o["remote_rows"] for o in outcomes), hidden)
        fields = dict(remote_mb=remote_bytes / 1e6,
                      total_mb=direction_bytes(statistics.mean(o["routed_rows"] for o in outcomes), hidden) / 1e6)
        times = _path_times(outcomes, "raw")
        if times is not None:
            dispatch_gbps, combine_gbps = remote_bytes / times[0] / 1e6, remote_bytes / times[1] / 1e6
            fields.update(dispatch_ms=times[0], combine_ms=times[1], dispatch_gbps=dispatch_gbps,
                          combine_gbps=combine_gbps, target=comm_target(self, min(dispatch_gbps, combine_gbps)))
        return fields

    def summary(self, r: dict) -> str:
        if r["dispatch_ms"] is None:
            return ""
        target = f"  [target {r['target']}]" if r["target"] else ""
        return (f"dispatch {r['dispatch_ms']:.3f} ms ({r['dispatch_gbps']:.1f} GB/s), "
                f"combine {r['combine_ms']:.3f} ms ({r['combine_gbps']:.1f} GB/s){target}")


def build_cases(args) -> list:
    ref_limit = min(args.tokens) if args.skip_reference_above is None else args.skip_reference_above
    cases = []
    for ep, shape, tokens, precision, name in itertools.product(
            args.ep, args.shapes, args.tokens, args.precision, args.impl):
        impl, experts = IMPLS[name], MODEL_SHAPES[shape].experts
        skip = None
        if experts % ep:
            skip = f"{experts} experts do not split over EP={ep}"
        elif ep > 1 and impl.single_gpu:
            skip = impl.single_gpu
        elif precision not in impl.precisions:
            skip = f"{precision} not supported (only {', '.join(impl.precisions)})"
        elif name == "reference" and tokens > ref_limit:
            skip = f"reference runs only up to {ref_limit} tokens (--skip-reference-above)"
        elif args.no_raw and impl.user is None:
            skip = "raw ops only (--no-raw)"
        cases.append(Case(len(cases), shape, tokens, ep, precision, name, skip))
    return cases


def build_comm_cases(args) -> list:
    """EP > 1 only. Ordered so that each set of processes (symm_mem has its own, see main) runs its cases
    contiguously and one Buffer per (shape, SM count) serves every token count."""
    variants = ([("primemoe", sms) for sms in args.num_sms] + [("nccl", None)], [("symm_mem", None)])
    cases = []
    for ep, group, shape in itertools.product([e for e in args.ep if e > 1], variants, args.shapes):
        experts = MODEL_SHAPES[shape].experts
        skip = f"{experts} experts do not split over EP={ep}" if experts % ep else None
        for (impl, sms), tokens in itertools.product(group, args.tokens):
            cases.append(CommCase(len(cases), shape, tokens, ep, "bf16", impl, skip, num_sms=sms))
    return cases


@dataclass
class Inputs:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    dy: torch.Tensor


def make_inputs(shape: str, tokens: int, rank: int, world: int, device, seed: int) -> Inputs:
    """Random bf16 activations (std 1), weights with std 1/sqrt(fan_in), routing from randn logits."""
    from primemoe.routing import route
    hidden, inter, experts, top_k = MODEL_SHAPES[shape].dims
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1000 + rank)  # each rank draws its own tokens

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    local = experts // world
    topk_idx, topk_weights = route(randn(tokens, experts, dtype=torch.float32), top_k)
    w1 = randn(local, 2 * inter, hidden).mul_(hidden ** -0.5)
    w2 = randn(local, hidden, inter).mul_(inter ** -0.5)
    return Inputs(randn(tokens, hidden), topk_idx, topk_weights, w1, w2, dy=randn(tokens, hidden))


# ---------------------------------------------------------------- timing

def _settle(args) -> None:
    """Idle ``--settle`` seconds: timed right after a heavier implementation (the baseline, the fp64 reference),
    primemoe measured up to 6.5% slower on the H200, power-capped and hotter."""
    torch.cuda.synchronize()
    time.sleep(args.settle)


def _time_turns(runners: dict, dy: torch.Tensor, args, group, flush_buf) -> dict:
    """Per-iteration forward and backward ms on this rank of each runner, warm-up dropped: ``{key: {"fwd": [...],
    "bwd": [...]}}``, or ``{key: {"error": text}}`` for one that raised (the others go on). The runners take turns
    one after another, each its warm-up and iterations back to back, with no idle time between them: a training
    step runs its layers back to back, and at the H200's power cap an implementation interleaved with a
    lower-power one (the baseline) ran at higher clocks than it sustains (primemoe up to ~10% faster)."""
    token = torch.zeros(1, device=dy.device)

    def region(fn):
        flush_buf.zero_()
        if group is not None:  # align the ranks' GPU timelines before the region starts
            dist.all_reduce(token, group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        return out, (start, end)

    events, errors = {key: [] for key in runners}, {}
    for key, runner in runners.items():
        for _ in range(args.warmup + args.iters):
            try:
                state, fwd = region(runner.forward)
                events[key].append((fwd, region(partial(runner.backward, state, dy))[1]))
            except Exception as exc:  # OOM or a failing implementation: record it and go on
                errors[key] = _error_text(exc)
                break
            state = None
    torch.cuda.synchronize()

    def ms(regions):
        return [start.elapsed_time(end) for start, end in regions]
    return {key: {"error": errors[key]} if key in errors else
            {"fwd": ms(f for f, _ in events[key][args.warmup:]), "bwd": ms(b for _, b in events[key][args.warmup:])}
            for key in runners}


def _time(runner, inp: Inputs, args, group, flush_buf) -> tuple:
    """One runner's per-iteration forward and backward ms on this rank, warm-up dropped (scripts/comm_profile.py)."""
    run = _time_turns({0: runner}, inp.dy, args, group, flush_buf)[0]
    if "error" in run:
        raise RuntimeError(run["error"])
    return run["fwd"], run["bwd"]


def _memory(runner, dy: torch.Tensor) -> dict:
    """What one forward+backward allocates beyond what is allocated before it (inputs, weights, the flush buffer,
    caches made by earlier calls): its peak, and what stays allocated from the forward to the backward (y and what
    autograd saved), in bytes."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = runner.forward()
    saved = torch.cuda.memory_allocated() - before
    runner.backward(state, dy)
    del state
    return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "saved_bytes": saved}


def _error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


class _ShapeContext:
    """What the cases of one shape share on a rank: the run's arguments and, at EP > 1, the open
    primemoe.Buffer (sized for the shape's largest token count, made on first use, remade when a case
    needs other arguments, closed with the shape)."""

    # Buffers open at once: the buffer, buffer-seq and buffer-combine implementations take turns.
    MAX_BUFFERS = 3

    def __init__(self, args, group, shape: str, max_tokens: int):
        self.args, self.group, self.shape, self.max_tokens = args, group, shape, max_tokens
        self._buffers = {}  # (precision, num_sms, overlap, overlap_combine): open Buffer, in creation order

    def buffer(self, precision: str = "bf16", num_sms: Optional[int] = None, overlap: bool = True,
               overlap_combine: bool = False):
        import primemoe
        from primemoe.buffer import (DEFAULT_NUM_SMS, EP_ROW_ALIGN, SYMMETRIC_HEAP_MARGIN, EpConfig, ep_layout,
                                     ep_transport)
        num_sms = num_sms or DEFAULT_NUM_SMS
        key = (precision, num_sms, overlap, overlap_combine)
        if key not in self._buffers:
            if len(self._buffers) == self.MAX_BUFFERS:
                self._buffers.pop(next(iter(self._buffers))).close()
            group = self.group if self.group is not None else _single_rank_group()
            world = dist.get_world_size(group)
            # NVSHMEM sizes its heap when it starts: let that hold the run's largest workspaces,
            # whichever shape comes first (a value the user set is kept).
            puts = ep_transport(os.environ) == "put"
            largest = max(ep_layout(EpConfig(world, max(self.args.tokens), h, k, e // world, EP_ROW_ALIGN, puts))[1]
                          for h, _, e, k in (MODEL_SHAPES[s].dims for s in self.args.shapes) if e % world == 0)
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(self.MAX_BUFFERS * largest + SYMMETRIC_HEAP_MARGIN))
            hidden, inter, experts, top_k = MODEL_SHAPES[self.shape].dims
            factor = self.args.recv_factor
            max_recv_rows = None if factor is None else factor * self.max_tokens * top_k
            self._buffers[key] = primemoe.Buffer(group, max_tokens_per_rank=self.max_tokens, hidden=hidden,
                                                 intermediate=inter, num_experts=experts, top_k=top_k,
                                                 precision=precision, num_sms=num_sms, overlap=overlap,
                                                 overlap_combine=overlap_combine, max_recv_rows=max_recv_rows)
        return self._buffers[key]

    def close(self) -> None:
        for buffer in self._buffers.values():
            buffer.close()  # collective: every rank closes the shape's buffers together
        self._buffers = {}


def _run_user(cases: list, inp: Inputs, args, group, flush_buf, ctx: _ShapeContext) -> dict:
    """The user path of the implementations of one (shape, tokens, EP, precision), timed in turns after one idle
    settling, then each one's memory: ``{case index: outcome}``."""
    runners, runs = {}, {}
    for case in cases:
        try:
            spec = case.spec()
            runners[case.index] = spec.path(spec.user(group, case, ctx), inp)
        except Exception as exc:
            runs[case.index] = {"error": _error_text(exc)}
    try:
        _settle(args)
        runs.update(_time_turns(runners, inp.dy, args, group, flush_buf))
    except Exception as exc:  # an error the device reported late, at a synchronisation: no one implementation's
        runs.update({index: {"error": _error_text(exc)} for index in runners})
    for index, runner in runners.items():
        if "error" not in runs[index]:
            try:
                runs[index].update(_memory(runner, inp.dy))
            except Exception as exc:
                runs[index] = {"error": f"measuring memory: {_error_text(exc)}"}
    del runners
    torch.cuda.empty_cache()
    return runs


def _run_raw(case: Case, inp: Inputs, args, group, flush_buf, ctx: _ShapeContext) -> dict:
    """The raw ops of one implementation, timed alone after idle settling."""
    try:
        runner = case.spec().make(inp, group, case, ctx)
        _settle(args)
        with torch.no_grad():
            return _time_turns({case.index: runner}, inp.dy, args, group, flush_buf)[case.index]
    except Exception as exc:  # it cannot start, or the device reported an error late
        return {"error": _error_text(exc)}
    finally:
        torch.cuda.empty_cache()


def _run_block(block: list, args, group, flush_buf, ctx: _ShapeContext) -> dict:
    """This rank's outcomes of the cases of one (shape, tokens) that run, by case index: the user paths first, one
    precision at a time, then each case's raw ops."""
    cases = [c for c in block if c.skip is None]
    if not cases:
        return {}
    rank, world = _rank_world(group)
    try:
        inp = make_inputs(cases[0].shape, cases[0].tokens, rank, world, flush_buf.device, args.seed)
        rows = {"routed_rows": int((inp.topk_idx >= 0).sum()),
                "remote_rows": remote_rows(inp.topk_idx, inp.w1.shape[0], rank)}
    except Exception as exc:
        return {c.index: {"error": f"creating inputs: {_error_text(exc)}"} for c in cases}
    outcomes = {c.index: dict(rows) for c in cases}
    user = {}
    for case in cases:
        if "user" in case.paths(args):
            user.setdefault(case.precision, []).append(case)
    for same_precision in user.values():
        for index, run in _run_user(same_precision, inp, args, group, flush_buf, ctx).items():
            outcomes[index]["user"] = run
    for case in cases:
        if "raw" in case.paths(args):
            outcomes[case.index]["raw"] = _run_raw(case, inp, args, group, flush_buf, ctx)
    return outcomes


def _result(case: Case, status: str, note: str = "", **fields) -> dict:
    hidden, inter, experts, top_k = MODEL_SHAPES[case.shape].dims
    sms = {"num_sms": case.num_sms} if isinstance(case, CommCase) else {}
    return dict(shape=case.shape, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k,
                tokens=case.tokens, ep=case.ep, precision=case.precision, impl=case.impl, **sms,
                status=status, note=note, **{**dict.fromkeys(case.METRICS), **fields})


def _failures(case: Case, outcomes: list):
    """(status, note) of each failure in the ranks' outcomes, in rank order."""
    for rank, outcome in enumerate(outcomes):
        where = "" if case.ep == 1 else f"rank {rank}: "
        if "error" in outcome:  # no inputs: nothing ran
            yield outcome.get("status", "error"), where + outcome["error"]
        for path, label in case.PATH_LABELS.items():
            run = outcome.get(path) or {}
            if "error" in run:
                yield case.spec().failure, where + (f"{label}: " if label else "") + run["error"]


def _summarize(case: Case, outcomes: list) -> dict:
    """Combine the ranks' outcomes: the numbers of each path every rank timed, the first failure's status and note."""
    failure = next(_failures(case, outcomes), None)
    if any("error" in o for o in outcomes):
        return _result(case, *failure)
    return _result(case, *(failure or ("ok",)), **case.metrics(outcomes))


def _gather(obj, group) -> list:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _single_rank_group():
    """The group of a Buffer at EP = 1: this process alone (gloo; NVSHMEM bootstraps over it)."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def _rank_world(group) -> tuple:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _run_cases(cases: list, args, group, report) -> None:
    """Run the cases of one process set on this rank; rank 0 reports each result."""
    device = torch.device("cuda", torch.cuda.current_device())
    flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    rank = _rank_world(group)[0]
    for shape, shape_cases in itertools.groupby(cases, key=lambda c: c.shape):
        shape_cases = list(shape_cases)
        ctx = _ShapeContext(args, group, shape, max(c.tokens for c in shape_cases))
        for _, block in itertools.groupby(shape_cases, key=lambda c: c.tokens):
            block = list(block)
            outcomes = _run_block(block, args, group, flush_buf, ctx)
            for case in block:
                result = (_result(case, "n/a", case.skip) if case.skip is not None else
                          _summarize(case, _gather(outcomes[case.index], group)))
                if rank == 0:
                    report(case, result)
            torch.cuda.empty_cache()
        ctx.close()


def _progress(case: Case, result: dict, total: int) -> None:
    """One line: what was measured, then the failure if there was one."""
    parts = [case.summary(result)]  # empty when nothing was measured
    if result["status"] != "ok":
        parts.append(f"{result['status']}: {result['note']}")
    print(f"[{case.index + 1}/{total}] {case.label()}: {'; '.join(p for p in parts if p)}", flush=True)


def _worker(rank: int, world: int, init_method: str, cases: list, args, total: int, results) -> None:
    os.environ.update(MULTICAST_OFF)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, timeout=NCCL_TIMEOUT,
                            device_id=torch.device("cuda", rank))

    def report(case, result):
        _progress(case, result, total)
        results.put((case.index, result))
    try:
        _run_cases(cases, args, dist.group.WORLD, report)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def rendezvous():
    """The ``init_method`` of one host's spawned ranks: a file store, removed afterwards. (A free TCP port picked
    before the ranks start can be taken before rank 0 listens on it.)"""
    with tempfile.TemporaryDirectory(prefix="primemoe-rendezvous-") as directory:
        yield "file://" + os.path.join(directory, "store")


def join_ranks(procs, results) -> tuple:
    """Joins spawned ranks while draining their result queue (a full pipe would block them, and a child exits only
    once its results are read); a rank that fails ends the join (torch terminates the others). Returns the items
    the ranks put and the failure's text, or None."""
    items, failure, done = [], None, False
    while not done:
        try:
            done = procs.join(timeout=1)
        except Exception as exc:
            failure, done = _error_text(exc), True
        while True:
            try:
                items.append(results.get(timeout=0.1) if done else results.get_nowait())
            except queue.Empty:
                break
    return items, failure


def _run_ep(cases: list, args, total: int) -> list:
    """Spawn one process per rank; keep what rank 0 reported even if a rank dies."""
    import torch.multiprocessing as mp
    ep = cases[0].ep
    results = mp.get_context("spawn").Queue()
    with rendezvous() as init_method:
        procs = mp.start_processes(_worker, args=(ep, init_method, cases, args, total, results),
                                   nprocs=ep, join=False, start_method="spawn")
        items, failure = join_ranks(procs, results)
    got = dict(items)
    for case in cases:
        if case.index not in got:
            got[case.index] = (_result(case, "n/a", case.skip) if case.skip else
                               _result(case, case.spec().failure, f"EP={ep} worker failed: {failure or 'no result'}"))
            _progress(case, got[case.index], total)
    return [got[case.index] for case in cases]


# ---------------------------------------------------------------- output

# header, result key, format: "{}" = text (left-aligned), any other format right-aligned,
# and measured (shown as n/a for cases that do not run) when it has a precision.
COLUMNS = [
    ("shape", "shape", "{}"), ("T/rank", "tokens", "{}"), ("EP", "ep", "{}"), ("prec", "precision", "{}"),
    ("impl", "impl", "{}"),
    # the user path, the headline
    ("fwd ms", "user_fwd_ms", "{:.3f}"), ("bwd ms", "user_bwd_ms", "{:.3f}"),
    ("fwd TFLOP/s", "user_fwd_tflops", "{:.1f}"), ("bwd TFLOP/s", "user_bwd_tflops", "{:.1f}"),
    ("peak MiB", "peak_mib", "{:.0f}"), ("peak/baseline", "peak_vs_baseline", "{:.2f}"),
    ("saved MiB", "saved_mib", "{:.0f}"),
    # the raw ops
    ("raw fwd ms", "raw_fwd_ms", "{:.3f}"), ("raw bwd ms", "raw_bwd_ms", "{:.3f}"),
    ("raw fwd TFLOP/s", "raw_fwd_tflops", "{:.1f}"), ("raw bwd TFLOP/s", "raw_bwd_tflops", "{:.1f}"),
    # another precision's user path against the same implementation's bf16 (speed-up: bf16 ms / this ms)
    ("fwd x bf16", "user_fwd_vs_bf16", "{:.2f}"), ("bwd x bf16", "user_bwd_vs_bf16", "{:.2f}"),
    ("NVLink GB/s", "nvlink_gbps", "{:.1f}"), ("rows/rank", "routed_rows", "{:d}"),
    ("remote rows", "remote_rows", "{:d}"), ("status", "status", "{}"),
]
COMM_COLUMNS = [
    ("shape", "shape", "{}"), ("T/rank", "tokens", "{}"), ("EP", "ep", "{}"), ("impl", "impl", "{}"),
    ("SMs", "num_sms", "{}"), ("dispatch ms", "dispatch_ms", "{:.3f}"), ("dispatch GB/s", "dispatch_gbps", "{:.1f}"),
    ("combine ms", "combine_ms", "{:.3f}"), ("combine GB/s", "combine_gbps", "{:.1f}"),
    ("remote MB", "remote_mb", "{:.1f}"), ("total MB", "total_mb", "{:.1f}"), ("target GB/s", "target", "{}"),
    ("status", "status", "{}"),
]


def _cells(r: dict, columns: list) -> list:
    cells = ["-" if r[key] is None else fmt.format(r[key]) for _, key, fmt in columns]
    if r["status"] != "ok":
        cells[-1] = f"{r['status']}: {r['note'][:100]}"
    if r["status"] == "n/a":
        cells = ["n/a" if "." in fmt else c for c, (_, _, fmt) in zip(cells, columns)]
    return cells


def format_table(results: list, markdown: bool = False, columns: list = COLUMNS) -> str:
    heads = [h for h, _, _ in columns]
    rows = [_cells(r, columns) for r in results]
    numeric = [fmt != "{}" for _, _, fmt in columns]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]

    def fmt(row):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric)).rstrip()
    return "\n".join([fmt(heads), "  ".join("-" * w for w in widths)] + [fmt(row) for row in rows])


def _git_commit() -> Optional[str]:
    """The checkout's commit, else ``PRIMEMOE_GIT_COMMIT`` (a copy of the sources without ``.git``,
    as on a remote GPU machine), else None."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0:
        return out.stdout.strip()
    return os.environ.get("PRIMEMOE_GIT_COMMIT") or None


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:  # nvidia-smi's "[N/A]"
        return None


def gpu_uuid(device: int) -> str:
    """The CUDA device's UUID as nvidia-smi writes it (``GPU-...``), to match its rows or select it with ``-i``."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def boards() -> list:
    """Each visible GPU's UUID and, where nvidia-smi answers, its enforced power limit and SM clock ceiling.
    The benchmark's GEMMs run at the power cap, where boards of one model differ by several percent, so
    results are compared board by board."""
    found = [{"uuid": gpu_uuid(i)} for i in range(torch.cuda.device_count())]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,power.limit,clocks.max.sm",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return found
    if out.returncode != 0:
        return found
    limits = {}
    for line in out.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3:
            limits[fields[0]] = {"power_limit_w": _number(fields[1]), "max_sm_clock_mhz": _number(fields[2])}
    for board in found:
        board.update(limits.get(board["uuid"], {}))
    return found


def _board_note(found: list) -> str:
    def one(b):
        known = [f"{b[k]:g} {unit}" for k, unit in (("power_limit_w", "W"), ("max_sm_clock_mhz", "MHz"))
                 if b.get(k) is not None]
        return b["uuid"] + (f" ({', '.join(known)})" if known else "")
    return "; ".join(map(one, found))


def _timing_note(args) -> str:
    regions = "dispatch and combine" if args.comm else "forward and backward"
    common = (f"CUDA events around {regions} separately; {args.warmup} warm-up, median of {args.iters} iterations; "
              "L2 flushed (256 MB write) before every timed region; EP>1: ranks aligned by an all-reduce before each "
              "region, iteration time = max over ranks")
    alone = f"{args.settle:g} s idle before each case and implementation"
    if args.comm:
        return f"{common}; {alone}"
    user = ("user path (the headline): moe(x, topk_idx, topk_weights, w1, w2) under grad mode on inputs that require "
            "grad, then torch.autograd.grad(y, [x, topk_weights, w1, w2], dy); the implementations of a (shape, "
            "T/rank, EP, precision) one after another, each its iterations back to back, after "
            f"{args.settle:g} s idle and none between them")
    raw = "raw ops: not timed (--no-raw)" if args.no_raw else f"raw ops: each implementation alone, {alone}"
    return f"{common}. {user}. {raw}"


def metadata(args) -> dict:
    meta = {
        "gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": _git_commit(),
        "boards": boards(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": _timing_note(args),
    }
    if args.comm:
        meta.update(
            bytes="per GPU and direction: routed rows (one per token and expert slot) whose expert lives on another "
                  "rank, H*2 bytes each (bf16), mean over ranks; GB/s = those bytes / time (1e9 B/s); "
                  "total MB also counts the rows a rank keeps (local copy)",
            targets=COMM_TARGETS)
    else:
        meta.update(
            fields="user_*: the user path (table: fwd ms, bwd ms, fwd/bwd TFLOP/s); raw_*: the raw ops (table: raw "
                   "fwd ms, ...); peak_mib, saved_mib, peak_vs_baseline: see memory; user_fwd_vs_bf16, "
                   "user_bwd_vs_bf16 (table: fwd/bwd x bf16): a precision's user-path speed-up over the same "
                   "implementation's bf16 at the same shape, T/rank and EP (bf16 ms / its ms)",
            precisions="bf16: bf16 GEMMs; fp8: blockwise e4m3 GEMMs forward and backward (1x128 activation tiles, "
                       "128x128 weight blocks, weights quantised once per weight version); fp8_bwd: the bf16 forward "
                       "and the fp8 backward. TFLOP/s count the same FLOPs in every precision",
            flops="per GPU: forward 6*T*K*H*I, backward 12*T*K*H*I, T = tokens per rank",
            memory="one user-path forward+backward after the timed iterations, in MiB: peak_mib = "
                   "torch.cuda.max_memory_allocated() (peak stats reset first) minus memory_allocated() before it "
                   "(inputs, weights, the flush buffer, caches of earlier calls); saved_mib = memory_allocated() after "
                   "the forward minus before (y and what autograd saved); max over ranks; the NVSHMEM symmetric heap "
                   "and NCCL's buffers are outside torch's allocator and not counted; peak_vs_baseline = peak_mib / "
                   "the bf16 baseline's at the same shape, T/rank and EP",
            nvlink="forward bytes of remote routed rows (dispatch out + combine back, H*2 bytes each), "
                   "mean over ranks, / user-path forward time; rows/rank and remote rows are means over ranks")
    meta["implementations"] = {name: impl.about for name, impl in (COMM_IMPLS if args.comm else IMPLS).items()}
    meta["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return meta


def add_precision_ratios(results: list) -> None:
    """Sets user_fwd_vs_bf16 / user_bwd_vs_bf16 of each result of a precision other than bf16: the user path's
    speed-up over the same implementation's bf16 at the same shape, T/rank and EP (bf16 ms / this ms)."""
    bf16 = {(r["impl"], r["shape"], r["tokens"], r["ep"]): r for r in results if r["precision"] == "bf16"}
    for r in results:
        base = bf16.get((r["impl"], r["shape"], r["tokens"], r["ep"]))
        if r["precision"] == "bf16" or base is None:
            continue
        for path in ("fwd", "bwd"):
            ms, base_ms = r.get(f"user_{path}_ms"), base.get(f"user_{path}_ms")
            if ms and base_ms:
                r[f"user_{path}_vs_bf16"] = base_ms / ms


def add_memory_ratios(results: list) -> None:
    """Sets peak_vs_baseline: each result's peak memory over the baseline's at the same shape, T/rank and EP."""
    baseline = {(r["shape"], r["tokens"], r["ep"]): r["peak_mib"] for r in results
                if r["impl"] == "baseline" and r.get("peak_mib")}
    for r in results:
        base = baseline.get((r["shape"], r["tokens"], r["ep"]))
        if base and r.get("peak_mib") is not None:
            r["peak_vs_baseline"] = r["peak_mib"] / base


def _series(r: dict) -> str:
    return r["impl"] + (f" {r['num_sms']} SMs" if r.get("num_sms") else "")


def write_plot(results: list, path: Path, panels: tuple) -> None:
    """One bar panel per (result key, y label) of ``panels``, a bar per implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", flush=True)
        return
    ok = [r for r in results if r["status"] == "ok" and any(r.get(key) is not None for key, _ in panels)]
    if not ok:
        print("no successful case: skipping the plot", flush=True)
        return
    groups = list(dict.fromkeys((r["shape"], r["tokens"], r["ep"], r["precision"]) for r in ok))
    impls = list(dict.fromkeys(map(_series, ok)))
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.3 * len(groups)), 4 * len(panels)), sharex=True)
    for ax, (key, ylabel) in zip(axes, panels):
        for j, impl in enumerate(impls):
            points = [(i, r[key]) for i, g in enumerate(groups) for r in ok if r.get(key) is not None
                      and _series(r) == impl and (r["shape"], r["tokens"], r["ep"], r["precision"]) == g]
            ax.bar([i + (j - (len(impls) - 1) / 2) * width for i, _ in points], [v for _, v in points],
                   width, label=impl)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    axes[-1].set_xticks(range(len(groups)), [f"{s}\nT={t} EP={e}\n{p}" for s, t, e, p in groups], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def layer_columns(args) -> list:
    """The table's columns: without the raw ops' under --no-raw."""
    return [c for c in COLUMNS if not (args.no_raw and c[1].startswith("raw_"))]


def write_outputs(results: list, args) -> None:
    """Layer results under "results"; --comm results under "comm", with their own table and plot."""
    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata(args)
    if args.comm:
        section, columns, notes = "comm", COMM_COLUMNS, ("timing", "bytes", "targets")
        panels = (("dispatch_gbps", "dispatch GB/s per GPU"), ("combine_gbps", "combine GB/s per GPU"))
    else:
        section, columns, notes = ("results", layer_columns(args),
                                   ("timing", "fields", "precisions", "flops", "memory", "nvlink"))
        panels = (("user_fwd_tflops", "forward TFLOP/s per GPU\n(moe under autograd)"),
                  ("user_bwd_tflops", "backward TFLOP/s per GPU\n(torch.autograd.grad)"),
                  ("peak_mib", "peak MiB of one\nforward+backward"))
    (args.out / "results.json").write_text(json.dumps({"metadata": meta, section: results}, indent=2) + "\n")
    md = [f"# primemoe benchmark ({meta['date']})", "",
          *(f"- {k}: {meta[k]}" for k in ("gpu", "gpu_count", "torch", "cuda", "git_commit")),
          f"- boards: {_board_note(meta['boards'])}",
          *(f"- {k}: {meta[k]}" for k in notes),
          "", format_table(results, markdown=True, columns=columns), ""]
    (args.out / "results.md").write_text("\n".join(md))
    write_plot(results, args.out / "results.png", panels)
    tail = f"{COMM_TARGETS}\n\n" if args.comm else ""
    print(f"\n{meta['timing']}\nboards: {_board_note(meta['boards'])}\n\n"
          f"{format_table(results, columns=columns)}\n\n{tail}written: {args.out}/results.{{json,md,png}}", flush=True)


# ---------------------------------------------------------------- command line

def _int_from(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text}")
        return value
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m primemoe.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=MODEL_SHAPES, default=TARGET_SHAPES)
    p.add_argument("--tokens", nargs="+", type=_int_from(1), default=[4096, 8192, 16384], help="tokens per rank")
    p.add_argument("--ep", nargs="+", type=_int_from(1), default=[1, 2],
                   help="expert-parallel sizes (one GPU per rank)")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["bf16"],
                   help="primemoe's precisions, each a cell of its own beside bf16's and the baseline's (bf16 only): "
                        "bf16, fp8 (FP8 forward and backward), fp8_bwd (FP8 backward); default bf16")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=DEFAULT_IMPLS,
                   help=f"default {' '.join(DEFAULT_IMPLS)}; buffer / buffer-seq / buffer-combine: primemoe.moe(buffer=) "
                        "with the overlap on / off / also the combines, also at EP = 1 (a Buffer of one rank)")
    p.add_argument("--warmup", type=_int_from(0), default=5)
    p.add_argument("--iters", type=_int_from(1), default=20, help="timed iterations (median reported)")
    p.add_argument("--settle", type=_seconds, default=2.0,
                   help="seconds the GPU idles before each case's user path and each implementation's raw ops "
                        "(default 2)")
    p.add_argument("--no-raw", action="store_true",
                   help="time only the user path, not the raw ops (the reference, raw only, is then n/a; --comm "
                        "ignores it)")
    p.add_argument("--skip-reference-above", type=_int_from(1), metavar="TOKENS",
                   help="run the reference only up to this many tokens per rank (default: the smallest --tokens)")
    p.add_argument("--recv-factor", type=_int_from(1), default=None, metavar="F",
                   help="Buffers receive at most F x max_tokens_per_rank x top_k rows per dispatch (Buffer's "
                        "max_recv_rows; default: the worst case, EP x that), bounding the layer's memory at EP > 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    p.add_argument("--dry-run", action="store_true", help="print the cases and FLOP counts; needs no GPU")
    p.add_argument("--comm", action="store_true",
                   help="time dispatch and combine alone (primemoe, NCCL, symm_mem; EP > 1) instead of the layer; "
                        "--precision and --impl do not apply")
    p.add_argument("--num-sms", nargs="+", type=_int_from(1), default=[8, 16, 24],
                   help="--comm: SM counts for primemoe's dispatch/combine kernels (one Buffer each)")
    return p.parse_args(argv)


def print_cases(cases: list, args) -> None:
    """The cases with their sizes and what is timed of each, then the table's columns."""
    comm = bool(cases) and isinstance(cases[0], CommCase)
    print(f"{len(cases)} communication cases (routed bytes per rank and direction):" if comm else
          f"{len(cases)} cases (FLOPs per rank):")
    for c in cases:
        hidden, inter, _, top_k = MODEL_SHAPES[c.shape].dims
        if comm:
            sizes = f"{direction_bytes(c.tokens * top_k, hidden) / 1e6:9.1f} MB"
        else:
            flops = (fwd_flops(c.tokens, top_k, hidden, inter), bwd_flops(c.tokens, top_k, hidden, inter))
            sizes = f"fwd {flops[0] / 1e9:9.1f} GFLOP  bwd {flops[1] / 1e9:9.1f} GFLOP  {'+'.join(c.paths(args)):<8}"
        print(f"  {c.label():<48} {sizes}  {'run' if c.skip is None else f'n/a: {c.skip}'}")
    print("columns: " + ", ".join(head for head, _, _ in (COMM_COLUMNS if comm else layer_columns(args))))


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = build_comm_cases(args) if args.comm else build_cases(args)
    if args.comm and 1 in args.ep:
        print("skip EP=1: --comm times rows moving between GPUs, it needs EP > 1", flush=True)
    if args.dry_run:
        print_cases(cases, args)
        return 0
    if not torch.cuda.is_available():
        print("primemoe.bench: no CUDA GPU visible, nothing to time on CPU "
              "(--dry-run lists the cases without one)", file=sys.stderr)
        return 2
    os.environ.update(MULTICAST_OFF)
    print(_timing_note(args), flush=True)
    if args.comm:
        print(COMM_TARGETS, flush=True)
    results, gpus = [], torch.cuda.device_count()
    # One set of processes per EP size; symm_mem's cases get their own (see _SymmMemComm).
    for (ep, symm_mem), block in itertools.groupby(cases, key=lambda c: (c.ep, c.impl == "symm_mem")):
        block = list(block)
        if ep > gpus:
            if not symm_mem:  # one line per EP size
                print(f"skip EP={ep}: needs {ep} GPUs, {gpus} visible", flush=True)
            results += [_result(c, "n/a", c.skip) if c.skip
                        else _result(c, "skipped", f"needs {ep} GPUs, {gpus} visible")
                        for c in block]
        elif ep == 1:
            def report(case, result):
                _progress(case, result, len(cases))
                results.append(result)
            _run_cases(block, args, None, report)
        else:
            results += _run_ep(block, args, len(cases))
    if not args.comm:
        add_memory_ratios(results)
        add_precision_ratios(results)
    write_outputs(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
