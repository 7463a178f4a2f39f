"""Where primemoe.Buffer's dispatch and combine spend their time, at EP = number of GPUs.

Per (shape, tokens), on every rank: the dispatch and combine region times taken exactly as the
benchmark takes them (primemoe.bench's runner and timing: L2 flush and rank alignment before each
region), and each GPU kernel's mean time over a few more such iterations (torch.profiler).

    python scripts/comm_profile.py [--shapes ...] [--tokens ...] [--num-sms 16] [--iters 20] [--out FILE]
"""
import argparse
import collections
import json
import os
import statistics
import sys
import types

import torch
import torch.distributed as dist

from primemoe import bench

PROFILED_ITERS = 5


def _kernels(runner, inp, group, flush):
    """{kernel name: (launches per iteration, mean ms)} over PROFILED_ITERS benchmark iterations."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench._time(runner, inp, types.SimpleNamespace(warmup=0, iters=PROFILED_ITERS), group, flush)
    times = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            times[ev.name].append(ev.device_time_total / 1e3)
    return {name: (len(v) // PROFILED_ITERS, statistics.mean(v)) for name, v in times.items()}


def _worker(rank, world, init_method, args, queue):
    os.environ.update(bench.MULTICAST_OFF)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    device = torch.device("cuda", rank)
    flush = torch.empty(bench.L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    out = {}
    try:
        for shape in args.shapes:
            ctx = bench._ShapeContext(args, group, shape, max(args.tokens))
            for tokens in args.tokens:
                inp = bench.make_inputs(shape, tokens, rank, world, device, seed=0)
                case = bench.CommCase(0, shape, tokens, world, "bf16", "primemoe", num_sms=args.num_sms)
                runner = case.spec().make(inp, group, case, ctx)
                dispatch, combine = bench._time(runner, inp, args, group, flush)
                remote = bench.remote_rows(inp.topk_idx, inp.w1.shape[0], rank)
                out[f"{shape}/{tokens}"] = {
                    "remote_mb": bench.direction_bytes(remote, bench.SHAPES[shape][0]) / 1e6,
                    "dispatch_ms": statistics.median(dispatch), "combine_ms": statistics.median(combine),
                    "kernels": _kernels(runner, inp, group, flush)}
                del runner, inp
            ctx.close()
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=bench.TARGET_SHAPES, choices=sorted(bench.SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--num-sms", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print("comm_profile: needs 2+ GPUs", file=sys.stderr)
        return 1
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").Queue()
    with bench.rendezvous() as init_method:
        procs = mp.start_processes(_worker, args=(world, init_method, args, queue), nprocs=world, join=False,
                                   start_method="spawn")
        items, failure = bench.join_ranks(procs, queue)
    results = dict(items)
    if len(results) < world:
        print(f"comm_profile: ranks {sorted(set(range(world)) - set(results))} gave no result: {failure or 'exited'}",
              file=sys.stderr)
        return 1
    for case in results[0]:
        print(f"== {case}: {results[0][case]['remote_mb']:.1f} MB per direction (rank 0)")
        for rank in sorted(results):
            r = results[rank][case]
            mb = r["remote_mb"]
            print(f"  rank {rank}: dispatch {r['dispatch_ms']:.3f} ms ({mb / r['dispatch_ms']:.0f} GB/s), "
                  f"combine {r['combine_ms']:.3f} ms ({mb / r['combine_ms']:.0f} GB/s)")
            # Mangled names of one file's kernels share their start: print their ends.
            for name, (per_iter, ms) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1]):
                print(f"      {ms:8.4f} ms x{per_iter}  {name[-70:]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
