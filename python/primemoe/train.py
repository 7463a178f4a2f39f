"""Training demo: a small Qwen3-MoE model with every MoE block on primemoe, trained beside the
unmodified Hugging Face model, loss for loss.

    python -m primemoe.train                      # GPU: a small model, 50 steps; CPU: the tiny model
    python -m primemoe.train --tiny --steps 20    # the CPU-sized model, wherever it runs
    python -m primemoe.train --precision fp8      # primemoe's experts in blockwise FP8 (fp8_bwd: FP8 backward)

What it does:

1. Builds ``Qwen3MoeForCausalLM`` from a ``transformers`` ``Qwen3MoeConfig`` (a few decoder layers,
   each with a real ``Qwen3MoeSparseMoeBlock``), initialised from a fixed seed. This is the reference
   model ("hf").
2. Deep-copies it and swaps every ``Qwen3MoeSparseMoeBlock`` for ``primemoe.nn.MoE`` loaded with that
   block's state dict (router ``gate.weight`` and the experts' weights), so both models start from the
   same weights ("primemoe"). The block's forward is replaced whole: the router (fp32 softmax, top-k,
   renormalised when ``norm_topk_prob``, on the same router weights) runs in ``primemoe.route`` and
   the experts in ``primemoe.moe``. The swapped module returns what the HF block returns (the hidden
   states; ``(hidden states, router logits)`` for transformers versions whose block returns a pair).
3. Trains both with AdamW on the same batches of a synthetic token stream (a fixed-seed random stream
   with a learnable next-token rule: ``next = perm[prev]`` with probability ``1 - noise``, otherwise a
   uniform random token), so the loss falls from ``ln(vocab)`` towards the rule's entropy.
4. Reports the LM loss of both per step and their difference, the throughput (tokens/s) of each, and
   writes ``loss.png`` (matplotlib) and ``losses.json`` to ``--out``.

The router auxiliary (load-balancing) loss is disabled in both models (``config.output_router_logits
= False``), so the comparison is of the LM loss alone (primemoe.nn.MoE does not compute that loss).

Dtypes: on a GPU the parameters are bf16 (primemoe's kernels take bf16). On the CPU the default is
fp32 (``--dtype auto``): primemoe's CPU path is its pure-PyTorch reference, which computes in the
dtype of its inputs (fp32 or bf16), and fp32 makes the step-by-step comparison tight; ``--dtype bf16``
runs the CPU models in bf16. On the CPU the fused kernels are not exercised, and the demo says so.

``--precision fp8`` / ``fp8_bwd`` run primemoe's experts in blockwise FP8 (forward and backward, or the
backward only; DESIGN.md section 2): on an sm_90 GPU the FP8 kernels, on the CPU the FP8-emulating
reference (``primemoe.reference.moe_fp8``). The HF model keeps its unquantised experts, so the per-step
loss difference is FP8's against the unquantised model of the same dtype (bf16 on a GPU), also reported
relative to the loss (DeepSeek-V3 reports < 0.25% for FP8 training against bf16). Where primemoe cannot
run a precision (FP8 off sm_90, say) the demo says why and exits with status 2.

``transformers`` is needed here only (``pip install primemoe[train]`` or ``transformers``);
``import primemoe`` does not import it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

__all__ = ["main", "build_models", "synthetic_batches", "swap_moe_blocks"]

# Sizes when none is given: the tiny model (CPU-sized; multiples of 256 so that on a GPU the engine
# runs) and the small GPU model.
TINY = dict(layers=2, hidden=256, intermediate=256, experts=8, top_k=2, vocab=512, batch=4, seq=64, steps=20)
SMALL = dict(layers=4, hidden=1024, intermediate=512, experts=32, top_k=4, vocab=4096, batch=8, seq=512, steps=50)


# ---------------------------------------------------------------- data


def synthetic_batches(vocab: int, batch: int, seq: int, *, seed: int = 0, noise: float = 0.1, device="cpu"):
    """Endless ``[batch, seq]`` int64 batches of a fixed-seed stream with a next-token rule.

    A fixed random permutation ``perm`` of the vocabulary: each token is ``perm[previous]`` with
    probability ``1 - noise``, else uniform. The first token of a row is uniform. The best possible
    loss is about ``noise * ln(vocab) + H(noise)`` nats (1.0 at vocab 512, noise 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    while True:
        rows = torch.empty(batch, seq, dtype=torch.long)
        rows[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        random_tokens = torch.randint(vocab, (batch, seq), generator=gen)
        follow = torch.rand(batch, seq, generator=gen) >= noise
        for t in range(1, seq):
            rows[:, t] = torch.where(follow[:, t], perm[rows[:, t - 1]], random_tokens[:, t])
        yield rows.to(device)


# ---------------------------------------------------------------- models


def _qwen3_moe_block_class():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    return Qwen3MoeSparseMoeBlock


def make_config(*, layers, hidden, intermediate, experts, top_k, vocab, seq):
    from transformers import Qwen3MoeConfig

    head_dim = 64
    heads = max(1, hidden // head_dim)
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=max(seq, 128),
        output_router_logits=False,  # no auxiliary load-balancing loss: compare the LM loss alone
        router_aux_loss_coef=0.0, tie_word_embeddings=False, use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


def _moe_module_class():
    from .nn import MoE

    class Qwen3MoeBlockOnPrimemoe(MoE):
        """``primemoe.nn.MoE`` in the place of a ``Qwen3MoeSparseMoeBlock``: returns the hidden states
        (and the router logits where the HF block of this transformers version returns a pair)."""

        returns_router_logits = False

        def forward(self, hidden_states):
            y, logits = super().forward(hidden_states, return_router_logits=True)
            return (y, logits) if self.returns_router_logits else y

    return Qwen3MoeBlockOnPrimemoe


def swap_moe_blocks(model: nn.Module, config, *, precision: str = "bf16") -> int:
    """Replace every ``Qwen3MoeSparseMoeBlock`` of ``model`` by ``primemoe.nn.MoE`` with the same
    weights (in place); return how many were swapped."""
    block_class, moe_class = _qwen3_moe_block_class(), _moe_module_class()
    swapped = 0
    for name, block in list(model.named_modules()):
        if not isinstance(block, block_class):
            continue
        weight = next(block.parameters())
        new = moe_class(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                        config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob, precision=precision,
                        device=weight.device, dtype=weight.dtype)
        new.returns_router_logits = _block_returns_pair(block, config.hidden_size, weight)
        new.load_state_dict(block.state_dict())
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        swapped += 1
    return swapped


def _block_returns_pair(block, hidden, weight) -> bool:
    """Whether this transformers version's block returns ``(hidden, router_logits)`` (4.x) or the
    hidden states alone (5.x, which records the router logits with a hook instead)."""
    with torch.no_grad():
        out = block(torch.zeros(1, 1, hidden, device=weight.device, dtype=weight.dtype))
    return isinstance(out, tuple)


def build_models(config, *, device, dtype, precision="bf16", seed=0, compare=True):
    """``(primemoe model, hf model or None)``, both from the same seed-initialised weights."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)
    ours = copy.deepcopy(hf)
    if swap_moe_blocks(ours, config, precision=precision) != config.num_hidden_layers:
        raise RuntimeError("expected one Qwen3MoeSparseMoeBlock per decoder layer")
    hf.train()
    ours.train()
    return ours, (hf if compare else None)


# ---------------------------------------------------------------- training


def _load_tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class _Progress:
    """tqdm if installed, else one plain line per step (on stdout)."""

    def __init__(self, total: int):
        tqdm = _load_tqdm()
        self.bar = None if tqdm is None else tqdm(total=total, desc="train", unit="step", file=sys.stderr,
                                                  dynamic_ncols=True)
        self.total = total

    def update(self, step, **values):
        text = "  ".join(f"{k} {v}" for k, v in values.items())
        if self.bar is None:
            print(f"step {step}/{self.total}  {text}", flush=True)
        else:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _train_step(model, optimizer, tokens, device, main_grad_params=()):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    for param in main_grad_params:  # what a framework's optimizer takes from the fp32 main gradients
        param.grad = param.main_grad.to(param.dtype, copy=True)
        param.main_grad.zero_()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()  # syncs the device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - start


def _throughput(times, tokens_per_step):
    timed = times[1:] if len(times) > 1 else times  # the first step is warm-up
    return tokens_per_step * len(timed) / max(sum(timed), 1e-12)


def _plot(path: Path, ours, hf, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot written")
        return False
    steps = range(1, len(ours) + 1)
    rows = 2 if hf else 1
    fig, axes = plt.subplots(rows, 1, figsize=(7, 3.2 * rows), squeeze=False, sharex=True)
    axes[0][0].plot(steps, ours, label="primemoe.nn.MoE")
    if hf:
        axes[0][0].plot(steps, hf, "--", label="HF Qwen3MoeSparseMoeBlock")
        axes[1][0].plot(steps, [a - b for a, b in zip(ours, hf)], color="C2")
        axes[1][0].set_ylabel("loss difference")
        axes[1][0].axhline(0.0, color="grey", lw=0.5)
    axes[0][0].set_ylabel("LM loss")
    axes[0][0].set_title(title)
    axes[0][0].legend()
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m primemoe.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="training steps (tiny: 20, GPU: 50)")
    p.add_argument("--batch", type=int, help="sequences per step (tiny: 4, GPU: 8)")
    p.add_argument("--seq", type=int, help="tokens per sequence (tiny: 64, GPU: 512)")
    p.add_argument("--layers", type=int, help="decoder layers (tiny: 2, GPU: 4)")
    p.add_argument("--hidden", type=int, help="hidden size (tiny: 256, GPU: 1024)")
    p.add_argument("--intermediate", type=int, help="moe_intermediate_size (tiny: 256, GPU: 512)")
    p.add_argument("--experts", type=int, help="number of experts (tiny: 8, GPU: 32)")
    p.add_argument("--top-k", type=int, dest="top_k", help="experts per token (tiny: 2, GPU: 4)")
    p.add_argument("--vocab", type=int, help="vocabulary size (tiny: 512, GPU: 4096)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="parameter dtype (auto: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--precision", choices=("bf16", "fp8", "fp8_bwd"), default="bf16",
                   help="primemoe's precision mode (fp8: FP8 forward and backward; fp8_bwd: FP8 backward)")
    p.add_argument("--main-grad", action="store_true",
                   help="the experts' weight gradients accumulate into fp32 main_grad (gradient-accumulation "
                        "fusion, nn.MoE.attach_main_grads), which the optimizer step then takes")
    p.add_argument("--out", default="train_out", help="directory for loss.png and losses.json")
    p.add_argument("--tiny", action="store_true", help="the CPU-sized model (the default without a GPU)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="train the unmodified HF model side by side (default on)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("python -m primemoe.train needs transformers: pip install transformers (or primemoe[train])")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = args.tiny or device.type != "cuda"
    preset = TINY if tiny else SMALL
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in preset.items()}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)

    import primemoe  # noqa: F401  (registers the ops)
    from .layer import _engine_unsupported

    skipped = []
    if device.type != "cuda":
        skipped.append("no GPU: ran the tiny CPU model; the fused kernels were not exercised "
                       "(primemoe ran its pure-PyTorch CPU path)")
    else:
        why = _engine_unsupported(device.index if device.index is not None else torch.cuda.current_device(),
                                  sizes["hidden"], sizes["intermediate"])
        if why:
            skipped.append(f"the expert GEMM engine does not cover this shape ({why}): "
                           "primemoe's GEMMs ran on torch._grouped_mm")
    config = make_config(**{k: sizes[k] for k in ("layers", "hidden", "intermediate", "experts", "top_k",
                                                    "vocab", "seq")})
    ours, hf = build_models(config, device=device, dtype=dtype, precision=args.precision, seed=args.seed,
                            compare=args.compare)
    tokens_per_step = sizes["batch"] * sizes["seq"]
    print(f"primemoe.train: Qwen3-MoE, {sizes['layers']} layers, hidden {sizes['hidden']}, moe_intermediate "
          f"{sizes['intermediate']}, {sizes['experts']} experts, top-{sizes['top_k']}, vocab {sizes['vocab']}; "
          f"batch {sizes['batch']} x seq {sizes['seq']} = {tokens_per_step} tokens/step, {sizes['steps']} steps, "
          f"AdamW lr {args.lr:g}; {device}, {str(dtype).removeprefix('torch.')} parameters, "
          f"primemoe precision {args.precision}; router aux loss off (LM loss only)")
    for line in skipped:
        print(line)

    batches = synthetic_batches(sizes["vocab"], sizes["batch"], sizes["seq"], seed=args.seed + 1, device=device)
    main_grad_params = []
    if args.main_grad:
        for module in ours.modules():
            if isinstance(module, primemoe.nn.MoE):
                module.attach_main_grads()
                main_grad_params += [module.w1, module.w2]
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=args.lr)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=args.lr) if hf is not None else None
    losses_ours, losses_hf, times_ours, times_hf = [], [], [], []
    progress = _Progress(sizes["steps"])
    try:
        for step in range(1, sizes["steps"] + 1):
            tokens = next(batches)
            loss, seconds = _train_step(ours, opt_ours, tokens, device, main_grad_params)
            losses_ours.append(loss)
            times_ours.append(seconds)
            shown = {"loss": f"{loss:.4f}"}
            if hf is not None:
                loss_hf, seconds = _train_step(hf, opt_hf, tokens, device)
                losses_hf.append(loss_hf)
                times_hf.append(seconds)
                shown["hf"] = f"{loss_hf:.4f}"
                shown["diff"] = f"{loss - loss_hf:+.2e}"
            progress.update(step, **shown)
    except NotImplementedError as err:
        progress.close()
        print(f"primemoe cannot run precision {args.precision!r} here: {err}")
        print("(run with --precision bf16)")
        return 2
    progress.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    diffs = [a - b for a, b in zip(losses_ours, losses_hf)]
    tput_ours = _throughput(times_ours, tokens_per_step)
    print(f"loss: step 1 {losses_ours[0]:.4f} -> step {len(losses_ours)} {losses_ours[-1]:.4f} (primemoe)")
    print(f"throughput: primemoe {tput_ours:,.0f} tokens/s", end="")
    result = dict(device=str(device), dtype=str(dtype), precision=args.precision, sizes=sizes, lr=args.lr,
                  seed=args.seed, skipped=skipped, main_grad=args.main_grad, loss_primemoe=losses_ours,
                  tokens_per_s_primemoe=tput_ours)
    if hf is not None:
        tput_hf = _throughput(times_hf, tokens_per_step)
        print(f", HF {tput_hf:,.0f} tokens/s ({tput_ours / tput_hf:.2f}x)")
        first = min(len(diffs), 50)
        worst = max(range(first), key=lambda i: abs(diffs[i]))
        print(f"loss parity vs the unmodified HF model: max |diff| {abs(diffs[worst]):.3e} over steps 1-{first} "
              f"(step {worst + 1}); final |diff| {abs(diffs[-1]):.3e}")
        print("per-step diff (primemoe - HF): " + " ".join(f"{d:+.1e}" for d in diffs[:first]))
        relative = [abs(d) / abs(b) for d, b in zip(diffs, losses_hf) if b]
        result.update(loss_hf=losses_hf, loss_diff=diffs, tokens_per_s_hf=tput_hf,
                      max_relative_loss_diff=max(relative, default=0.0))
        if args.precision != "bf16":
            base = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
            print(f"{args.precision} vs the unquantised {base} HF model: relative loss difference max "
                  f"{max(relative, default=0.0):.3%}, final {relative[-1] if relative else 0.0:.3%} "
                  "(DeepSeek-V3 reports < 0.25% for FP8 training)")
    else:
        print()
    (out / "losses.json").write_text(json.dumps(result, indent=1))
    title = (f"Qwen3-MoE {sizes['layers']}L H{sizes['hidden']} E{sizes['experts']} top-{sizes['top_k']}, "
             f"{device.type} {str(dtype).removeprefix('torch.')}")
    if _plot(out / "loss.png", losses_ours, losses_hf, title):
        print(f"wrote {out / 'loss.png'} and {out / 'losses.json'}")
    if not all(math.isfinite(v) for v in losses_ours):
        print("the loss is not finite")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
