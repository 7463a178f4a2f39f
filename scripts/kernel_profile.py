"""Where the single-GPU layer's time goes, kernel by kernel, back to back as the benchmark runs it (power-capped
on the H200): torch.profiler over --iters forward and backward calls after a second of warm-up, per kernel the
mean µs per call and its share of the pass. Usage: python scripts/kernel_profile.py [--shapes ...] [--out f.json]"""
import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from layer_inputs import add_shapes_argument, layer_inputs

lib = torch.ops.primemoe


def short(name):
    """Long (mangled) names keep their ends: the kernel's own name is at the end of a static kernel's."""
    name = name.split("(")[0]
    return name if len(name) < 90 else name[:40] + "..." + name[-47:]


def kernel_times(fn, iters):
    end = time.time() + 1.0
    while time.time() < end:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[short(e.name)] += e.device_time_total / iters
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def profile_shape(shape, T, iters, out):
    x, idx, w, w1, w2, dy = layer_inputs(shape, T)
    _, h = lib.moe_forward(x, idx, w, w1, w2, "bf16", True)
    passes = {
        "forward": lambda: lib.moe_forward(x, idx, w, w1, w2, "bf16", True),
        "backward": lambda: lib.moe_backward(dy, x, idx, w, w1, w2, h, "bf16"),
    }
    for name, fn in passes.items():
        per = kernel_times(fn, iters)
        total = sum(per.values())
        out[f"{shape}/{T} {name}"] = {"total_us": round(total, 1),
                                      "kernels_us": {k: round(v, 1) for k, v in per.items()}}
        print(f"== {shape} T={T} {name}: {total:.1f} µs of kernels per call")
        for k, v in per.items():
            print(f"  {v:9.1f} µs {100 * v / total:5.1f}%  {k}")


def main():
    p = argparse.ArgumentParser()
    add_shapes_argument(p)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args()
    out = {}
    for shape, T in a.shapes:
        profile_shape(shape, T, a.iters, out)
        torch.cuda.empty_cache()
    if a.out:
        json.dump({"device": torch.cuda.get_device_name(), "passes": out}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
