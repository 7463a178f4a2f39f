"""EXPERIMENT (temporary, with GemmParams::trace): per-tile timelines of FC1 and FC2, read from every CTA's consumer
warpgroup 0 and producer, on the benchmark's row layout (U) and on every expert at exactly T*K/E rows (F), FC1
paired and not. Per kind of tile (full / half; paired: sharing the weight tile or apart, and mixed where the pair's
other block differs in length): count and mean us of the tile, split into the wait for its first stage, the
mainloop and the epilogue, beside the mainloop's waits for filled stages (consumers starved) and the producer's
waits for empty ones (ring full); and the claimed order's claims: how long the producer's atomic takes, and how much
of it comes after the consumers finished the previous tile (the consumers' wait for a tile); and how much of that
wait is the walk from the tile's index to its rows (TileWalker::at). The launch is traced after 30 untraced ones back to back.
Usage (on the GPU machine, from scripts/): python tile_trace.py [--out f.json]"""
import argparse
import json
import os
from collections import defaultdict

import torch

from layer_inputs import layer_inputs
from primemoe import ops
from primemoe.bench import SHAPES

lib = torch.ops.primemoe
TILES, VALUES = 256, 10  # kTraceTiles, kTraceValues


def row_blocks(offsets):
    """Per 128-row block: (rows, the expert's first block, the expert's block count)."""
    res = []
    o = offsets.tolist()
    for e in range(len(o) - 1):
        rows = o[e + 1] - o[e]
        nb = (rows + 127) // 128
        first = len(res)
        res += [(min(128, rows - 128 * b), first, nb) for b in range(nb)]
    return res


def traced(fn):
    for _ in range(30):
        fn()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.zeros(sms * TILES * VALUES, dtype=torch.int64, device="cuda")
    os.environ["PRIMEMOE_GEMM_TRACE"] = str(trace.data_ptr())
    fn()
    del os.environ["PRIMEMOE_GEMM_TRACE"]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    return trace.view(sms, TILES, VALUES).cpu().tolist()


def summarise(label, tr, n_tiles, offsets, paired):
    blocks = row_blocks(offsets)
    sms = len(tr)
    start = min(r[1] for cta in tr for r in cta if r[1])
    end = max(r[4] for cta in tr for r in cta if r[4])
    kinds = defaultdict(lambda: [0] * 7)
    waiting = walking = tail = claiming = claimed_late = 0.0
    claims = 0
    for cta, recs in enumerate(tr):
        prev_end = last = None
        for t, take, first, main, done, starved, empty, claim_from, claim_to, index in (r for r in recs if r[1]):
            walking += take - index
            if claim_from:
                claims += 1
                claiming += claim_to - claim_from
                if prev_end is not None:
                    claimed_late += max(0, claim_to - prev_end)
            block = t // n_tiles
            if block >= len(blocks):
                kind = "past the routed rows"
            else:
                rows, fb, nb = blocks[block]
                kind = "half" if rows <= 64 else "full"
                if paired:
                    shared = block + 1 < fb + nb if cta % 2 == 0 else block > fb
                    other = blocks[block ^ 1][0] if (block ^ 1) < len(blocks) else 0
                    kind += ("/shared" if shared else "/apart") + ("" if (other <= 64) == (rows <= 64) else "/mixed")
            k = kinds[kind]
            for i, v in enumerate((1, done - take, (first - take) if first else 0, (main - first) if first else 0,
                                   done - main, starved, empty)):
                k[i] += v
            if prev_end is not None:
                waiting += take - prev_end
            prev_end = last = done
        if last is not None:
            tail += end - last
    print(f"{label}: {(end - start) / 1e3:.1f} us; per CTA {waiting / sms / 1e3:.1f} us waiting for a tile, "
          f"{tail / sms / 1e3:.1f} us done before the last CTA; of the wait, {walking / sms / 1e3:.1f} us in the walk "
          f"(TileWalker::at)", flush=True)
    if claims:
        print(f"   claims: {claiming / claims / 1e3:.2f} us each; per CTA {claimed_late / sms / 1e3:.1f} us of claims "
              f"returning after the consumers had finished the tile before", flush=True)
    for kind in sorted(kinds):
        n, d, w, m, ep, st, em = kinds[kind]
        print(f"   {kind:22s} {n:5d} tiles, us: {d / n / 1e3:6.2f} = first stage {w / n / 1e3:5.2f} + mainloop "
              f"{m / n / 1e3:6.2f} (starved {st / n / 1e3:5.2f}) + epilogue {ep / n / 1e3:5.2f}; producer waited "
              f"for empty stages {em / n / 1e3:6.2f}", flush=True)
    return {"span_us": (end - start) / 1e3, "kinds": dict(kinds)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["qwen3-235b-a22b:8192", "qwen3-30b-a3b:16384"])
    p.add_argument("--out")
    a = p.parse_args()
    out = {}
    for spec in a.shapes:
        shape, tokens = spec.split(":")
        T = int(tokens)
        H, I, E, K = SHAPES[shape]
        x, idx, w, w1, w2, _ = layer_inputs(shape, T)
        _, offsets, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, ops.ROW_ALIGN)
        xs = lib.gather_rows(x, r2s, K, None, s2r)
        act = lib.fc1_swiglu(xs, w1, offsets, True)[0]
        rw = ops.row_weights(w, r2s)
        even = torch.tensor([0] + [T * K // E] * E).cumsum(0).to(torch.int32).cuda()
        n = int(even[-1])
        for name, o, rows, a_act, a_rw in (("U", offsets, xs, act, rw), ("F", even, xs[:n], act[:n], rw[:n])):
            for pairs in ("", "0"):  # FC1 is paired by default
                os.environ["PRIMEMOE_GEMM_PAIRS"] = pairs
                label = f"{shape}/{T} {name} fc1 {'paired' if not pairs else 'unpaired'}"
                tr = traced(lambda: lib.fc1_swiglu(rows, w1, o, True))  # noqa: B023
                out[label] = summarise(label, tr, I // 128, o.cpu(), not pairs)
            os.environ.pop("PRIMEMOE_GEMM_PAIRS")
            label = f"{shape}/{T} {name} fc2 unpaired"
            tr = traced(lambda: lib.expert_gemm(a_act, w2, o, False, a_rw))  # noqa: B023
            out[label] = summarise(label, tr, H // 256, o.cpu(), False)
        torch.cuda.empty_cache()
    if a.out:
        json.dump({"device": torch.cuda.get_device_name(), "results": out}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
