"""A/B of two builds of primemoe (this checkout against a base commit), one process per build and round, through
the public API only, so any two commits compare: checksums of every output (the same bits?) and times (the same
speed?). Run by scripts/ab_commit.sh, which builds both.

    python scripts/ab_commit.py hash --out F.json          # checksums of the layer's and the engine ops' outputs
    python scripts/ab_commit.py time --out F.json [--cells qwen3-235b-a22b:8192 ...] [--iters N]
    python scripts/ab_commit.py report --out DIR            # DIR/hash-{base,new}.json, DIR/time-{base,new}-*.json
"""

import argparse
import json
import statistics
import sys

try:  # the report needs neither
    import torch

    import primemoe

    ops = torch.ops.primemoe
except ImportError:
    torch = primemoe = ops = None
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-235b-a22b": (4096, 1536, 128, 8)}  # H, I, E, K
# (shape, tokens, routing) of the checksums: both tile orders and 192-row tiles (235B), half tiles (skewed), masked
# slots, awkward sizes.
HASH_CASES = [("qwen3-30b-a3b", 8192, "uniform"), ("qwen3-30b-a3b", 17, "masked"), ("qwen3-30b-a3b", 4095, "skewed"),
              ("qwen3-235b-a22b", 8192, "uniform"), ("qwen3-235b-a22b", 4096, "skewed"),
              ("qwen3-235b-a22b", 1, "uniform")]


def problem(shape, tokens, routing, seed):
    H, I, E, K = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, E, device="cuda", generator=g)
    if routing == "skewed":
        logits[:, :8] += 3.0
    idx, w = primemoe.route(logits, K)
    if routing == "masked":
        idx = torch.where(torch.rand(idx.shape, device="cuda", generator=g) < 0.3, -1, idx)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    dy = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    return x, idx, w, w1, w2, dy


def checksum(t):
    """Two position-weighted sums of the raw bits (on the GPU: the weight gradients are GBs)."""
    if t.numel() == 0:
        return [0, 0]
    bits = t.contiguous().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int64)
    pos = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64)
    return [int((bits * (pos % 65521 + 1)).sum()), int((bits * (pos % 1021 + 7) * (pos % 3 + 1)).sum())]


def hashes():
    out = {}
    for shape, tokens, routing in HASH_CASES:
        x, idx, w, w1, w2, dy = problem(shape, tokens, routing, seed=tokens)
        for keep in (True, False):
            y, fc1 = ops.moe_forward(x, idx, w, w1, w2, "bf16", keep)
            grads = ops.moe_backward(dy, x, idx, w, w1, w2, fc1 if keep else None, "bf16")
            for name, t in zip(("y", "fc1_out", "dx", "d_topk_weights", "dw1", "dw2"), (y, fc1, *grads)):
                out[f"{shape}:{tokens}:{routing}:keep={keep}:{name}"] = checksum(t)
        # FC1 under the expert-parallel path's rows-ready hook (counters satisfied): its own config where it claims.
        E = w1.shape[0]
        _, offsets, _, row_to_slot = ops.dispatch_layout(idx, E, 0, E, 64)
        xs = ops.gather_rows(x, row_to_slot, idx.shape[1], None)
        ready = torch.ones(E, dtype=torch.int64, device="cuda")
        epoch = torch.ones(1, dtype=torch.int64, device="cuda")
        a, h = ops.fc1_swiglu(xs, w1, offsets, True, ready, epoch, 1, 0, zero_unrouted=False)
        routed = int(offsets[-1])
        out[f"{shape}:{tokens}:{routing}:fc1_hook:a"] = checksum(a[:routed])
        out[f"{shape}:{tokens}:{routing}:fc1_hook:h"] = checksum(h[:routed])
        o = ops.expert_gemm(a, w2, offsets, False, ops.gather_scalars(w.reshape(-1), row_to_slot),
                            zero_unrouted=False)
        out[f"{shape}:{tokens}:{routing}:fc2_after_hook"] = checksum(o[:routed])
    primemoe.check_errors()
    return out


def timed(fn, iters, flush):
    """Median ms of fn over iters, L2 flushed before each."""
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def times(cells, iters):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = {}
    for cell in cells:
        shape, tokens = cell.split(":")
        x, idx, w, w1, w2, dy = problem(shape, int(tokens), "uniform", seed=1)
        leaves = [t.requires_grad_() for t in (x, w, w1, w2)]
        state = {}

        def raw_forward():
            state["raw"] = ops.moe_forward(x.detach(), idx, w.detach(), w1.detach(), w2.detach(), "bf16", True)

        def raw_backward():
            fc1 = state["raw"][1]
            ops.moe_backward(dy, x.detach(), idx, w.detach(), w1.detach(), w2.detach(), fc1, "bf16")

        def user_forward():
            state["y"] = primemoe.moe(x, idx, w, w1, w2)

        def user_backward():
            torch.autograd.grad(state["y"], leaves, dy)

        for _ in range(3):  # warm-up
            raw_forward()
            raw_backward()
            user_forward()
            user_backward()
        # Each backward after a fresh forward (outside the timed region); the paths alternate.
        samples = {k: [] for k in ("raw_forward_ms", "raw_backward_ms", "user_forward_ms", "user_backward_ms")}
        for _ in range(iters):
            samples["raw_forward_ms"].append(timed(raw_forward, 1, flush))
            samples["raw_backward_ms"].append(timed(raw_backward, 1, flush))
            samples["user_forward_ms"].append(timed(user_forward, 1, flush))
            samples["user_backward_ms"].append(timed(user_backward, 1, flush))
        result = {k: statistics.median(v) for k, v in samples.items()}
        out[cell] = result
        print(cell, {k: round(v, 4) for k, v in result.items()}, flush=True)
    return out


def report(out_dir):
    """Mismatched checksums, and per cell and metric the median over rounds of each build and new / base - 1."""
    from pathlib import Path
    d = Path(out_dir)
    load = lambda f: json.loads(f.read_text())["result"]  # noqa: E731
    base, new = load(d / "hash-base.json"), load(d / "hash-new.json")
    bad = sorted(k for k in base if base[k] != new.get(k))
    print(f"checksums: {len(base) - len(bad)} of {len(base)} equal" + ("" if not bad else "; differ: " + ", ".join(bad)))
    rounds = {b: [load(f) for f in sorted(d.glob(f"time-{b}-*.json"))] for b in ("base", "new")}
    summary = {"checksums_equal": not bad, "differ": bad, "times": {}}
    for cell in rounds["base"][0] if rounds["base"] else []:
        for metric in rounds["base"][0][cell]:
            med = {b: statistics.median(r[cell][metric] for r in rounds[b]) for b in rounds}
            change = med["new"] / med["base"] - 1
            summary["times"][f"{cell}:{metric}"] = {**med, "change": change}
            print(f"{cell:24s} {metric:18s} base {med['base']:8.4f} new {med['new']:8.4f}  {100 * change:+6.2f}%")
    (d / "ab-summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if not bad else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["hash", "time", "report"])
    p.add_argument("--out", required=True)
    p.add_argument("--cells", nargs="+", default=["qwen3-30b-a3b:8192", "qwen3-30b-a3b:16384",
                                                  "qwen3-235b-a22b:8192", "qwen3-235b-a22b:16384"])
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args()
    if args.mode == "report":
        return report(args.out)
    result = hashes() if args.mode == "hash" else times(args.cells, args.iters)
    with open(args.out, "w") as f:
        json.dump({"primemoe": primemoe.__file__, "result": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
