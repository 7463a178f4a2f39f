"""Per-kernel timeline of one forward+backward of primemoe.moe, from torch.profiler's CUDA activities. EP = 1: the local
path and the Buffer path over a Buffer of one rank (which moves nothing between GPUs and so overlaps nothing), and
what the Buffer path costs over the local one. EP = W (torchrun): the Buffer path sequential, overlapped, and with the
combines overlapped too; whether FC1 really runs alongside the dispatch (its start before the dispatch's end), and
the fraction of the sequential run's communication time each overlap hides.

    python scripts/ep_timeline.py [--shapes qwen3-30b-a3b ...] [--tokens 16384] [--out timeline.json]
    torchrun --nproc-per-node W scripts/ep_timeline.py ...    # EP = W: every rank's timeline (no local path)

Prints, per (shape, path), each kernel's start and end in microseconds from the first kernel's start, its stream and a
short name, then the sequential communication time and the fraction each overlap hides; --out writes the timelines
as JSON (EP > 1: one file per rank, ``.rankR`` before the suffix). Under torchrun the ranks take one GPU each where
there are enough (NCCL), else all share cuda:0 (gloo): timings of ranks sharing a GPU say nothing about overlap."""

import argparse
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import primemoe
from primemoe.bench import _single_rank_group, make_inputs
from primemoe.buffer import EP_ROW_ALIGN, SYMMETRIC_HEAP_MARGIN, EpConfig, ep_layout
from primemoe.shapes import MODEL_SHAPES

# The Buffers open at once: overlapped, sequential, combines overlapped.
BUFFERS = 3

SHORT_NAMES = [  # (pattern in the kernel's name, short name), first match wins
    ("ep_notify", "dispatch.notify"), ("ep_dispatch_rows", "dispatch.rows"), ("ep_wait_arrivals", "dispatch.wait"),
    ("ep_combine_rows", "combine.rows"), ("ep_wait_combine", "combine.wait"), ("combine_reduce", "combine_reduce"),
    ("dispatch_layout", "layout"), ("gather_rows", "gather_rows"), ("copy_routed", "copy_routed_rows"),
]


GEMMS = {("0", "1"): "gemm.fc1_swiglu", ("0", "2"): "gemm.fc2_dgrad_swiglu", ("0", "0"): "gemm.rows",
         ("1", "0"): "gemm.wgrad"}


def short(name: str) -> str:
    if "grouped_gemm_kernel" in name:  # demangled "(primemoe::GemmSchedule)0", or mangled "GemmScheduleE0"
        schedule = re.search(r"GemmSchedule\)?E?(\d)", name)
        epilogue = re.search(r"GemmEpilogue\)?E?(\d)", name)
        key = (schedule.group(1), epilogue.group(1)) if schedule and epilogue else None
        return GEMMS.get(key, "gemm")
    for pattern, label in SHORT_NAMES:
        if pattern in name:
            return label
    return re.sub(r"\(.*", "", name)[:48]


def timeline(fn, dy):
    for _ in range(3):
        y = fn()
        torch.autograd.grad(y, fn.leaves, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("forward"):
            y = fn()
        with torch.profiler.record_function("backward"):
            torch.autograd.grad(y, fn.leaves, dy)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    t0 = min(e.time_range.start for e in kernels)
    rows = sorted(((e.time_range.start - t0, e.time_range.end - t0, getattr(e, "device_resource_id", 0),
                    short(e.name)) for e in kernels), key=lambda r: r[0])
    return rows


# The kernels that move rows between ranks (their waits excluded: a wait kernel's span is time spent elsewhere).
COMMUNICATION = ("dispatch.notify", "dispatch.rows", "combine.rows")


def communication_us(rows) -> float:
    """Microseconds of communication kernels in a timeline (``timeline``'s rows)."""
    return sum(end - start for start, end, _, name in rows if name in COMMUNICATION)


def hidden_fraction(sequential, overlapped) -> float:
    """The fraction of the sequential run's communication time that the overlapped run hides: (sequential step
    minus overlapped step) over the sequential communication time (issue 37's measure)."""
    comm = communication_us(sequential)
    return (sequential[-1][1] - overlapped[-1][1]) / comm if comm > 0 else 0.0


class Moe:
    def __init__(self, inp, buffer):
        self.inp, self.buffer = inp, buffer
        self.leaves = [t.detach().clone().requires_grad_() for t in (inp.x, inp.topk_weights, inp.w1, inp.w2)]

    def __call__(self):
        x, tw, w1, w2 = self.leaves
        return primemoe.moe(x, self.inp.topk_idx, tw, w1, w2, buffer=self.buffer)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b"], choices=MODEL_SHAPES)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # under torchrun
        rank = int(os.environ["RANK"])
        one_each = torch.cuda.device_count() >= world
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) if one_each else 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl" if one_each else "gloo")
        group = dist.group.WORLD
    else:
        rank, device, group = 0, torch.device("cuda", 0), _single_rank_group()
    # NVSHMEM sizes its heap when the first Buffer starts it: room for every Buffer this run opens at once.
    largest = max(ep_layout(EpConfig(world, args.tokens, h, k, e // world, EP_ROW_ALIGN, False))[1]
                  for h, _, e, k in (MODEL_SHAPES[s].dims for s in args.shapes))
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(BUFFERS * largest + SYMMETRIC_HEAP_MARGIN))
    say = print if rank == 0 else (lambda *a, **k: None)
    results = {}
    for shape in args.shapes:
        hidden, inter, experts, top_k = MODEL_SHAPES[shape].dims
        inp = make_inputs(shape, args.tokens, rank, world, device, 0)
        variants = ((("buffer", {}),) if world == 1 else
                    (("buffer overlap", dict(overlap=True)), ("buffer sequential", dict(overlap=False)),
                     ("buffer overlap_combine", dict(overlap=True, overlap_combine=True))))
        paths = {"local": None} if world == 1 else {}
        for name, options in variants:
            paths[name] = primemoe.Buffer(group, max_tokens_per_rank=args.tokens, hidden=hidden, intermediate=inter,
                                          num_experts=experts, top_k=top_k, **options)
        for path, buffer in paths.items():
            rows = timeline(Moe(inp, buffer), inp.dy)
            results[f"{shape} {path}"] = rows
            say(f"\n== {shape} T={args.tokens} EP={world} {path}: {rows[-1][1]:.0f} us in all"
                + (" (rank 0)" if world > 1 else ""))
            for start, end, stream, name in rows:
                if end - start >= 2:
                    say(f"{start:9.0f} {end:9.0f} {end - start:8.0f}  s{stream:<3} {name}")
        if world == 1:
            local, buffer = results[f"{shape} local"], results[f"{shape} buffer"]
            say(f"\n{shape} T={args.tokens} EP=1: the Buffer path {buffer[-1][1] - local[-1][1]:+.0f} us over the local "
                f"path ({buffer[-1][1] / local[-1][1] - 1:+.1%}); one rank overlaps nothing")
        else:
            sequential = results[f"{shape} buffer sequential"]
            summary = (f"{shape} T={args.tokens} EP={world} rank {rank}: sequential communication "
                       f"{communication_us(sequential):.0f} us; hidden by "
                       + ", ".join(f"{name} {hidden_fraction(sequential, results[f'{shape} buffer {name}']):.0%}"
                                   for name in ("overlap", "overlap_combine")))
            gathered = [None] * world
            dist.all_gather_object(gathered, summary)
            for line in gathered:
                say(line)
        for buffer in paths.values():
            if buffer is not None:
                buffer.close()
    if args.out:
        out = Path(args.out)
        if world > 1:
            out = out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
        with open(out, "w") as f:
            json.dump(results, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
