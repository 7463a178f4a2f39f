"""The single-GPU layer's inputs for the diagnostic scripts, so that they all time the same tensors: from one
seeded CUDA generator, in this order, x, the router logits (top-k routing), w1, w2 and dy."""
import argparse
import json

import torch

from primemoe import route
from primemoe.bench import SHAPES


def layer_inputs(shape, tokens, seed=0):
    """``(x, topk_idx, topk_weights, w1, w2, dy)`` of ``shape`` (a key of primemoe.bench.SHAPES) at ``tokens``."""
    H, I, E, K = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    idx, w = route(torch.randn(tokens, E, device="cuda", generator=gen), K)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).bfloat16()
    dy = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    return x, idx, w, w1, w2, dy


def add_shapes_argument(parser):
    """``--shapes shape:tokens ...`` (shape a key of primemoe.bench.SHAPES), the diagnostic scripts' common option;
    parsed into ``(shape, tokens)`` pairs."""
    parser.add_argument("--shapes", nargs="+", type=_shape_tokens,
                        default=[("qwen3-235b-a22b", 8192), ("qwen3-30b-a3b", 16384)], help="shape:tokens ...")


def add_timing_arguments(parser, secs):
    """The timing scripts' common options: --shapes, --rounds, --secs (per timed phase), --out (a JSON file)."""
    add_shapes_argument(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--secs", type=float, default=secs)
    parser.add_argument("--out")


def time_shapes(args, time_one, key, **extra):
    """``time_one(shape, tokens, results)`` for each of ``args.shapes``; then ``results``, under ``key`` beside the
    device's name and ``extra``, into ``args.out`` (if given)."""
    results = {}
    for shape, T in args.shapes:
        time_one(shape, T, results)
        torch.cuda.empty_cache()
    if args.out:
        json.dump({"device": torch.cuda.get_device_name(), **extra, key: results}, open(args.out, "w"), indent=1)


def _shape_tokens(spec):
    shape, _, tokens = spec.partition(":")
    if shape not in SHAPES or not tokens.isdigit():
        raise argparse.ArgumentTypeError(f"expected shape:tokens with a shape of {sorted(SHAPES)}, got {spec!r}")
    return shape, int(tokens)
