"""Blockwise FP8 (DESIGN.md section 2): the quantisers in ATen ops, on any device, and the cache of the
quantised weights.

These functions are the single definition the CUDA quantisation kernels are tested against **bitwise**
(``q`` compared as bytes, ``s`` as float32 bits). The recipe, per tile of values ``t``:

1. ``t32 = t.to(float32)`` (exact for bf16, fp16 and fp32 inputs; fp64 rounds to nearest).
2. ``amax = max |t32|`` over the tile, in float32 (a NaN anywhere in the tile makes it NaN).
3. The quantisation multiplier ``m``:

   - ``amax == 0`` (a tile of zeros): ``m = 1.0``;
   - else ``m = float32(448.0) / amax``, one IEEE float32 division rounded to nearest (not
     ``448 * (1 / amax)``: note that ``448.0 / tensor`` in PyTorch is exactly that two-rounding form, so
     the code below calls ``torch.div``; in CUDA, ``448.0f / amax`` without ``-use_fast_math``/``__fdividef``),
     then capped at ``2**126`` (``min(m, 2**126)``: see "Tiny tiles" below);
   - ``pow2=True`` (the default, TransformerEngine's): ``m`` rounded **down** to a power of two by clearing
     its 23 mantissa bits, ``m = bits(m) & 0x7F800000``. The stored scale is then ``amax / 448`` rounded
     **up** to a power of two, so ``|t32 * m| <= 448``: no value overflows.

4. ``q = float8_e4m3fn(clamp(t32 * m, -448, 448))``: the product is one float32 multiplication (exact when
   ``m`` is a power of two, barring float32 underflow), clamped **before** the cast, and the cast rounds to
   nearest-even (E4M3 subnormals kept: no flush-to-zero anywhere, neither of inputs, ``amax``, products nor
   results). With these multipliers a finite ``t32 * m`` exceeds 448 by at most one float32 rounding
   (``pow2=False``), which rounds to 448 anyway: the clamp is the guard that makes the cast saturating (as
   ``__NV_SATFINITE`` does in CUDA), whatever the conversion does past 448.
5. The stored (dequantisation) scale ``s = float32(1.0) / m``, an IEEE float32 division (exact for powers of
   two); a tile dequantises to ``q * s``.

Non-finite inputs are outside the bitwise contract; what is promised is that the poison survives (every
non-finite input dequantises to NaN, other tiles are unaffected). What these functions compute, for the
record: a NaN makes ``amax`` NaN (``torch.amax`` propagates it; CUDA's ``fmaxf`` would drop it); with
``pow2=False`` then ``m``, ``s`` and the whole tile are NaN; with ``pow2=True`` the exponent mask turns the
NaN ``m`` into ``+inf``, so ``s = 0``, the NaN (and any zero) dequantises to NaN and the rest of the tile to
0. An infinity makes ``amax = inf``, ``m = 0``, ``s = inf``: the whole tile dequantises to NaN.

Tiny tiles: ``m`` is capped at ``2**126`` (``M_MAX``) after the division, so a tile with ``0 < amax < 448 /
2**126`` (about 5.3e-36; bf16 subnormals reach 9.2e-41) gets ``m = 2**126`` and the normal scale ``2**-126``
instead of ``m = +inf`` (which would make its exact zeros NaN).

Tile shapes:

- :func:`quantize_1x128`: activations and gradients (``x``, ``dy``, the SwiGLU output ``a``, ``dh``): one
  scale per 128 consecutive values of a row, along the last (contraction) dimension.
- :func:`quantize_128x1`: the weight-gradient operands (rows of ``x``, ``dy``, ``w * a``, ``dh`` along the
  tokens of an expert): one scale per 128 consecutive rows of a column, output transposed so the token
  dimension is contiguous (K-major for Hopper's FP8 wgmma).
- :func:`quantize_128x128`: the weights, one scale per 128x128 block of the last two dimensions. Both
  orientations a GEMM reads (forward: ``w [N, K]``; dgrad: ``w^T [K, N]``) are the same blocks with the same
  bits: the transposed orientation is ``q.transpose(-1, -2)`` with ``s.transpose(-1, -2)``.
- :func:`quantized_weights`: the 128x128 quantisation of a weight tensor, cached until the weight changes
  (one quantisation per optimizer step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = [
    "E4M3_MAX", "BLOCK", "FP8_DTYPE",
    "quantize_1x128", "quantize_128x1", "quantize_128x128",
    "dequantize_1x128", "dequantize_128x1", "dequantize_128x128",
    "QuantizedWeights", "quantized_weights", "invalidate", "clear_cache", "cache_size",
]

E4M3_MAX = 448.0
M_MAX = 2.0 ** 126  # the largest multiplier: its scale 1 / M_MAX is still a normal float32
BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn

_EXPONENT_BITS = 0x7F800000  # the float32 exponent field: m & this = 2 ** floor(log2(m)) for finite m > 0


# ---------------------------------------------------------------- the recipe on tiles


def _multiplier(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The quantisation multiplier ``m`` of each tile from its float32 ``amax`` (steps 3 of the module doc)."""
    m = torch.div(torch.full_like(amax, E4M3_MAX), amax)  # IEEE float32 division (not reciprocal * 448)
    # Capped at 2^126 (amax < 448 / 2^126 ~ 5.3e-36, e.g. bf16 subnormals): 448 / amax would overflow to +inf, and
    # the scale 1 / m stays a normal float.
    m = torch.clamp(m, max=M_MAX)
    m = torch.where(amax == 0, torch.ones_like(m), m)
    if pow2:
        m = torch.bitwise_and(m.view(torch.int32), _EXPONENT_BITS).view(torch.float32)
    return m


def _quantize_tiles(t32: torch.Tensor, tile_dims: tuple[int, ...], pow2: bool):
    """``t32`` float32 viewed so that each tile spans ``tile_dims``: ``(q e4m3 like t32, s fp32)``, ``s`` with
    ``tile_dims`` reduced away (kept as size 1 in ``m`` for the broadcast)."""
    amax = torch.amax(t32.abs(), dim=tile_dims, keepdim=True)
    m = _multiplier(amax, pow2)
    q = torch.clamp(t32 * m, -E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    s = torch.div(torch.ones_like(m), m)
    return q, s.squeeze(tile_dims) if tile_dims else s


def _as_float32(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name}: expected a floating tensor (bfloat16 or float32) to quantise, got {t.dtype}")
    return t.detach().to(torch.float32)


def _check_dims(name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor {layout}, got shape {tuple(t.shape)}")


def _check_multiple(name: str, t: torch.Tensor, dim: int, what: str, tile: str) -> None:
    size = t.shape[dim]
    if size % BLOCK:
        raise ValueError(f"{name}: expected {what} to be a multiple of {BLOCK} (the {tile} FP8 tiles), "
                         f"got {size} (shape {tuple(t.shape)})")


# ---------------------------------------------------------------- quantisers


def quantize_1x128(t: torch.Tensor, pow2: bool = True, *, name: str = "t"):
    """1x128 tiles along the last (contraction) dimension: ``t [M, K]`` -> ``(q [M, K] float8_e4m3fn,
    s [M, K // 128] float32)``, ``q[i, j] * s[i, j // 128] ~= t[i, j]``.

    ``pow2``: power-of-two scales (the default); ``False`` keeps the exact float32 scale ``1 / (448 / amax)``.
    ``name``: the argument named in errors. Raises ``ValueError`` unless ``t`` is 2-D with ``K % 128 == 0``.
    """
    t32 = _as_float32(name, t)
    _check_dims(name, t32, 2, "[M, K]")
    _check_multiple(name, t32, 1, "the last (contraction) dim K", "1x128")
    M, K = t32.shape
    q, s = _quantize_tiles(t32.reshape(M, K // BLOCK, BLOCK), (2,), pow2)
    return q.view(M, K), s


def quantize_128x1(t: torch.Tensor, pow2: bool = True, *, name: str = "t"):
    """128x1 tiles along dim 0 (the token dimension of a weight-gradient operand), output **transposed** so
    the token dimension is contiguous: ``t [M, K]`` -> ``(q_t [K, M] float8_e4m3fn, s [K, M // 128] float32)``
    where ``q_t[k, m]`` quantises ``t[m, k]`` with the scale ``s[k, m // 128]`` of tile ``(m // 128, k)``.

    Exactly (bitwise) ``quantize_1x128(t.t().contiguous())``: the same tiles, read along the other dim.
    Raises ``ValueError`` unless ``t`` is 2-D with ``M % 128 == 0`` (pad the rows with zeros: a zero row
    changes no tile's ``amax`` unless the whole tile is zero, which then gets ``s = 1`` and ``q = 0``).
    """
    t32 = _as_float32(name, t)
    _check_dims(name, t32, 2, "[M, K]")
    _check_multiple(name, t32, 0, "the first (token) dim M", "128x1")
    M, K = t32.shape
    q, s = _quantize_tiles(t32.reshape(M // BLOCK, BLOCK, K), (1,), pow2)  # q [M/128, 128, K], s [M/128, K]
    return q.view(M, K).t().contiguous(), s.t().contiguous()


def quantize_128x128(w: torch.Tensor, pow2: bool = True, *, name: str = "w"):
    """128x128 blocks over the last two dimensions: ``w [..., N, K]`` (e.g. experts ``[E, N, K]``) ->
    ``(q [..., N, K] float8_e4m3fn, s [..., N // 128, K // 128] float32)``, ``q[..., i, j] * s[..., i // 128,
    j // 128] ~= w[..., i, j]``.

    The transposed orientation (what dgrad reads, ``w^T [..., K, N]``) is ``q.transpose(-1, -2)`` with
    ``s.transpose(-1, -2)``: the same blocks with the same bits, bitwise equal to ``quantize_128x128`` of
    ``w.transpose(-1, -2).contiguous()``. Raises ``ValueError`` unless ``w`` has at least 2 dims with
    ``N % 128 == 0`` and ``K % 128 == 0``.
    """
    w32 = _as_float32(name, w)
    if w32.dim() < 2:
        raise ValueError(f"{name}: expected a tensor [..., N, K] of at least 2 dims, got shape {tuple(w32.shape)}")
    _check_multiple(name, w32, -2, "dim -2 (N)", "128x128")
    _check_multiple(name, w32, -1, "the last dim K", "128x128")
    *lead, N, K = w32.shape
    blocks = w32.reshape(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    nd = blocks.dim()
    q, s = _quantize_tiles(blocks, (nd - 3, nd - 1), pow2)
    return q.view(*lead, N, K), s


# ---------------------------------------------------------------- dequantisers


def _check_pair(name_q: str, q: torch.Tensor, s: torch.Tensor, expected_s: tuple[int, ...]) -> None:
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"{name_q}: expected dtype {FP8_DTYPE}, got {q.dtype}")
    if tuple(s.shape) != expected_s:
        raise ValueError(f"s: expected shape {expected_s} for {name_q} of shape {tuple(q.shape)}, "
                         f"got {tuple(s.shape)}")


def dequantize_1x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [M, K] * s [M, K // 128]`` per 1x128 tile, in ``dtype`` (one rounding there; exact in float64, and in
    float32 with power-of-two scales)."""
    _check_dims("q", q, 2, "[M, K]")
    _check_multiple("q", q, 1, "the last dim K", "1x128")
    M, K = q.shape
    _check_pair("q", q, s, (M, K // BLOCK))
    return (q.to(dtype).reshape(M, K // BLOCK, BLOCK) * s.to(dtype).unsqueeze(2)).view(M, K)


def dequantize_128x1(q_t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_128x1`: ``q_t [K, M]``, ``s [K, M // 128]`` -> the values ``[M, K]`` again
    (contiguous), in ``dtype``."""
    _check_dims("q_t", q_t, 2, "[K, M]")
    _check_multiple("q_t", q_t, 1, "the last (token) dim M", "128x1")
    return dequantize_1x128(q_t, s, dtype).t().contiguous()


def dequantize_128x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., N, K] * s [..., N // 128, K // 128]`` per 128x128 block, in ``dtype``. Works on either
    orientation (``q.transpose(-1, -2)`` with ``s.transpose(-1, -2)`` gives the transposed values)."""
    if q.dim() < 2:
        raise ValueError(f"q: expected a tensor [..., N, K] of at least 2 dims, got shape {tuple(q.shape)}")
    _check_multiple("q", q, -2, "dim -2 (N)", "128x128")
    _check_multiple("q", q, -1, "the last dim K", "128x128")
    *lead, N, K = q.shape
    _check_pair("q", q, s, (*lead, N // BLOCK, K // BLOCK))
    scale = s.to(dtype).repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return q.to(dtype) * scale


# ---------------------------------------------------------------- the weight cache


class QuantizedWeights:
    """The 128x128 quantisation of a weight ``w [..., N, K]`` in the two orientations the GEMMs read.

    - ``q [..., N, K]`` e4m3, ``s [..., N/128, K/128]`` fp32: the forward orientation (K-major for FC1 / FC2).
    - ``q_t``, ``s_t``: the transposed orientation ``w^T [..., K, N]`` (dgrad) as **views** of ``q`` and
      ``s`` (free; the same blocks and bits, see :func:`quantize_128x128`).
    - :meth:`transposed_contiguous`: the same as contiguous tensors (what a K-major TMA load of ``w^T``
      needs), copied once on first use and then cached with this object (so it costs memory only for the
      weights whose dgrad asks for it).

    Holds no reference to the weight it came from.
    """

    __slots__ = ("q", "s", "pow2", "_transposed")

    def __init__(self, q: torch.Tensor, s: torch.Tensor, pow2: bool):
        self.q, self.s, self.pow2 = q, s, pow2
        self._transposed = None

    @property
    def q_t(self) -> torch.Tensor:
        return self.q.transpose(-1, -2)

    @property
    def s_t(self) -> torch.Tensor:
        return self.s.transpose(-1, -2)

    def transposed_contiguous(self):
        """``(q_t, s_t)`` as contiguous tensors ``[..., K, N]`` / ``[..., K/128, N/128]``, copied once."""
        if self._transposed is None:
            self._transposed = (self.q_t.contiguous(), self.s_t.contiguous())
        return self._transposed

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_128x128(self.q, self.s, dtype)


# The cache: id(w) -> _Slot, and a weakref.finalize per cached weight that drops its slot when the weight is
# freed. Why not the alternatives:
# - weakref.WeakKeyDictionary: it hashes tensors by id but compares colliding keys with ==, which on tensors is
#   elementwise (and "Boolean value of Tensor ... is ambiguous").
# - an attribute on the tensor (w._primemoe_fp8 = ...): it would travel with the tensor's __dict__ through
#   copy.deepcopy and pickling (a model copy carrying a second set of quantised weights), and torch.compile
#   guards on tensor attributes. Here nothing is attached to the weight.
# The finalizer runs while the weight is being deallocated, before its id can be reused, and the slot also
# keeps a weakref to the weight that every lookup checks (`slot.ref() is w`), so a reused id never hits.
# A hit also needs the same version counter (every in-place op on w, autograd-tracked or under no_grad, as
# optimizer.step() does, bumps it), the same storage (a weakref to w.untyped_storage(): PyTorch keeps one
# Python object per live storage, so a `.data` swap, which keeps the version counter, is caught even when the
# new storage lands at the freed address of the old one), and the same data_ptr / shape / strides / dtype /
# device. Writes through `w.data` (a fresh version counter: `w.data.add_(...)`) are invisible: call
# invalidate(w) after them. Not thread-safe (like the rest of the Python layer).


@dataclass
class _Slot:
    ref: weakref.ref  # the weight
    finalizer: weakref.finalize
    entries: dict  # pow2 -> (stamp, QuantizedWeights)


_CACHE: dict[int, _Slot] = {}


def _stamp(w: torch.Tensor):
    """What must be unchanged for a cached quantisation of ``w`` to be reused (None: ``w`` cannot be cached)."""
    try:
        version = w._version
        storage = w.untyped_storage()
    except (RuntimeError, NotImplementedError):  # inference tensors have no version counter; some have no storage
        return None
    return (version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device), weakref.ref(storage)


def _stamp_matches(stamp, w: torch.Tensor) -> bool:
    fields, storage_ref = stamp
    now = _stamp(w)
    return now is not None and now[0] == fields and storage_ref() is w.untyped_storage()


def _drop(key: int) -> None:
    _CACHE.pop(key, None)


def quantized_weights(w: torch.Tensor, pow2: bool = True, *, quantize=None) -> QuantizedWeights:
    """The 128x128 quantisation of ``w`` (:func:`quantize_128x128`), reused until ``w`` changes.

    ``quantize``: what quantises on a miss, ``quantize(w, pow2) -> (q, s)``, bitwise equal to
    :func:`quantize_128x128` (the layer passes the CUDA kernel ``torch.ops.primemoe.quantize_fp8_128x128`` for CUDA
    weights: the ATen form makes float32 copies of the whole weight); None: :func:`quantize_128x128`.

    Keyed on the tensor object itself (pass the same Parameter every step: a fresh alias such as
    ``w.detach()`` is another tensor and gets its own, short-lived entry), its version counter, storage and
    data_ptr: one quantisation per optimizer step. The cache holds only a weak reference to ``w``; its entry
    is freed with ``w``. See the comment above ``_Slot`` for what invalidates an entry.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    key = id(w)
    slot = _CACHE.get(key)
    if slot is not None and slot.ref() is not w:  # a dead weight's id (its finalizer has not run yet)
        slot.finalizer.detach()
        _drop(key)
        slot = None
    if slot is not None:
        hit = slot.entries.get(bool(pow2))
        if hit is not None and _stamp_matches(hit[0], w):
            return hit[1]
    stamp = _stamp(w)
    with torch.no_grad():
        value = QuantizedWeights(*(quantize or quantize_128x128)(w, pow2), bool(pow2))
    if stamp is None:
        return value
    if slot is None:
        slot = _Slot(weakref.ref(w), weakref.finalize(w, _drop, key), {})
        _CACHE[key] = slot
    slot.entries[bool(pow2)] = (stamp, value)
    return value


def invalidate(w: torch.Tensor) -> None:
    """Forget the cached quantisation of ``w`` (needed only after writes the version counter does not see,
    i.e. through ``w.data``)."""
    slot = _CACHE.get(id(w))
    if slot is not None and slot.ref() is w:
        slot.finalizer.detach()
        _drop(id(w))


def clear_cache() -> None:
    """Forget every cached quantisation."""
    for slot in list(_CACHE.values()):
        slot.finalizer.detach()
    _CACHE.clear()


def cache_size() -> int:
    """How many weights have a cached quantisation (for tests and debugging)."""
    return len(_CACHE)
