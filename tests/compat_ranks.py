"""Rank side of tests/gpu/test_deep_gemm_compat_gpu.py: ``prime_mega_moe`` (primemoe.deep_gemm_compat) in spawned
processes, driven as prime-rl's Mega MoE dispatcher drives its DeepGEMM fork, beside ``primemoe.moe(...,
buffer=)`` on the Buffer under the compat buffer and the same inputs. Placement and process group: buffer_ranks.ep_rank."""

from __future__ import annotations

import os
from functools import partial

import torch
import torch.distributed as dist

from buffer_ranks import ep_rank
from ep_harness import rank_problem
from helpers import Outputs, Problem, run_moe

import primemoe
from primemoe.buffer import DEFAULT_NUM_SMS


def _cpu(outputs: Outputs) -> dict:
    return {name: value.cpu() for name, value in vars(outputs).items()}


def _load(buf, p: Problem) -> None:
    """prime-rl's ``_stage_inputs`` / ``load``: this call's tokens and routing into the buffer's first T rows."""
    T = p.x.shape[0]
    buf.x[:T].copy_(p.x)
    buf.topk_idx[:T].copy_(p.topk_idx.view(T, buf.num_topk))
    buf.topk_weights[:T].copy_(p.topk_weights.float().view(T, buf.num_topk))


def _poisoned(shape, dtype, device):
    """prime-rl's torch.empty outputs, NaN-filled: an element the kernels leave unwritten shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def prime_rl_forward(kernels, buf, p: Problem, stats=None) -> torch.Tensor:
    T, H = p.x.shape
    _load(buf, p)
    y = _poisoned((T, H), torch.bfloat16, p.x.device)
    kernels.bf16_mega_moe(y, p.w1, p.w2, buf, cumulative_local_expert_recv_stats=stats, activation_clamp=None)
    return y


def prime_rl_backward(kernels, buf, p: Problem, dw_dtype=torch.bfloat16):
    T, H = p.x.shape
    _load(buf, p)  # the backward reloads the forward's inputs (another layer may have used the buffer since)
    device = p.x.device
    dx = _poisoned((T, H), torch.bfloat16, device)
    dw1, dw2 = _poisoned(p.w1.shape, dw_dtype, device), _poisoned(p.w2.shape, dw_dtype, device)
    dtopk = _poisoned((T, buf.num_topk), torch.float32, device)
    kernels.bf16_mega_moe_backward(dx, dw1, dw2, dtopk, p.dy.bfloat16().contiguous(), p.w1, p.w2, buf,
                                   activation_clamp=None)
    return dx, dw1, dw2, dtopk


def prime_rl_step(kernels, buf, p: Problem, dw_dtype=torch.bfloat16, stats=None) -> Outputs:
    y = prime_rl_forward(kernels, buf, p, stats)
    dx, dw1, dw2, dtopk = prime_rl_backward(kernels, buf, p, dw_dtype)
    return Outputs(y, dx, dtopk, dw1, dw2)


def compat_cases(rank, world, cases_path, out_dir):
    """Every case through the compat layer (bf16 and fp32 dw, with recv stats) and through moe(buffer=) on the
    Buffer under it; then two layers sharing the buffer (forwards A, B; backwards B, A)."""
    import prime_mega_moe as kernels

    data = torch.load(cases_path)
    sizes = data["sizes"]
    with ep_rank(rank, world) as device:
        def mine(case):
            return rank_problem(Problem(**case["problem"]), rank, case["tokens_per_rank"], device)

        # prime-rl: reserve SMs for other communication before the buffer is made.
        total = torch.cuda.get_device_properties(device).multi_processor_count
        kernels.set_num_sms(max(total - 16, 1))
        assert kernels.get_num_sms() == max(total - 16, 1)
        buf = kernels.get_symm_buffer_for_mega_moe(dist.group.WORLD, sizes["num_experts"],
                                                   sizes["max_tokens_per_rank"], sizes["top_k"], sizes["hidden"],
                                                   sizes["intermediate"], mma_type="bf16xbf16")
        results = {}
        try:
            assert isinstance(buf.buffer, primemoe.Buffer) and buf.buffer.world == world
            assert buf.buffer.num_sms == min(DEFAULT_NUM_SMS, kernels.get_num_sms())
            assert buf.x.device == device and buf.x_sf is None
            for name, case in data["cases"].items():
                p = mine(case)
                stats = torch.zeros(buf.buffer.local_experts, dtype=torch.int32, device=device)
                compat = prime_rl_step(kernels, buf, p, stats=stats)
                wide = prime_rl_step(kernels, buf, p, dw_dtype=torch.float32)
                via_moe = run_moe(partial(primemoe.moe, buffer=buf.buffer, keep_fc1=False), p)
                results[name] = dict(compat=_cpu(compat), wide=_cpu(wide), moe=_cpu(via_moe), stats=stats.cpu())
            if data.get("layered") is not None:
                first, second = (mine(data["cases"][n]) for n in data["layered"])
                ya = prime_rl_forward(kernels, buf, first)
                yb = prime_rl_forward(kernels, buf, second)
                gb = prime_rl_backward(kernels, buf, second)
                ga = prime_rl_backward(kernels, buf, first)
                results["layered"] = [_cpu(Outputs(y, g[0], g[3], g[1], g[2])) for y, g in ((ya, ga), (yb, gb))]
            primemoe.check_errors()
        finally:
            buf.destroy()  # collective: every rank reaches it
        assert buf.buffer is None
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
