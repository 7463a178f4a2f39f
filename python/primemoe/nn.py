"""``primemoe.nn.MoE``: router + experts, a drop-in for the expert part of
Hugging Face's ``Qwen3MoeSparseMoeBlock`` (it loads that block's state dict)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validate import check_precision
from .layer import moe
from .routing import route

__all__ = ["MoE"]


class MoE(nn.Module):
    """Router (``gate``: Linear(H, E, bias=False)) and E SwiGLU experts.

    Parameters: ``gate.weight [E, H]``, ``w1 [E, 2I, H]`` (gate_proj rows then
    up_proj rows), ``w2 [E, H, I]`` (down_proj). Loads both the per-expert Qwen3-MoE
    keys (``experts.{e}.gate_proj.weight`` ...) and the fused ones
    (``experts.gate_up_proj``, ``experts.down_proj``).

    With a ``primemoe.Buffer`` (expert parallelism), ``w1`` / ``w2`` hold only this rank's
    ``buffer.local_experts`` experts, and a Qwen3 state dict loads just their slice.

    ``attach_main_grads()``: fp32 main gradients for ``w1`` / ``w2`` that every backward adds into.

    ``precision``: passed to ``primemoe.moe`` ("fp8" / "fp8_bwd": blockwise FP8, H and I multiples of 128,
    an sm_90 GPU or the CPU's reference; the router stays in the module's dtype).
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, *, norm_topk_prob=True,
                 precision="bf16", buffer=None, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.precision = check_precision(precision)  # "bf16", "fp8" or "fp8_bwd" (DESIGN.md section 2)
        self.buffer = buffer
        if buffer is not None:
            made_for = (buffer.hidden, buffer.intermediate, buffer.num_experts, buffer.top_k)
            if made_for != (hidden, intermediate, num_experts, top_k):
                raise ValueError(f"buffer: made for (hidden, intermediate, num_experts, top_k) = {made_for}, "
                                 f"but this module has {(hidden, intermediate, num_experts, top_k)}")
        local = num_experts if buffer is None else buffer.local_experts
        first = 0 if buffer is None else buffer.rank * local
        self.expert_range = slice(first, first + local)  # global ids of the experts held here
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(local, 2 * intermediate, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(local, hidden, intermediate, device=device, dtype=dtype))
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._convert_qwen3_keys)

    def attach_main_grads(self) -> None:
        """Gradient-accumulation fusion (Megatron's ``param.main_grad``): fp32 zeros as ``w1.main_grad`` and
        ``w2.main_grad``, on the weights' device (call it after moving the module). Every backward then adds the
        experts' weight gradients into them, in fp32 inside the weight-gradient GEMMs, and leaves ``w1.grad`` /
        ``w2.grad`` None; zero them after each optimizer step. The router's gradient stays ``gate.weight.grad``."""
        for w in (self.w1, self.w2):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def reset_parameters(self):
        nn.init.normal_(self.w1, std=1 / math.sqrt(self.hidden))
        nn.init.normal_(self.w2, std=1 / math.sqrt(self.intermediate))

    def forward(self, hidden_states: torch.Tensor, *, return_router_logits: bool = False):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden)
        logits = self.gate(x)
        topk_idx, topk_weights = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob)
        y = moe(x.contiguous(), topk_idx, topk_weights, self.w1, self.w2,
                buffer=self.buffer, precision=self.precision).reshape(shape)
        return (y, logits) if return_router_logits else y

    def _convert_qwen3_keys(self, state_dict, prefix, *args, **kwargs):
        fused_up, fused_down = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
        if fused_up in state_dict:
            state_dict[prefix + "w1"] = state_dict.pop(fused_up)[self.expert_range]
            state_dict[prefix + "w2"] = state_dict.pop(fused_down)[self.expert_range]
            return
        per_expert = prefix + "experts.0.gate_proj.weight"
        if per_expert not in state_dict:
            return
        w1, w2 = [], []
        for e in range(self.num_experts):  # every expert's keys leave the dict; this rank keeps its own
            base = f"{prefix}experts.{e}."
            gate = state_dict.pop(base + "gate_proj.weight")
            up = state_dict.pop(base + "up_proj.weight")
            down = state_dict.pop(base + "down_proj.weight")
            if self.expert_range.start <= e < self.expert_range.stop:
                w1.append(torch.cat([gate, up], dim=0))
                w2.append(down)
        state_dict[prefix + "w1"] = torch.stack(w1)
        state_dict[prefix + "w2"] = torch.stack(w2)
