"""``primemoe.nn.MoE``: router + experts, a drop-in for the expert part of
Hugging Face's ``Qwen3MoeSparseMoeBlock`` (it loads that block's state dict)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .routing import route

__all__ = ["MoE"]


class MoE(nn.Module):
    """Router (``gate``: Linear(H, E, bias=False)) and E SwiGLU experts.

    Parameters: ``gate.weight [E, H]``, ``w1 [E, 2I, H]`` (gate_proj rows then
    up_proj rows), ``w2 [E, H, I]`` (down_proj). Loads both the per-expert Qwen3-MoE
    keys (``experts.{e}.gate_proj.weight`` ...) and the fused ones
    (``experts.gate_up_proj``, ``experts.down_proj``).
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, *, norm_topk_prob=True,
                 precision="bf16", buffer=None, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.precision = precision
        self.buffer = buffer
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, device=device, dtype=dtype))
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._convert_qwen3_keys)

    def reset_parameters(self):
        nn.init.normal_(self.w1, std=1 / math.sqrt(self.hidden))
        nn.init.normal_(self.w2, std=1 / math.sqrt(self.intermediate))

    def forward(self, hidden_states: torch.Tensor, *, return_router_logits: bool = False):
        from . import moe

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
            state_dict[prefix + "w1"] = state_dict.pop(fused_up)
            state_dict[prefix + "w2"] = state_dict.pop(fused_down)
            return
        per_expert = prefix + "experts.0.gate_proj.weight"
        if per_expert not in state_dict:
            return
        w1, w2 = [], []
        for e in range(self.num_experts):
            base = f"{prefix}experts.{e}."
            gate = state_dict.pop(base + "gate_proj.weight")
            up = state_dict.pop(base + "up_proj.weight")
            w1.append(torch.cat([gate, up], dim=0))
            w2.append(state_dict.pop(base + "down_proj.weight"))
        state_dict[prefix + "w1"] = torch.stack(w1)
        state_dict[prefix + "w2"] = torch.stack(w2)
