"""primemoe.deep_gemm_compat (``prime_mega_moe``) on the CPU, driven exactly as prime-rl's Mega MoE dispatcher
drives its DeepGEMM fork: one buffer from ``get_symm_buffer_for_mega_moe`` (positional sizes, ``mma_type=``),
inputs copied into ``x[:T]`` / ``topk_idx[:T]`` / ``topk_weights[:T]`` before every call, ``y`` from
``torch.empty((T, H))``, the backward's outputs caller-allocated (``dw`` bf16 or fp32) with the inputs
reloaded. The primemoe.Buffer under it is test_ep_cpu's ``ModelBuffer`` (a Python model of the dispatch /
combine contract, ranks as threads), at W = 1, 2 and 4; the outputs are checked against the fp64 reference
(``primemoe.reference.moe``, the tolerance rule of DESIGN.md section 6) and bitwise against
``moe(..., buffer=)`` over the same model."""

import inspect
from functools import partial

import pytest
import torch

from ep_harness import expert_slices, rank_problem
from helpers import (OUTPUT_NAMES, ROUTINGS, Outputs, assert_moe_outputs_match, make_problem, reference64, run_moe,
                     run_python)
from naive import composite
from test_ep_cpu import SHAPE, ModelBuffer, World

import primemoe
from primemoe import deep_gemm_compat as dgc
from primemoe import layer
from primemoe.buffer import DEFAULT_NUM_SMS

H, I, E, K = SHAPE


class FakeGroup:
    """What the tests pass as ``group``: the model's World and this thread's rank."""

    def __init__(self, world: World, rank: int):
        self.world, self.rank = world, rank


class CompatModelBuffer(ModelBuffer):
    """ModelBuffer with what the compat layer also uses: ``num_sms`` and a collective-looking ``close()``."""

    def __init__(self, world, rank, *, num_sms, row_align=1, **sizes):
        super().__init__(world, rank, row_align=row_align, **sizes)
        self.num_sms = num_sms
        self.closed = False
        self.close_calls = 0

    def close(self):
        self.close_calls += 1
        self.closed = True


@pytest.fixture
def model_buffers(monkeypatch):
    """get_symm_buffer_for_mega_moe builds a CompatModelBuffer over the FakeGroup; yields the ones it made."""
    made = []

    def new_buffer(group, **sizes):
        buffer = CompatModelBuffer(group.world, group.rank, **sizes)
        made.append(buffer)
        return buffer

    monkeypatch.setattr(dgc, "_new_buffer", new_buffer)
    monkeypatch.setattr(dgc, "_num_sms", None)
    return made


def run_world(tokens_per_rank, fn):
    """``fn(rank, group)`` on one thread per rank; returns the ranks' results."""
    world = World(len(tokens_per_rank))
    return world.run(lambda rank: fn(rank, FakeGroup(world, rank)))


# ---------------------------------------------------------------- prime-rl's side, as it calls the fork


class PrimeRlMegaMoe:
    """prime-rl's Mega MoE helpers (trainer/models/layers/mega_moe.py and the dispatchers calling them): the
    same calls, argument order, dtypes and shapes."""

    def __init__(self, group, max_tokens_per_rank, kernels=dgc):
        self.kernels = kernels
        self.buffer = kernels.get_symm_buffer_for_mega_moe(group, E, max_tokens_per_rank, K, H, I,
                                                           mma_type="bf16xbf16")

    def load(self, x, topk_idx, topk_weights):
        num_tokens = x.shape[0]
        self.buffer.x[:num_tokens].copy_(x)
        self.buffer.topk_idx[:num_tokens].copy_(topk_idx.view(num_tokens, self.buffer.num_topk))
        self.buffer.topk_weights[:num_tokens].copy_(topk_weights.view(num_tokens, self.buffer.num_topk))

    def forward(self, x, topk_idx, topk_weights, l1, l2, stats=None):
        num_tokens, hidden = x.shape
        self.load(x, topk_idx, topk_weights)
        y = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16)  # torch.empty, made hostile
        self.kernels.bf16_mega_moe(y, l1, l2, self.buffer, cumulative_local_expert_recv_stats=stats,
                                   activation_clamp=None)
        return y

    def backward(self, dy, x, topk_idx, topk_weights, l1, l2, dw_dtype=torch.bfloat16):
        num_tokens, hidden = x.shape
        self.load(x, topk_idx, topk_weights)

        def empty(shape, dtype):
            return torch.full(shape, float("nan"), dtype=dtype)

        dx = empty((num_tokens, hidden), torch.bfloat16)
        dw1, dw2 = empty(l1.shape, dw_dtype), empty(l2.shape, dw_dtype)
        dtopk = empty((num_tokens, self.buffer.num_topk), torch.float32)
        self.kernels.bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy.to(torch.bfloat16).contiguous(), l1, l2,
                                            self.buffer, activation_clamp=None)
        return dx, dw1, dw2, dtopk


def rank_outputs(mega, p, dw_dtype=torch.bfloat16) -> Outputs:
    """Forward then backward of one rank's problem ``p`` through the compat layer."""
    y = mega.forward(p.x, p.topk_idx, p.topk_weights.float(), p.w1, p.w2)
    dx, dw1, dw2, dtopk = mega.backward(p.dy, p.x, p.topk_idx, p.topk_weights.float(), p.w1, p.w2, dw_dtype)
    return Outputs(y, dx, dtopk, dw1, dw2)


def stitch(per_rank) -> Outputs:
    """Tokens in rank order, experts in rank order: the layout of the single-process problem."""
    return Outputs(**{name: torch.cat([getattr(o, name) for o in per_rank]) for name in OUTPUT_NAMES})


def moe_buffer_outputs(buffer, p) -> Outputs:
    """The same rank problem through primemoe's own buffer= path (recomputing FC1, as the compat layer does)."""
    return run_moe(partial(layer.ep_moe, buffer=buffer, keep_fc1=False), p)


def assert_outputs_equal(a: Outputs, b: Outputs, what):
    for name in OUTPUT_NAMES:
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name}: {what}"


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens_per_rank", [(37,), (37, 5), (0, 16), (9, 0, 13, 4)])
def test_prime_rl_flow_matches_reference(model_buffers, tokens_per_rank, routing):
    problem = make_problem(sum(tokens_per_rank), *SHAPE, routing=routing, seed=sum(tokens_per_rank) + 1)
    max_tokens = max(tokens_per_rank) + 3

    def rank_main(rank, group):
        mega = PrimeRlMegaMoe(group, max_tokens)
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        out = rank_outputs(mega, mine)
        return out, moe_buffer_outputs(mega.buffer.buffer, mine)

    results = run_world(tokens_per_rank, rank_main)
    for rank, (out, via_moe) in enumerate(results):
        assert_outputs_equal(out, via_moe, f"rank {rank}: compat layer vs moe(buffer=) on the same Buffer")
    assert_moe_outputs_match(stitch([out for out, _ in results]), reference64(problem), composite(problem), problem)


def test_against_reference_moe_backward(model_buffers):
    """One rank, straight against primemoe.reference.moe / moe_backward in fp64."""
    p = make_problem(29, *SHAPE, routing="masked", seed=11)
    mega = run_world((29,), lambda rank, group: PrimeRlMegaMoe(group, 32))[0]
    # The ModelBuffer's world was a one-rank World: reusable from this thread.
    out = rank_outputs(mega, p)
    d = [t.double() for t in (p.x, p.topk_weights, p.w1, p.w2)]
    y64 = primemoe.reference.moe(d[0], p.topk_idx, d[1], d[2], d[3])
    dx64, dtw64, dw1_64, dw2_64 = primemoe.reference.moe_backward(p.dy.double(), d[0], p.topk_idx, d[1], d[2], d[3])
    for name, got, want in (("y", out.y, y64), ("dx", out.dx, dx64), ("dtw", out.dtw, dtw64),
                            ("dw1", out.dw1, dw1_64), ("dw2", out.dw2, dw2_64)):
        err = torch.linalg.vector_norm(got.double() - want.double()) / torch.linalg.vector_norm(want.double())
        assert err < 2e-2, f"{name}: relative error {err:.3e} against reference.moe / moe_backward"


def test_two_layers_share_one_buffer(model_buffers):
    """prime-rl keeps one buffer per shape for every layer: forwards of layer A then B (more tokens: stale rows
    of A's past its T in the buffer), backwards of B then A, each reloading its own inputs."""
    tokens_per_rank = (20, 11)
    a = make_problem(sum(tokens_per_rank), *SHAPE, routing="masked", seed=21)
    b_tokens = (30, 17)
    b = make_problem(sum(b_tokens), *SHAPE, routing="uniform", seed=22)

    def rank_main(rank, group):
        mega = PrimeRlMegaMoe(group, 32)
        pa = rank_problem(a, rank, tokens_per_rank, "cpu")
        pb = rank_problem(b, rank, b_tokens, "cpu")
        ya = mega.forward(pa.x, pa.topk_idx, pa.topk_weights, pa.w1, pa.w2)
        yb = mega.forward(pb.x, pb.topk_idx, pb.topk_weights, pb.w1, pb.w2)
        gb = mega.backward(pb.dy, pb.x, pb.topk_idx, pb.topk_weights, pb.w1, pb.w2)
        ga = mega.backward(pa.dy, pa.x, pa.topk_idx, pa.topk_weights, pa.w1, pa.w2)
        (dxa, dw1a, dw2a, dtwa), (dxb, dw1b, dw2b, dtwb) = ga, gb
        return Outputs(ya, dxa, dtwa, dw1a, dw2a), Outputs(yb, dxb, dtwb, dw1b, dw2b)

    results = run_world(tokens_per_rank, rank_main)
    for index, problem in enumerate((a, b)):
        out = stitch([r[index] for r in results])
        assert_moe_outputs_match(out, reference64(problem), composite(problem), problem)


def test_fp32_weight_gradients_are_the_bf16_ones_widened(model_buffers):
    tokens_per_rank = (25, 14)
    problem = make_problem(sum(tokens_per_rank), *SHAPE, routing="masked", seed=31)

    def rank_main(rank, group):
        mega = PrimeRlMegaMoe(group, 25)
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        return rank_outputs(mega, mine, torch.float32), rank_outputs(mega, mine, torch.bfloat16)

    for wide, narrow in run_world(tokens_per_rank, rank_main):
        assert wide.dw1.dtype == wide.dw2.dtype == torch.float32
        assert torch.equal(wide.dw1, narrow.dw1.float()) and torch.equal(wide.dw2, narrow.dw2.float())
        for name in ("y", "dx", "dtw"):
            assert torch.equal(getattr(wide, name), getattr(narrow, name)), name


@pytest.mark.parametrize("stats_dtype", [torch.int32, torch.int64])
def test_recv_stats_accumulate_rows_per_local_expert(model_buffers, stats_dtype):
    tokens_per_rank = (23, 9)
    world = len(tokens_per_rank)
    problem = make_problem(sum(tokens_per_rank), *SHAPE, routing="masked", seed=41)
    local = E // world

    def rank_main(rank, group):
        mega = PrimeRlMegaMoe(group, 23)
        mine = rank_problem(problem, rank, tokens_per_rank, "cpu")
        stats = torch.arange(local, dtype=stats_dtype) * 100  # accumulated onto, never reset
        for _ in range(2):
            mega.forward(mine.x, mine.topk_idx, mine.topk_weights, mine.w1, mine.w2, stats=stats)
        return stats

    ids = problem.topk_idx[problem.topk_idx >= 0]
    per_expert = torch.bincount(ids, minlength=E)
    for rank, stats in enumerate(run_world(tokens_per_rank, rank_main)):
        expected = torch.arange(local) * 100 + 2 * per_expert[expert_slices(E, world)[rank]]
        assert stats.dtype == stats_dtype and torch.equal(stats.long(), expected), f"rank {rank}"


def test_rows_past_T_are_never_read(model_buffers):
    """Garbage (out-of-range ids, NaN rows) past T in the buffer changes nothing."""
    p = make_problem(12, *SHAPE, routing="uniform", seed=51)

    def rank_main(rank, group):
        mega = PrimeRlMegaMoe(group, 40)
        clean = rank_outputs(mega, p)
        mega.buffer.x[12:].fill_(float("nan"))
        mega.buffer.topk_idx[12:].fill_(10 ** 6)
        mega.buffer.topk_weights[12:].fill_(float("nan"))
        return clean, rank_outputs(mega, p)

    clean, dirty = run_world((12,), rank_main)[0]
    assert_outputs_equal(clean, dirty, "garbage past T changed the result")


# ---------------------------------------------------------------- the surface


SIGNATURES = {
    "get_symm_buffer_for_mega_moe": "(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, "
                                    "intermediate_hidden, use_fp8_dispatch=None, mma_type='bf16xbf16', "
                                    "activation='swiglu')",
    "bf16_mega_moe": "(y, l1, l2, sym_buffer, cumulative_local_expert_recv_stats=None, activation='swiglu', "
                     "activation_clamp=None, fast_math=True)",
    "bf16_mega_moe_backward": "(dx, dw1, dw2, dtopk_weights, dy, l1, l2, sym_buffer, activation_clamp=None)",
    "set_num_sms": "(n)",
    "get_num_sms": "()",
}


@pytest.mark.parametrize("name", SIGNATURES)
def test_signature_is_designs(name):
    assert str(inspect.signature(getattr(dgc, name))) == SIGNATURES[name]


def test_prime_mega_moe_is_the_compat_module():
    import prime_mega_moe

    for name in dgc.__all__:
        assert getattr(prime_mega_moe, name) is getattr(dgc, name), name
    done = run_python("import prime_mega_moe, primemoe.deep_gemm_compat as d; "
                      "assert prime_mega_moe.bf16_mega_moe is d.bf16_mega_moe; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_prime_mega_moe_is_packaged():
    from setuptools import find_packages

    from helpers import PRIMEMOE_ROOT

    assert "prime_mega_moe" in find_packages(PRIMEMOE_ROOT)


def test_buffer_attributes_and_destroy(model_buffers):
    def rank_main(rank, group):
        buf = dgc.get_symm_buffer_for_mega_moe(group, E, 10, K, H, I)
        return buf

    (buf,) = run_world((1,), rank_main)
    (model,) = model_buffers
    assert (buf.num_topk, buf.mma_type, buf.num_max_tokens_per_rank, buf.x_sf) == (K, "bf16xbf16", 10, None)
    assert (buf.x.shape, buf.x.dtype) == ((10, H), torch.bfloat16)
    assert (buf.topk_idx.shape, buf.topk_idx.dtype) == ((10, K), torch.int64)
    assert (buf.topk_weights.shape, buf.topk_weights.dtype) == ((10, K), torch.float32)
    assert buf.buffer is model and (model.max_tokens_per_rank, model.hidden, model.intermediate, model.num_experts,
                                    model.top_k) == (10, H, I, E, K)
    buf.destroy()
    buf.destroy()  # idempotent
    assert model.close_calls == 1 and buf.destroyed and buf.x is None and "destroyed" in repr(buf)
    y = torch.empty(1, H, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="sym_buffer: this SymmBuffer was destroyed"):
        dgc.bf16_mega_moe(y, torch.empty(E, 2 * I, H, dtype=torch.bfloat16),
                          torch.empty(E, H, I, dtype=torch.bfloat16), buf)


@pytest.fixture
def every_sm():
    """The GEMMs' SM budget is process-wide: restored to every SM after the test."""
    yield
    primemoe.set_num_sms(None)


def test_num_sms(model_buffers, monkeypatch, every_sm):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dgc.get_num_sms() is None
    run_world((1,), lambda rank, group: dgc.get_symm_buffer_for_mega_moe(group, E, 4, K, H, I))
    assert model_buffers[-1].num_sms == DEFAULT_NUM_SMS
    dgc.set_num_sms(116)  # prime-rl: the device's 132 SMs minus 16 reserved for communication
    assert dgc.get_num_sms() == 116
    assert primemoe.get_num_sms() == 116  # the expert GEMMs' grid too
    run_world((1,), lambda rank, group: dgc.get_symm_buffer_for_mega_moe(group, E, 4, K, H, I))
    assert model_buffers[-1].num_sms == DEFAULT_NUM_SMS  # dispatch/combine stay within the budget
    dgc.set_num_sms(8)
    run_world((1,), lambda rank, group: dgc.get_symm_buffer_for_mega_moe(group, E, 4, K, H, I))
    assert model_buffers[-1].num_sms == 8
    with pytest.raises(ValueError, match="set_num_sms: expected a positive int, got 0"):
        dgc.set_num_sms(0)
    with pytest.raises(TypeError, match="set_num_sms: expected an int, got float"):
        dgc.set_num_sms(8.0)


def test_primemoe_num_sms(every_sm, monkeypatch):
    """primemoe.set_num_sms: the GEMMs' budget, None restores every SM; a layer's result does not depend on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert primemoe.get_num_sms() is None
    primemoe.set_num_sms(66)
    assert primemoe.get_num_sms() == 66 and torch.ops.primemoe._num_sms_budget() == 66
    primemoe.set_num_sms(None)
    assert primemoe.get_num_sms() is None
    with pytest.raises(ValueError, match="set_num_sms: expected a positive int, got -3"):
        primemoe.set_num_sms(-3)
    with pytest.raises(TypeError, match="set_num_sms: expected an int or None, got bool"):
        primemoe.set_num_sms(True)
    with pytest.raises(RuntimeError, match="set_num_sms: expected a positive number of SMs"):
        torch.ops.primemoe._set_num_sms(-1)


# ---------------------------------------------------------------- what is not supported, and bad arguments


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(mma_type="fp8xfp4"), r"mma_type: 'fp8xfp4' is not supported .* only 'bf16xbf16'"),
    (dict(mma_type="fp8xfp8"), r"mma_type: 'fp8xfp8' is not supported"),
    (dict(use_fp8_dispatch=True), r"use_fp8_dispatch: FP8 dispatch is not supported"),
    (dict(activation="situ"), r"activation: 'situ' is not supported .* only 'swiglu'"),
])
def test_buffer_not_implemented(model_buffers, kwargs, pattern):
    with pytest.raises(NotImplementedError, match=pattern):
        dgc.get_symm_buffer_for_mega_moe(None, E, 4, K, H, I, **kwargs)
    assert not model_buffers  # refused before any Buffer was made


def test_buffer_accepts_use_fp8_dispatch_false(model_buffers):
    run_world((1,), lambda rank, group: dgc.get_symm_buffer_for_mega_moe(group, E, 4, K, H, I,
                                                                         use_fp8_dispatch=False))
    assert len(model_buffers) == 1


def test_shared_experts_not_implemented(model_buffers):
    with pytest.raises(NotImplementedError, match="num_shared_experts: 1: shared experts are not fused"):
        dgc.SymmBuffer(None, E, 4, K, H, I, num_shared_experts=1)


@pytest.fixture
def one_rank_call(model_buffers):
    """``(mega, problem)``: a one-rank buffer with a problem of 6 tokens loaded, forward already run."""
    p = make_problem(6, *SHAPE, routing="uniform", seed=61)
    mega = run_world((6,), lambda rank, group: PrimeRlMegaMoe(group, 8))[0]
    mega.forward(p.x, p.topk_idx, p.topk_weights, p.w1, p.w2)
    return mega, p


def grads_args(p, **changes):
    args = dict(dx=torch.empty_like(p.x), dw1=torch.empty_like(p.w1), dw2=torch.empty_like(p.w2),
                dtopk_weights=torch.empty(p.x.shape[0], K), dy=p.dy, l1=p.w1, l2=p.w2)
    args.update(changes)
    return args


@pytest.mark.parametrize("clamp", [10.0, 7])
def test_activation_clamp_not_implemented(one_rank_call, clamp):
    mega, p = one_rank_call
    y = torch.empty_like(p.x)
    with pytest.raises(NotImplementedError, match=rf"activation_clamp: {clamp!r}: the clamped SwiGLU .* not "
                                                  r"implemented .* pass None"):
        dgc.bf16_mega_moe(y, p.w1, p.w2, mega.buffer, activation_clamp=clamp)
    with pytest.raises(NotImplementedError, match=rf"activation_clamp: {clamp!r}"):
        dgc.bf16_mega_moe_backward(*grads_args(p).values(), mega.buffer, activation_clamp=clamp)


def test_infinite_clamp_is_no_clamp(one_rank_call):
    mega, p = one_rank_call
    y, y_inf = torch.empty_like(p.x), torch.empty_like(p.x)
    dgc.bf16_mega_moe(y, p.w1, p.w2, mega.buffer)
    dgc.bf16_mega_moe(y_inf, p.w1, p.w2, mega.buffer, activation_clamp=float("inf"))
    assert torch.equal(y, y_inf)


def test_activation_not_implemented_per_call(one_rank_call):
    mega, p = one_rank_call
    with pytest.raises(NotImplementedError, match="activation: 'geglu' is not supported"):
        dgc.bf16_mega_moe(torch.empty_like(p.x), p.w1, p.w2, mega.buffer, activation="geglu")


def test_fast_math_is_accepted(one_rank_call):
    mega, p = one_rank_call
    y, y_exact = torch.empty_like(p.x), torch.empty_like(p.x)
    dgc.bf16_mega_moe(y, p.w1, p.w2, mega.buffer)
    dgc.bf16_mega_moe(y_exact, p.w1, p.w2, mega.buffer, fast_math=False)
    assert torch.equal(y, y_exact)


def test_too_many_tokens(one_rank_call):
    mega, p = one_rank_call
    with pytest.raises(ValueError, match="y: 9 tokens .* exceed the buffer's num_max_tokens_per_rank=8"):
        dgc.bf16_mega_moe(torch.empty(9, H, dtype=torch.bfloat16), p.w1, p.w2, mega.buffer)
    big = torch.empty(9, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dy: 9 tokens .* exceed"):
        dgc.bf16_mega_moe_backward(*grads_args(p, dy=big).values(), mega.buffer)


@pytest.mark.parametrize("name, value, error, pattern", [
    ("dx", torch.empty(6, H, dtype=torch.float32), TypeError, "dx: expected dtype torch.bfloat16, got torch.float32"),
    ("dx", torch.empty(5, H, dtype=torch.bfloat16), ValueError, r"dx: expected shape \(6, 64\), got \(5, 64\)"),
    ("dw1", torch.empty(E, 2 * I, H, dtype=torch.float16), TypeError, "dw1: expected dtype torch.bfloat16 or "
                                                                      "torch.float32, got torch.float16"),
    ("dw2", torch.empty(E, H, I + 1, dtype=torch.bfloat16), ValueError, r"dw2: expected shape \(8, 64, 32\)"),
    ("dtopk_weights", torch.empty(6, K + 1), ValueError, r"dtopk_weights: expected shape \(6, 2\)"),
    ("dy", torch.empty(6, H, dtype=torch.float32), TypeError, "dy: expected dtype torch.bfloat16"),
    ("l1", torch.empty(E, 2 * I, H + 8, dtype=torch.bfloat16), ValueError, "w1: expected shape"),
])
def test_backward_argument_errors(one_rank_call, name, value, error, pattern):
    mega, p = one_rank_call
    with pytest.raises(error, match=pattern):
        dgc.bf16_mega_moe_backward(*grads_args(p, **{name: value}).values(), mega.buffer)


def test_forward_argument_errors(one_rank_call):
    mega, p = one_rank_call
    with pytest.raises(TypeError, match="y: expected dtype torch.bfloat16, got torch.float32"):
        dgc.bf16_mega_moe(torch.empty(6, H), p.w1, p.w2, mega.buffer)
    with pytest.raises(ValueError, match=r"y: expected shape \(6, 64\)"):
        dgc.bf16_mega_moe(torch.empty(6, H + 8, dtype=torch.bfloat16), p.w1, p.w2, mega.buffer)
    with pytest.raises(ValueError, match=r"w1: expected this rank's 8 experts .* got 4"):
        dgc.bf16_mega_moe(torch.empty_like(p.x), p.w1[:4], p.w2[:4], mega.buffer)
    with pytest.raises(TypeError, match="sym_buffer: expected what get_symm_buffer_for_mega_moe returns"):
        dgc.bf16_mega_moe(torch.empty_like(p.x), p.w1, p.w2, mega.buffer.buffer)
    with pytest.raises(ValueError, match=r"cumulative_local_expert_recv_stats: expected shape \(8,\)"):
        dgc.bf16_mega_moe(torch.empty_like(p.x), p.w1, p.w2, mega.buffer,
                          cumulative_local_expert_recv_stats=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="cumulative_local_expert_recv_stats: expected dtype torch.int32 or "
                                        "torch.int64, got torch.float32"):
        dgc.bf16_mega_moe(torch.empty_like(p.x), p.w1, p.w2, mega.buffer,
                          cumulative_local_expert_recv_stats=torch.zeros(E))
    with pytest.raises(ValueError, match="y: expected a 2-D tensor"):
        dgc.bf16_mega_moe(torch.empty(6), p.w1, p.w2, mega.buffer)
