"""The FP8 quantisation kernels (csrc/kernels/quantize.cu) against their CPU kernels (the primemoe.fp8 reference):
bitwise equal on fresh random bf16 inputs, every output element written, CUDA-graph replay, opcheck on CUDA."""

import math

import pytest
import torch

from helpers import poison_caching_allocator

import primemoe  # noqa: F401  (registers the ops)

pytestmark = pytest.mark.gpu
ops = torch.ops.primemoe

OPS = {"1x128": ops.quantize_fp8_1x128, "128x1": ops.quantize_fp8_128x1, "128x128": ops.quantize_fp8_128x128}

# op name -> input shapes: empty, one tile, partial 64-column blocks (128x1: 200 = 3 * 64 + 8), M = 128 * 3 with
# K = 128 * 5, experts, and one larger case per op.
SHAPES = {
    "1x128": [(0, 256), (1, 128), (17, 640), (384, 640), (1000, 2048)],
    "128x1": [(0, 640), (128, 8), (256, 200), (384, 640), (1024, 1536)],
    "128x128": [(0, 128, 256), (128, 128), (256, 640), (3, 256, 384), (2, 3, 128, 256)],
}
CASES = [(name, shape) for name, shapes in SHAPES.items() for shape in shapes]


def make_input(shape, seed):
    """bf16 over many magnitudes: a normal sample times log-uniform row (1e-6 .. 1e4) and column (1e-2 .. 1e2)
    scales, so tiles mix values far below their amax (products in and below E4M3's subnormal range) in every
    tiling. In the [rows, K] view: row 0 zeros; rows 128 .. 256 x columns 128 .. 256 zeros (a zero tile in
    every tiling); row 1 small (2^-15) but for one 1.0 per 128 columns (its quantised values are E4M3
    subnormals); a value near the bf16 maximum in row 2; 16 values of row 3 times 1e30; in row 4 a tile of amax
    1e-33 holding bf16 subnormals; the last row's first 128 values negative; rows 256 .. 384 x columns 0 .. 256 tiny
    (1e-38, 1e-36: multipliers capped at 2^126)."""
    gen = torch.Generator().manual_seed(seed)
    rows, K = math.prod(shape[:-1]), shape[-1]
    t = torch.randn(rows, K, generator=gen)
    t *= 10 ** (torch.rand(rows, 1, generator=gen) * 10 - 6)
    t *= 10 ** (torch.rand(1, K, generator=gen) * 4 - 2)
    if rows > 1:
        t[1] = torch.randn(K, generator=gen) * 2.0 ** -15
        t[1, ::128] = 1.0
    if rows > 2 and K >= 8:
        t[2, 6] = -2.5e38
    if rows > 3:
        t[3, :16] *= 1e30
    if rows > 4 and K >= 256:  # a tile of amax 1e-33, bf16 subnormals in it quantised to nonzero values
        t[4, 128:256] = torch.randn(128, generator=gen) * 1e-34
        t[4, 130], t[4, 131], t[4, 132] = 1e-33, 5e-39, -3e-39
    # Tiles of tiny values in every tiling (bf16 subnormals among them): 448 / amax overflows (first 128 columns)
    # or passes 2^126 (next 128), the multiplier is capped at 2^126.
    t[256:384, :128] = torch.randn(t[256:384, :128].shape, generator=gen) * 1e-38
    t[256:384, 128:256] = torch.randn(t[256:384, 128:256].shape, generator=gen) * 1e-36
    if rows > 4:
        t[-1, :128] = -t[-1, :128].abs()
    if rows > 0:
        t[0] = 0
    t[128:256, 128:256] = 0
    return t.bfloat16().view(shape)


def assert_bitwise(got, want, what):
    assert got.is_cuda, what
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), (
        f"{what}: got {got.dtype} {tuple(got.shape)} strides {got.stride()}, "
        f"want {want.dtype} {tuple(want.shape)} strides {want.stride()}")
    bits = torch.uint8 if want.element_size() == 1 else torch.int32
    g, w = got.cpu().view(bits), want.view(bits)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {w.numel()} elements differ; first at {first}: "
                             f"got {got.cpu()[first].item()!r} ({g[first].item():#x}), "
                             f"want {want[first].item()!r} ({w[first].item():#x})")


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name,shape", CASES)
def test_cuda_equals_cpu_on_poisoned_memory(name, shape, pow2):
    """Outputs allocated from NaN-filled memory: an element the kernel does not write reads back as NaN."""
    x = make_input(shape, seed=2 * CASES.index((name, shape)) + pow2)
    want_q, want_s = OPS[name](x, pow2)
    x = x.cuda()
    poison_caching_allocator()
    got_q, got_s = OPS[name](x, pow2)
    assert_bitwise(got_q, want_q, f"{name} q {shape} pow2={pow2}")
    assert_bitwise(got_s, want_s, f"{name} s {shape} pow2={pow2}")


@pytest.mark.parametrize("name", OPS)
def test_graph_replay_equals_eager(name):
    shape = SHAPES[name][3]
    static_x = make_input(shape, seed=1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OPS[name](static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q, static_s = OPS[name](static_x)
    for seed in (2, 3):
        x = make_input(shape, seed=seed).cuda()
        static_x.copy_(x)
        graph.replay()
        q, s = OPS[name](x)
        assert_bitwise(static_q, q.cpu(), f"{name} q after replay, seed {seed}")
        assert_bitwise(static_s, s.cpu(), f"{name} s after replay, seed {seed}")


@pytest.mark.parametrize("name", OPS)
def test_opcheck_on_cuda(name):
    torch.library.opcheck(OPS[name], (make_input(SHAPES[name][2], seed=4).cuda(), True))


@pytest.mark.parametrize("name", OPS)
def test_misaligned_view_names_the_argument(name):
    base = torch.zeros(256 * 256 + 8, dtype=torch.bfloat16, device="cuda")
    x = base[1:1 + 256 * 256].view(256, 256)
    arg = "w" if name == "128x128" else "x"
    with pytest.raises(RuntimeError, match=f"{arg}: expected 16-byte aligned data on CUDA"):
        OPS[name](x)


def test_bandwidth(capsys):
    """Reported (pytest -s), with a floor far below the H200's ~4.3 TB/s that only a broken kernel misses."""
    x = torch.randn(16384, 7168, device="cuda").bfloat16()
    moved = x.numel() * (2 + 1 + 4 / 128)  # bf16 in, e4m3 out, one fp32 scale per 128 values
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    report = []
    for name, op in OPS.items():
        for _ in range(3):
            op(x)
        start.record()
        for _ in range(20):
            op(x)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 20
        report.append((name, moved / seconds / 1e9, seconds * 1e6))
    with capsys.disabled():
        for name, gbps, us in report:
            print(f"\nquantize_fp8_{name} [16384, 7168]: {us:.1f} us, {gbps:.0f} GB/s", end="")
        print()
    for name, gbps, _ in report:
        assert gbps > 500, f"quantize_fp8_{name}: {gbps:.0f} GB/s"
