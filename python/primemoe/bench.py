"""MoE layer benchmark: primemoe, the PyTorch baseline and the reference, side by side.

    python -m primemoe.bench [--shapes ...] [--tokens ...] [--ep 1 2] [--impl ...] [--out DIR]

For every (shape, tokens per rank, EP, precision, implementation) it times forward and
backward separately with CUDA events: warm-up, then the median of ``--iters``, with L2
flushed (a 256 MB write) before every timed region. TFLOP/s are per GPU and counted as in
DESIGN.md section 6: forward 6*T*K*H*I, backward 12*T*K*H*I (T = tokens per rank, no
credit for recomputation). EP > 1 spawns one process per GPU (NCCL, multicast off); an
iteration's time there is the max over ranks, which is what a training step sees.
Writes a progress line per case, a final table, and DIR/results.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass
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
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
L2_FLUSH_BYTES = 256 << 20
NCCL_TIMEOUT = datetime.timedelta(minutes=5)  # a rank that fails inside a collective must not hang the run


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


def nvlink_bytes(rows: int, hidden: int, elem_bytes: int = 2) -> int:
    """Forward cross-rank traffic of ``rows`` remote rows: dispatch out plus combine back, bf16."""
    return 2 * rows * hidden * elem_bytes


# ---------------------------------------------------------------- implementations
# Each adapter is built from (inputs, group, precision); forward() returns the state
# backward(state, dy) needs. Adding an implementation is one entry in IMPLS.

class _Baseline:
    def __init__(self, inp, group, precision):
        from primemoe import baseline
        self.mod, self.inp, self.group = baseline, inp, group

    def forward(self):
        i = self.inp
        return self.mod.forward(i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, group=self.group)

    def backward(self, state, dy):
        return self.mod.backward(state[1], dy)


class _Primemoe:
    def __init__(self, inp, group, precision):
        import primemoe  # noqa: F401  (registers torch.ops.primemoe)
        self.inp, self.precision = inp, precision

    def forward(self):
        i = self.inp
        return torch.ops.primemoe.moe_forward(i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, self.precision, True)

    def backward(self, state, dy):
        i = self.inp
        return torch.ops.primemoe.moe_backward(
            dy, i.x, i.topk_idx, i.topk_weights, i.w1, i.w2, state[1], self.precision)


class _Reference:
    def __init__(self, inp, group, precision):
        from primemoe import reference
        self.moe, self.inp = reference.moe, inp

    def forward(self):
        i = self.inp
        leaves = [t.detach().requires_grad_() for t in (i.x, i.topk_weights, i.w1, i.w2)]
        with torch.enable_grad():
            y = self.moe(leaves[0], i.topk_idx, *leaves[1:])
        return y, leaves

    def backward(self, state, dy):
        y, leaves = state
        return torch.autograd.grad(y, leaves, dy)


@dataclass(frozen=True)
class Impl:
    make: Callable
    precisions: tuple
    about: str
    single_gpu: Optional[str] = None  # why it cannot run at EP > 1, if it cannot


IMPLS = {
    "baseline": Impl(_Baseline, ("bf16",), "sort + torch._grouped_mm; NCCL all-to-all at EP>1"),
    "primemoe": Impl(_Primemoe, PRECISIONS, "torch.ops.primemoe.moe_forward / moe_backward",
                     single_gpu="EP>1 needs primemoe.Buffer (not available yet)"),
    "reference": Impl(_Reference, ("bf16",), "pure-PyTorch loop over experts (fp32), autograd backward",
                      single_gpu="single GPU only"),
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

    def label(self) -> str:
        return f"{self.shape} T={self.tokens} EP={self.ep} {self.precision} {self.impl}"


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


def _run_one(case: Case, inp: Inputs, args, group, flush_buf) -> dict:
    try:
        runner = IMPLS[case.impl].make(inp, group, case.precision)
        with torch.no_grad():
            fwd, bwd = _time(runner, inp, args, group, flush_buf)
        return {"fwd": fwd, "bwd": bwd}
    except Exception as exc:  # OOM or a failing implementation: record it and go on
        return {"error": _error_text(exc)}
    finally:
        torch.cuda.empty_cache()


def _result(case: Case, status: str, note: str = "", **fields) -> dict:
    hidden, inter, experts, top_k = SHAPES[case.shape]
    metrics = dict.fromkeys(("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "nvlink_gbps",
                             "routed_rows", "remote_rows"))
    return dict(shape=case.shape, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k,
                tokens=case.tokens, ep=case.ep, precision=case.precision, impl=case.impl,
                status=status, note=note, **{**metrics, **fields})


def _summarize(case: Case, outcomes: list) -> dict:
    """Combine the ranks' outcomes: per iteration the slowest rank, then the median."""
    errors = [(r, o["error"]) for r, o in enumerate(outcomes) if "error" in o]
    if errors:
        rank, msg = errors[0]
        return _result(case, "error", msg if case.ep == 1 else f"rank {rank}: {msg}")
    hidden, inter, _, top_k = SHAPES[case.shape]
    fwd = statistics.median(map(max, zip(*(o["fwd"] for o in outcomes))))
    bwd = statistics.median(map(max, zip(*(o["bwd"] for o in outcomes))))
    routed = statistics.mean(o["routed_rows"] for o in outcomes)
    remote = statistics.mean(o["remote_rows"] for o in outcomes)
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
    """Run the cases of one EP size on this rank; rank 0 reports each result."""
    device = torch.device("cuda", torch.cuda.current_device())
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    for (shape, tokens), block in itertools.groupby(cases, key=lambda c: (c.shape, c.tokens)):
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
                outcome = {"error": input_error} if input_error else {**_run_one(case, inp, args, group, flush_buf), **rows}
                result = _summarize(case, _gather(outcome, group))
            if rank == 0:
                report(case, result)
        del inp
        torch.cuda.empty_cache()


def _progress(case: Case, result: dict, total: int) -> None:
    head = f"[{case.index + 1}/{total}] {case.label()}:"
    if result["status"] == "ok":
        print(f"{head} fwd {result['fwd_ms']:.3f} ms ({result['fwd_tflops']:.1f} TFLOP/s), "
              f"bwd {result['bwd_ms']:.3f} ms ({result['bwd_tflops']:.1f} TFLOP/s)", flush=True)
    else:
        print(f"{head} {result['status']}: {result['note']}", flush=True)


def _worker(rank: int, world: int, port: int, cases: list, args, total: int, results) -> None:
    os.environ.update(MULTICAST_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=NCCL_TIMEOUT,
                            device_id=torch.device("cuda", rank))

    def report(case, result):
        _progress(case, result, total)
        results.put((case.index, result))
    try:
        _run_cases(cases, args, dist.group.WORLD, report)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ep(cases: list, args, total: int) -> list:
    """Spawn one process per rank; keep what rank 0 reported even if a rank dies."""
    import torch.multiprocessing as mp
    ep = cases[0].ep
    results = mp.get_context("spawn").Queue()
    procs = mp.start_processes(_worker, args=(ep, _free_port(), cases, args, total, results),
                               nprocs=ep, join=False, start_method="spawn")
    got, failure, done = {}, None, False
    while not done:
        try:
            done = procs.join(timeout=1)
        except Exception as exc:
            failure, done = _error_text(exc), True
        while True:  # drain while running: a full pipe would block the workers
            try:
                index, result = results.get(timeout=0.1) if done else results.get_nowait()
            except queue.Empty:
                break
            got[index] = result
    for case in cases:
        if case.index not in got:
            got[case.index] = (_result(case, "n/a", case.skip) if case.skip else
                               _result(case, "error", f"EP={ep} worker failed: {failure or 'no result'}"))
            _progress(case, got[case.index], total)
    return [got[case.index] for case in cases]


# ---------------------------------------------------------------- output

COLUMNS = [  # header, result key, format
    ("shape", "shape", "{}"), ("T/rank", "tokens", "{}"), ("EP", "ep", "{}"), ("prec", "precision", "{}"),
    ("impl", "impl", "{}"), ("fwd ms", "fwd_ms", "{:.3f}"), ("bwd ms", "bwd_ms", "{:.3f}"),
    ("fwd TFLOP/s", "fwd_tflops", "{:.1f}"), ("bwd TFLOP/s", "bwd_tflops", "{:.1f}"),
    ("NVLink GB/s", "nvlink_gbps", "{:.1f}"), ("rows/rank", "routed_rows", "{}"),
    ("remote rows", "remote_rows", "{}"), ("status", "status", "{}"),
]


def _cells(r: dict) -> list:
    cells = ["-" if r[key] is None else fmt.format(r[key]) for _, key, fmt in COLUMNS]
    if r["status"] != "ok":
        cells[-1] = f"{r['status']}: {r['note'][:100]}"
    if r["status"] == "n/a":
        cells[5:10] = ["n/a"] * 5
    return cells


def format_table(results: list, markdown: bool = False) -> str:
    heads = [h for h, _, _ in COLUMNS]
    rows = [_cells(r) for r in results]
    numeric = [5 <= i < len(COLUMNS) - 1 for i in range(len(COLUMNS))]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]

    def fmt(row):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric)).rstrip()
    return "\n".join([fmt(heads), "  ".join("-" * w for w in widths)] + [fmt(row) for row in rows])


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _timing_note(args) -> str:
    return (f"CUDA events around forward and backward separately; {args.warmup} warm-up, median of "
            f"{args.iters} iterations; L2 flushed (256 MB write) before every timed region; EP>1: ranks "
            f"aligned by an all-reduce before each region, iteration time = max over ranks")


def metadata(args) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": _timing_note(args),
        "flops": "per GPU: forward 6*T*K*H*I, backward 12*T*K*H*I, T = tokens per rank",
        "nvlink": "forward bytes of remote routed rows (dispatch out + combine back, H*2 bytes each), "
                  "mean over ranks, / forward time; rows/rank and remote rows are means over ranks",
        "implementations": {name: impl.about for name, impl in IMPLS.items()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def write_plot(results: list, path: Path) -> None:
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
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(groups)), 8), sharex=True)
    for ax, key, title in zip(axes, ("fwd_tflops", "bwd_tflops"), ("forward", "backward")):
        for j, impl in enumerate(impls):
            points = [(i, r[key]) for i, g in enumerate(groups) for r in ok
                      if r["impl"] == impl and (r["shape"], r["tokens"], r["ep"], r["precision"]) == g]
            ax.bar([i + (j - (len(impls) - 1) / 2) * width for i, _ in points], [v for _, v in points],
                   width, label=impl)
        ax.set_ylabel(f"{title} TFLOP/s per GPU")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    axes[1].set_xticks(range(len(groups)), [f"{s}\nT={t} EP={e}\n{p}" for s, t, e, p in groups], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: list, args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata(args)
    (args.out / "results.json").write_text(json.dumps({"metadata": meta, "results": results}, indent=2) + "\n")
    md = [f"# primemoe benchmark ({meta['date']})", "",
          *(f"- {k}: {meta[k]}" for k in ("gpu", "gpu_count", "torch", "cuda", "git_commit", "timing", "flops", "nvlink")),
          "", format_table(results, markdown=True), ""]
    (args.out / "results.md").write_text("\n".join(md))
    write_plot(results, args.out / "results.png")
    print(f"\n{meta['timing']}\n\n{format_table(results)}\n\nwritten: {args.out}/results.{{json,md,png}}", flush=True)


# ---------------------------------------------------------------- command line

def _int_from(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text}")
        return value
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m primemoe.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    p.add_argument("--tokens", nargs="+", type=_int_from(1), default=[4096, 8192, 16384], help="tokens per rank")
    p.add_argument("--ep", nargs="+", type=_int_from(1), default=[1, 2], help="expert-parallel sizes (one GPU per rank)")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["bf16"])
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--warmup", type=_int_from(0), default=5)
    p.add_argument("--iters", type=_int_from(1), default=20, help="timed iterations (median reported)")
    p.add_argument("--skip-reference-above", type=_int_from(1), metavar="TOKENS",
                   help="run the reference only up to this many tokens per rank (default: the smallest --tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    p.add_argument("--dry-run", action="store_true", help="print the cases and FLOP counts; needs no GPU")
    return p.parse_args(argv)


def print_cases(cases: list) -> None:
    print(f"{len(cases)} cases (FLOPs per rank):")
    for c in cases:
        hidden, inter, _, top_k = SHAPES[c.shape]
        flops = (fwd_flops(c.tokens, top_k, hidden, inter), bwd_flops(c.tokens, top_k, hidden, inter))
        plan = "run" if c.skip is None else f"n/a: {c.skip}"
        print(f"  {c.label():<48} fwd {flops[0] / 1e9:9.1f} GFLOP  bwd {flops[1] / 1e9:9.1f} GFLOP  {plan}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = build_cases(args)
    if args.dry_run:
        print_cases(cases)
        return 0
    if not torch.cuda.is_available():
        print("primemoe.bench: no CUDA GPU visible, nothing to time on CPU "
              "(--dry-run lists the cases without one)", file=sys.stderr)
        return 2
    os.environ.update(MULTICAST_OFF)
    print(_timing_note(args), flush=True)
    results, gpus = [], torch.cuda.device_count()
    for ep, block in itertools.groupby(cases, key=lambda c: c.ep):
        block = list(block)
        if ep > gpus:
            print(f"skip EP={ep}: needs {ep} GPUs, {gpus} visible", flush=True)
            results += [_result(c, "n/a", c.skip) if c.skip else _result(c, "skipped", f"needs {ep} GPUs, {gpus} visible")
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
