"""primemoe.nn.MoE loads Qwen3-MoE block state dicts and computes route() + the reference."""

import types

import pytest
import torch
from torch import nn

import primemoe
from primemoe.nn import MoE

H, I, E, K = 32, 16, 6, 2


def qwen3_block_weights(seed=0):
    """gate [E, H], gate_proj / up_proj [E, I, H], down_proj [E, H, I] (nn.Linear layouts)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen) * shape[-1] ** -0.5  # noqa: E731
    return randn(E, H), randn(E, I, H), randn(E, I, H), randn(E, H, I)


def per_expert_state_dict(gate, gate_proj, up_proj, down_proj, prefix=""):
    sd = {f"{prefix}gate.weight": gate}
    for e in range(E):
        sd[f"{prefix}experts.{e}.gate_proj.weight"] = gate_proj[e]
        sd[f"{prefix}experts.{e}.up_proj.weight"] = up_proj[e]
        sd[f"{prefix}experts.{e}.down_proj.weight"] = down_proj[e]
    return sd


def fused_state_dict(gate, gate_proj, up_proj, down_proj, prefix=""):
    return {f"{prefix}gate.weight": gate,
            f"{prefix}experts.gate_up_proj": torch.cat([gate_proj, up_proj], dim=1),  # [E, 2I, H]
            f"{prefix}experts.down_proj": down_proj}  # [E, H, I]


def expected_output(hidden_states, gate, gate_proj, up_proj, down_proj, norm_topk_prob=True):
    x = hidden_states.reshape(-1, H)
    topk_idx, topk_weights = primemoe.route(x @ gate.t(), K, norm_topk_prob=norm_topk_prob)
    w1 = torch.cat([gate_proj, up_proj], dim=1)
    return primemoe.reference.moe(x, topk_idx, topk_weights, w1, down_proj).reshape(hidden_states.shape)


@pytest.mark.parametrize("layout", [per_expert_state_dict, fused_state_dict], ids=["per_expert", "fused"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_module_loads_qwen3_state_dict(layout, norm_topk_prob):
    weights = qwen3_block_weights()
    module = MoE(H, I, E, K, norm_topk_prob=norm_topk_prob, dtype=torch.float32)
    module.load_state_dict(layout(*weights))
    gate, gate_proj, up_proj, down_proj = weights
    assert torch.equal(module.w1, torch.cat([gate_proj, up_proj], dim=1))
    assert torch.equal(module.w2, down_proj)

    hidden_states = torch.randn(3, 5, H)
    y, logits = module(hidden_states, return_router_logits=True)
    assert y.shape == hidden_states.shape
    torch.testing.assert_close(logits, hidden_states.reshape(-1, H) @ gate.t())
    torch.testing.assert_close(y, expected_output(hidden_states, *weights, norm_topk_prob=norm_topk_prob))


@pytest.mark.parametrize("layout", [per_expert_state_dict, fused_state_dict], ids=["per_expert", "fused"])
def test_moe_module_loads_under_a_prefix(layout):
    """Inside a decoder layer the block's keys carry a prefix such as ``mlp.``."""
    weights = qwen3_block_weights(seed=1)
    layer = nn.Module()
    layer.mlp = MoE(H, I, E, K, dtype=torch.float32)
    layer.load_state_dict(layout(*weights, prefix="mlp."))
    hidden_states = torch.randn(7, H)
    torch.testing.assert_close(layer.mlp(hidden_states), expected_output(hidden_states, *weights))


def test_moe_module_trains():
    module = MoE(H, I, E, K, dtype=torch.float32)
    module(torch.randn(11, H)).square().sum().backward()
    for name, param in module.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name


def test_moe_module_round_trips_its_own_state_dict():
    module = MoE(H, I, E, K, dtype=torch.float32)
    copy = MoE(H, I, E, K, dtype=torch.float32)
    copy.load_state_dict(module.state_dict())
    hidden_states = torch.randn(4, H)
    assert torch.equal(copy(hidden_states), module(hidden_states))


def rank_buffer(rank, **changes):
    """The attributes MoE reads from a primemoe.Buffer: rank ``rank`` of 2, E/2 experts each."""
    fields = dict(rank=rank, world=2, local_experts=E // 2, hidden=H, intermediate=I, num_experts=E, top_k=K)
    return types.SimpleNamespace(**dict(fields, **changes))


@pytest.mark.parametrize("layout", [per_expert_state_dict, fused_state_dict], ids=["per_expert", "fused"])
@pytest.mark.parametrize("rank", [0, 1])
def test_moe_module_with_a_buffer_loads_its_experts_only(layout, rank):
    gate, gate_proj, up_proj, down_proj = qwen3_block_weights(seed=2)
    module = MoE(H, I, E, K, buffer=rank_buffer(rank), dtype=torch.float32)
    assert module.w1.shape == (E // 2, 2 * I, H) and module.w2.shape == (E // 2, H, I)
    module.load_state_dict(layout(gate, gate_proj, up_proj, down_proj))
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    assert torch.equal(module.gate.weight, gate)
    assert torch.equal(module.w1, torch.cat([gate_proj, up_proj], dim=1)[mine])
    assert torch.equal(module.w2, down_proj[mine])


def test_moe_module_rejects_a_buffer_made_for_another_layer():
    with pytest.raises(ValueError, match=r"buffer: made for \(hidden, intermediate, num_experts, top_k\)"):
        MoE(H, I, E, K, buffer=rank_buffer(0, hidden=2 * H))
