"""MoE layer benchmark: primemoe, the PyTorch baseline and the reference, side by side.

    python -m primemoe.bench [--shapes ...] [--tokens ...] [--ep 1 2] [--impl ...] [--out DIR]
    python -m primemoe.bench --comm [--ep 2] [--num-sms 8 16 24] ...

For every (shape, tokens per rank, EP, precision, implementation) it times forward and
backward separately with CUDA events: warm-up, then the median of ``--iters``, with L2
flushed (a 256 MB write) before every timed region, after ``--settle`` idle seconds per case and
implementation (the GPU's heat from the case before would otherwise slow the next: benchmarks/
RESULTS.md, sixteenth session). TFLOP/s are per GPU and counted as in
DESIGN.md section 6: forward 6*T*K*H*I, backward 12*T*K*H*I (T = tokens per rank, no
credit for recomputation). EP > 1 spawns one process per GPU (NCCL, multicast off); an
iteration's time there is the max over ranks, which is what a training step sees.
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

from primemoe._validate import PRECISIONS

SHAPES = {  # name: (hidden H, intermediate I, experts E, top_k K), DESIGN.md section 1
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}
TARGET_SHAPES = ["qwen3-30b-a3b", "qwen3-235b-a22b"]  # the shapes the issues set targets at: the default
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
L2_FLUSH_BYTES = 256 << 20
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
# Each adapter is built from (inputs, group, case, shape context); forward() returns the
# state backward(state, dy) needs. Adding an implementation is one entry in IMPLS (layer)
# or COMM_IMPLS (--comm: forward = dispatch, backward = combine).

class _Baseline:
    def __init__(self, inp, group, case, ctx):
        from primemoe import baseline
        self.mod, self.inp, self.group = baseline, inp, group

    def forward(self):
        i = self.inp
        return self.mod.forward(i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, group=self.group)

    def backward(self, state, dy):
        return self.mod.backward(state[1], dy)


class _Primemoe:
    def __init__(self, inp, group, case, ctx):
        import primemoe  # noqa: F401  (registers torch.ops.primemoe)
        self.inp, self.precision = inp, case.precision

    def forward(self):
        i = self.inp
        return torch.ops.primemoe.moe_forward(i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, self.precision, True)

    def backward(self, state, dy):
        i = self.inp
        return torch.ops.primemoe.moe_backward(
            dy, i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, state[1], self.precision)


class _Autograd:
    """Forward: ``self.moe`` on fresh leaves x, topk_weights, w1, w2; backward: autograd.grad of them."""

    def forward(self):
        i = self.inp
        leaves = [t.detach().requires_grad_() for t in (i.x, i.topk_weights, i.w1, i.w2)]
        with torch.enable_grad():
            y = self.moe(leaves[0], i.topk_idx, *leaves[1:])
        return y, leaves

    def backward(self, state, dy):
        y, leaves = state
        return torch.autograd.grad(y, leaves, dy)


class _Reference(_Autograd):
    def __init__(self, inp, group, case, ctx):
        from primemoe import reference
        self.moe, self.inp = reference.moe, inp


class _PrimemoeEP(_Autograd):
    """``primemoe.moe(..., buffer=)``: the only EP entry point, so forward records autograd as training does."""

    def __init__(self, inp, group, case, ctx):
        import primemoe
        self.moe = partial(primemoe.moe, buffer=ctx.buffer(precision=case.precision), precision=case.precision)
        self.inp = inp


def _primemoe(inp, group, case, ctx):
    """EP=1: the ops themselves; EP>1: through the shape's Buffer."""
    return (_Primemoe if group is None else _PrimemoeEP)(inp, group, case, ctx)


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
            elems = max(max(ctx.args.tokens) * SHAPES[s][3] * SHAPES[s][0] for s in ctx.args.shapes)
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
    make: Callable
    precisions: tuple
    about: str
    single_gpu: Optional[str] = None  # why it cannot run at EP > 1, if it cannot
    failure: str = "error"  # the status of a case it fails


IMPLS = {
    "baseline": Impl(_Baseline, ("bf16",), "sort + torch._grouped_mm; NCCL all-to-all at EP>1"),
    "primemoe": Impl(_primemoe, PRECISIONS, "torch.ops.primemoe.moe_forward / moe_backward; EP>1: "
                     "primemoe.moe(buffer=primemoe.Buffer) with autograd (NVSHMEM dispatch/combine on the Buffer's "
                     "default SMs)"),
    "reference": Impl(_Reference, ("bf16",), "pure-PyTorch loop over experts (fp32), autograd backward",
                      single_gpu="single GPU only"),
}
COMM_IMPLS = {
    "primemoe": Impl(_PrimemoeComm, ("bf16",), "primemoe.Buffer.dispatch / combine (NVSHMEM) on num_sms SMs"),
    "nccl": Impl(_NcclComm, ("bf16",), "all_to_all_single of the rows grouped by rank, split sizes on the host"),
    "symm_mem": Impl(_SymmMemComm, ("bf16",), "torch.ops.symm_mem.all_to_all_vdev (NVSHMEM)", failure="n/a"),
}


# ---------------------------------------------------------------- cases and inputs

@dataclass
class Case:
    index: int
    shape: str
    tokens: int
    ep: int
    precision: str
    impl: str
    skip: Optional[str] = None  # why this case is not run

    METRICS = ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "nvlink_gbps", "routed_rows", "remote_rows")

    def label(self) -> str:
        return f"{self.shape} T={self.tokens} EP={self.ep} {self.precision} {self.impl}"

    def spec(self) -> Impl:
        return IMPLS[self.impl]

    def summary(self, r: dict) -> str:
        return (f"fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.1f} TFLOP/s), "
                f"bwd {r['bwd_ms']:.3f} ms ({r['bwd_tflops']:.1f} TFLOP/s)")


@dataclass
class CommCase(Case):
    """--comm: one implementation moving this shape's routed rows; forward = dispatch, backward = combine."""

    num_sms: Optional[int] = None  # primemoe only: the Buffer's dispatch/combine SMs

    METRICS = ("dispatch_ms", "dispatch_gbps", "combine_ms", "combine_gbps", "remote_mb", "total_mb", "target")

    def label(self) -> str:
        sms = f" {self.num_sms} SMs" if self.num_sms else ""
        return f"{self.shape} T={self.tokens} EP={self.ep} {self.impl}{sms}"

    def spec(self) -> Impl:
        return COMM_IMPLS[self.impl]

    def summary(self, r: dict) -> str:
        target = f"  [target {r['target']}]" if r["target"] else ""
        return (f"dispatch {r['dispatch_ms']:.3f} ms ({r['dispatch_gbps']:.1f} GB/s), "
                f"combine {r['combine_ms']:.3f} ms ({r['combine_gbps']:.1f} GB/s){target}")


def build_cases(args) -> list:
    ref_limit = min(args.tokens) if args.skip_reference_above is None else args.skip_reference_above
    cases = []
    for ep, shape, tokens, precision, name in itertools.product(
            args.ep, args.shapes, args.tokens, args.precision, args.impl):
        impl, experts = IMPLS[name], SHAPES[shape][2]
        skip = None
        if experts % ep:
            skip = f"{experts} experts do not split over EP={ep}"
        elif ep > 1 and impl.single_gpu:
            skip = impl.single_gpu
        elif precision not in impl.precisions:
            skip = f"{precision} not supported (only {', '.join(impl.precisions)})"
        elif name == "reference" and tokens > ref_limit:
            skip = f"reference runs only up to {ref_limit} tokens (--skip-reference-above)"
        cases.append(Case(len(cases), shape, tokens, ep, precision, name, skip))
    return cases


def build_comm_cases(args) -> list:
    """EP > 1 only. Ordered so that each set of processes (symm_mem has its own, see main) runs its cases
    contiguously and one Buffer per (shape, SM count) serves every token count."""
    variants = ([("primemoe", sms) for sms in args.num_sms] + [("nccl", None)], [("symm_mem", None)])
    cases = []
    for ep, group, shape in itertools.product([e for e in args.ep if e > 1], variants, args.shapes):
        experts = SHAPES[shape][2]
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
    hidden, inter, experts, top_k = SHAPES[shape]
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

def _time(runner, inp: Inputs, args, group, flush_buf) -> tuple:
    """Per-iteration forward and backward ms of this rank, warm-up dropped."""
    token = torch.zeros(1, device=inp.x.device)

    def prepare():
        flush_buf.zero_()
        if group is not None:  # align the ranks' GPU timelines before the region starts
            dist.all_reduce(token, group=group)

    # Every implementation starts from the same idle GPU: timed right after a heavier one (the baseline, the fp64
    # reference), primemoe measured up to 6.5% slower on the H200, power-capped and hotter.
    torch.cuda.synchronize()
    time.sleep(args.settle)
    events = []
    for _ in range(args.warmup + args.iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        prepare()
        ev[0].record()
        state = runner.forward()
        ev[1].record()
        prepare()
        ev[2].record()
        grads = runner.backward(state, inp.dy)
        ev[3].record()
        del state, grads
        events.append(ev)
    torch.cuda.synchronize()
    timed = events[args.warmup:]
    return [e[0].elapsed_time(e[1]) for e in timed], [e[2].elapsed_time(e[3]) for e in timed]


def _error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


class _ShapeContext:
    """What the cases of one shape share on a rank: the run's arguments and, at EP > 1, the open
    primemoe.Buffer (sized for the shape's largest token count, made on first use, remade when a case
    needs other arguments, closed with the shape)."""

    def __init__(self, args, group, shape: str, max_tokens: int):
        self.args, self.group, self.shape, self.max_tokens = args, group, shape, max_tokens
        self._key = self._buffer = None

    def buffer(self, precision: str = "bf16", num_sms: Optional[int] = None):
        import primemoe
        from primemoe.buffer import (DEFAULT_NUM_SMS, EP_ROW_ALIGN, SYMMETRIC_HEAP_MARGIN, EpConfig, ep_layout,
                                     ep_transport)
        num_sms = num_sms or DEFAULT_NUM_SMS
        if self._key != (precision, num_sms):
            self.close()
            world = dist.get_world_size(self.group)
            # NVSHMEM sizes its heap when it starts: let that hold the run's largest workspace,
            # whichever shape comes first (a value the user set is kept).
            puts = ep_transport(os.environ) == "put"
            largest = max(ep_layout(EpConfig(world, max(self.args.tokens), h, k, e // world, EP_ROW_ALIGN, puts))[1]
                          for h, _, e, k in map(SHAPES.get, self.args.shapes) if e % world == 0)
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(largest + SYMMETRIC_HEAP_MARGIN))
            hidden, inter, experts, top_k = SHAPES[self.shape]
            self._buffer = primemoe.Buffer(self.group, max_tokens_per_rank=self.max_tokens, hidden=hidden,
                                           intermediate=inter, num_experts=experts, top_k=top_k,
                                           precision=precision, num_sms=num_sms)
            self._key = (precision, num_sms)
        return self._buffer

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()  # collective: every rank closes the shape's buffer together
        self._key = self._buffer = None


def _run_one(case: Case, inp: Inputs, args, group, flush_buf, ctx: _ShapeContext) -> dict:
    try:
        runner = case.spec().make(inp, group, case, ctx)
        with torch.no_grad():
            fwd, bwd = _time(runner, inp, args, group, flush_buf)
        return {"fwd": fwd, "bwd": bwd}
    except Exception as exc:  # OOM or a failing implementation: record it and go on
        return {"error": _error_text(exc), "status": case.spec().failure}
    finally:
        torch.cuda.empty_cache()


def _result(case: Case, status: str, note: str = "", **fields) -> dict:
    hidden, inter, experts, top_k = SHAPES[case.shape]
    sms = {"num_sms": case.num_sms} if isinstance(case, CommCase) else {}
    return dict(shape=case.shape, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k,
                tokens=case.tokens, ep=case.ep, precision=case.precision, impl=case.impl, **sms,
                status=status, note=note, **{**dict.fromkeys(case.METRICS), **fields})


def _summarize(case: Case, outcomes: list) -> dict:
    """Combine the ranks' outcomes: per iteration the slowest rank, then the median."""
    errors = [(r, o) for r, o in enumerate(outcomes) if "error" in o]
    if errors:
        rank, o = errors[0]
        return _result(case, o.get("status", "error"), o["error"] if case.ep == 1 else f"rank {rank}: {o['error']}")
    hidden, inter, _, top_k = SHAPES[case.shape]
    fwd = statistics.median(map(max, zip(*(o["fwd"] for o in outcomes))))
    bwd = statistics.median(map(max, zip(*(o["bwd"] for o in outcomes))))
    routed = statistics.mean(o["routed_rows"] for o in outcomes)
    remote = statistics.mean(o["remote_rows"] for o in outcomes)
    if isinstance(case, CommCase):  # each direction moves every remote row once: same bytes both ways
        remote_bytes = direction_bytes(remote, hidden)
        dispatch_gbps, combine_gbps = remote_bytes / fwd / 1e6, remote_bytes / bwd / 1e6
        return _result(case, "ok", dispatch_ms=fwd, combine_ms=bwd, dispatch_gbps=dispatch_gbps,
                       combine_gbps=combine_gbps, remote_mb=remote_bytes / 1e6,
                       total_mb=direction_bytes(routed, hidden) / 1e6,
                       target=comm_target(case, min(dispatch_gbps, combine_gbps)))
    return _result(
        case, "ok", fwd_ms=fwd, bwd_ms=bwd,
        fwd_tflops=fwd_flops(case.tokens, top_k, hidden, inter) / fwd / 1e9,
        bwd_tflops=bwd_flops(case.tokens, top_k, hidden, inter) / bwd / 1e9,
        nvlink_gbps=nvlink_bytes(remote, hidden) / fwd / 1e6 if case.ep > 1 else None,
        routed_rows=round(routed), remote_rows=round(remote))


def _gather(obj, group) -> list:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _run_cases(cases: list, args, group, report) -> None:
    """Run the cases of one process set on this rank; rank 0 reports each result."""
    device = torch.device("cuda", torch.cuda.current_device())
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    for shape, shape_cases in itertools.groupby(cases, key=lambda c: c.shape):
        shape_cases = list(shape_cases)
        ctx = _ShapeContext(args, group, shape, max(c.tokens for c in shape_cases))
        for tokens, block in itertools.groupby(shape_cases, key=lambda c: c.tokens):
            block = list(block)
            inp, input_error = None, None
            if any(c.skip is None for c in block):
                try:
                    inp = make_inputs(shape, tokens, rank, world, device, args.seed)
                    rows = {"routed_rows": int((inp.topk_idx >= 0).sum()),
                            "remote_rows": remote_rows(inp.topk_idx, inp.w1.shape[0], rank)}
                except Exception as exc:
                    input_error = f"creating inputs: {_error_text(exc)}"
            for case in block:
                if case.skip is not None:
                    result = _result(case, "n/a", case.skip)
                else:
                    outcome = ({"error": input_error} if input_error else
                               {**_run_one(case, inp, args, group, flush_buf, ctx), **rows})
                    result = _summarize(case, _gather(outcome, group))
                if rank == 0:
                    report(case, result)
            del inp
            torch.cuda.empty_cache()
        ctx.close()


def _progress(case: Case, result: dict, total: int) -> None:
    head = f"[{case.index + 1}/{total}] {case.label()}:"
    if result["status"] == "ok":
        print(f"{head} {case.summary(result)}", flush=True)
    else:
        print(f"{head} {result['status']}: {result['note']}", flush=True)


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
    ("impl", "impl", "{}"), ("fwd ms", "fwd_ms", "{:.3f}"), ("bwd ms", "bwd_ms", "{:.3f}"),
    ("fwd TFLOP/s", "fwd_tflops", "{:.1f}"), ("bwd TFLOP/s", "bwd_tflops", "{:.1f}"),
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
    settle = f"; {args.settle:g} s idle before each case and implementation"
    return (f"CUDA events around {regions} separately; {args.warmup} warm-up, median of "
            f"{args.iters} iterations{settle}; L2 flushed (256 MB write) before every timed region; EP>1: ranks "
            f"aligned by an all-reduce before each region, iteration time = max over ranks")


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
            flops="per GPU: forward 6*T*K*H*I, backward 12*T*K*H*I, T = tokens per rank",
            nvlink="forward bytes of remote routed rows (dispatch out + combine back, H*2 bytes each), "
                   "mean over ranks, / forward time; rows/rank and remote rows are means over ranks")
    meta["implementations"] = {name: impl.about for name, impl in (COMM_IMPLS if args.comm else IMPLS).items()}
    meta["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return meta


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
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        print("no successful case: skipping the plot", flush=True)
        return
    groups = list(dict.fromkeys((r["shape"], r["tokens"], r["ep"], r["precision"]) for r in ok))
    impls = list(dict.fromkeys(map(_series, ok)))
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(groups)), 8), sharex=True)
    for ax, (key, ylabel) in zip(axes, panels):
        for j, impl in enumerate(impls):
            points = [(i, r[key]) for i, g in enumerate(groups) for r in ok
                      if _series(r) == impl and (r["shape"], r["tokens"], r["ep"], r["precision"]) == g]
            ax.bar([i + (j - (len(impls) - 1) / 2) * width for i, _ in points], [v for _, v in points],
                   width, label=impl)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    axes[1].set_xticks(range(len(groups)), [f"{s}\nT={t} EP={e}\n{p}" for s, t, e, p in groups], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: list, args) -> None:
    """Layer results under "results"; --comm results under "comm", with their own table and plot."""
    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata(args)
    if args.comm:
        section, columns, notes = "comm", COMM_COLUMNS, ("timing", "bytes", "targets")
        panels = (("dispatch_gbps", "dispatch GB/s per GPU"), ("combine_gbps", "combine GB/s per GPU"))
    else:
        section, columns, notes = "results", COLUMNS, ("timing", "flops", "nvlink")
        panels = (("fwd_tflops", "forward TFLOP/s per GPU"), ("bwd_tflops", "backward TFLOP/s per GPU"))
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
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=TARGET_SHAPES)
    p.add_argument("--tokens", nargs="+", type=_int_from(1), default=[4096, 8192, 16384], help="tokens per rank")
    p.add_argument("--ep", nargs="+", type=_int_from(1), default=[1, 2],
                   help="expert-parallel sizes (one GPU per rank)")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["bf16"])
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--warmup", type=_int_from(0), default=5)
    p.add_argument("--iters", type=_int_from(1), default=20, help="timed iterations (median reported)")
    p.add_argument("--settle", type=_seconds, default=2.0,
                   help="seconds the GPU idles before each case and implementation is timed (default 2)")
    p.add_argument("--skip-reference-above", type=_int_from(1), metavar="TOKENS",
                   help="run the reference only up to this many tokens per rank (default: the smallest --tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    p.add_argument("--dry-run", action="store_true", help="print the cases and FLOP counts; needs no GPU")
    p.add_argument("--comm", action="store_true",
                   help="time dispatch and combine alone (primemoe, NCCL, symm_mem; EP > 1) instead of the layer; "
                        "--precision and --impl do not apply")
    p.add_argument("--num-sms", nargs="+", type=_int_from(1), default=[8, 16, 24],
                   help="--comm: SM counts for primemoe's dispatch/combine kernels (one Buffer each)")
    return p.parse_args(argv)


def print_cases(cases: list) -> None:
    comm = bool(cases) and isinstance(cases[0], CommCase)
    print(f"{len(cases)} communication cases (routed bytes per rank and direction):" if comm else
          f"{len(cases)} cases (FLOPs per rank):")
    for c in cases:
        hidden, inter, _, top_k = SHAPES[c.shape]
        if comm:
            sizes = f"{direction_bytes(c.tokens * top_k, hidden) / 1e6:9.1f} MB"
        else:
            flops = (fwd_flops(c.tokens, top_k, hidden, inter), bwd_flops(c.tokens, top_k, hidden, inter))
            sizes = f"fwd {flops[0] / 1e9:9.1f} GFLOP  bwd {flops[1] / 1e9:9.1f} GFLOP"
        print(f"  {c.label():<48} {sizes}  {'run' if c.skip is None else f'n/a: {c.skip}'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = build_comm_cases(args) if args.comm else build_cases(args)
    if args.comm and 1 in args.ep:
        print("skip EP=1: --comm times rows moving between GPUs, it needs EP > 1", flush=True)
    if args.dry_run:
        print_cases(cases)
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
    write_outputs(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
