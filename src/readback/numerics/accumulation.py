"""How an FP8 GEMM accumulates: IEEE FP32, or Hopper's tensor cores, emulated bit for bit.

A Hopper tensor core (cuBLAS's FP8 GEMMs on an H100, as ``torch._scaled_mm`` and Transformer
Engine call them) does not add the products in IEEE arithmetic. It takes them in blocks of 32
along K; each block is one step of a chain whose running sum ``c`` starts at +0:

* each input's exponent is clamped at its format's ``min_exponent`` (E4M3 -6, E5M2 -14), so a
  subnormal keeps a significand below 1; the block's alignment exponent ``E`` is the largest
  sum of the two clamped exponents over its nonzero products, or ``c``'s exponent if larger;
* every product and ``c`` are truncated toward zero to multiples of ``2**(E - 13)`` and the
  terms are added exactly; the block result is truncated again, to 13 fraction bits of its own
  exponent; a result of zero is +0.

``fast`` (``use_fast_accum=True``) runs one chain over all of K; ``split`` (the default of
``torch._scaled_mm`` and of TE's dgrad and wgrad) restarts it every 128 elements of K and adds
the chunks' results in FP32, in K order, rounding to nearest; ``ieee`` is an FP32 GEMM of the
decoded values. The epilogue is the same for all three: ``RN32(acc * RN32(scale_a * scale_b))``,
then rounded to the output's dtype. cuBLAS's split-K of a GEMM into S > 1 parallel partial sums
is not modelled: an unsplit call is the case emulated.

Every step is exact in FP32 (see ``_block``), so the result does not depend on the order in which
torch adds. Non-finite inputs are not part of the model: an output whose row of ``a`` or column
of ``b`` holds one is the FP32 GEMM's.
"""

from __future__ import annotations

import sys

import torch

from readback.numerics.rounding import decode

MODES = ("fast", "split", "ieee")
BLOCK = 32  # products aligned together
FRACTION_BITS = 13  # kept below the alignment exponent, and below the block result's own exponent
CHUNK = 128  # split: the chain restarts every CHUNK elements of K
TILE = 1 << 19  # elements of a [rows, n, BLOCK] temporary: small enough to stay in cache
PANEL = 1 << 21  # alignment exponents found at once (one FP64 GEMM, of 16 MiB)

_HIGH_WORD = 1 if sys.byteorder == "little" else 0  # of the two 32-bit words of an FP64
_RESULT_MASK = ~((1 << (23 - FRACTION_BITS)) - 1)  # clears the fraction bits of an FP32 below 13


def min_exponent(dtype: torch.dtype) -> int:
    """The clamp of an FP8 dtype's exponents (the exponent of its smallest normal number)."""
    return {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}[dtype]


def accumulate(
    a: torch.Tensor, b: torch.Tensor, mode: str, min_exponents: tuple[int, int] | None = None
) -> torch.Tensor:
    """The FP32 accumulator of ``a @ b`` (``..., m, k`` @ ``..., k, n``, batch dimensions broadcast).

    ``a`` and ``b`` hold FP8 values: FP8 codes, or their values decoded to a float dtype, in which
    case ``min_exponents`` names the formats' clamps (``min_exponent`` of each dtype).
    """
    if mode not in MODES:
        raise ValueError(f"unknown accumulation {mode!r}; valid: {MODES}")
    va, vb = decode(a, torch.float32), decode(b, torch.float32)
    if mode == "ieee":
        return torch.matmul(va, vb)
    if min_exponents is None:
        min_exponents = (min_exponent(a.dtype), min_exponent(b.dtype))
    batch = (va[..., :0, :0] + vb[..., :0, :0]).shape[:-2]  # the broadcast batch dimensions
    m, k, n = va.shape[-2], va.shape[-1], vb.shape[-1]
    if 0 in (m, k, n, batch.numel()):  # no products: +0 (the kernel's result for K = 0)
        return torch.zeros(*batch, m, n, device=va.device)
    x = va.expand(*batch, m, k).reshape(-1, m, k)
    y = vb.expand(*batch, k, n).reshape(-1, k, n).mT  # [g, n, k]: K last in both
    if mode == "fast":
        acc = _chains(x, y, min_exponents)
    else:  # the whole chunks run as a batch of chains, the ragged last one on its own
        chunks = k // CHUNK
        parts: list[torch.Tensor] = []
        if chunks:
            x_, y_ = (t[..., : chunks * CHUNK].reshape(len(t), -1, chunks, CHUNK).transpose(1, 2) for t in (x, y))
            parts += _chains(x_.flatten(0, 1), y_.flatten(0, 1), min_exponents).view(-1, chunks, m, n).unbind(1)
        if k > chunks * CHUNK:
            parts.append(_chains(x[..., chunks * CHUNK :], y[..., chunks * CHUNK :], min_exponents))
        acc = torch.zeros_like(parts[0])
        for part in parts:  # in K order, FP32 round-to-nearest
            acc = acc + part
    acc = acc.reshape(*batch, m, n)
    return _nonfinite_as_ieee(acc, va, vb)


def epilogue(acc: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``RN32(acc * RN32(scale_a * scale_b))`` (one fused multiply-add with a +0 addend, whose
    exact product FP64 holds), rounded to ``dtype`` (BF16: a second rounding, as the kernel's)."""
    alpha = (scale_a.float() * scale_b.float()).double()
    return (acc.double() * alpha + 0.0).float().to(dtype)


def _chains(x: torch.Tensor, y: torch.Tensor, min_exponents: tuple[int, int]) -> torch.Tensor:
    """One chain from +0 over K per output: ``x [g, m, K]``, ``y [g, n, K]`` FP32 -> ``[g, m, n]``.

    K is padded with zeros to whole blocks: a zero product takes no part in an alignment and adds
    0. Rows of ``m`` run a tile at a time, so that the ``[rows, n, BLOCK]`` temporaries stay small.
    """
    k = -(-x.shape[-1] // BLOCK) * BLOCK
    x, y = (torch.nn.functional.pad(t, (0, k - t.shape[-1])) for t in (x, y))
    g, m, _ = x.shape
    n = y.shape[1]
    wx, wy = _exponent_weights(x, min_exponents[0]), _exponent_weights(y, min_exponents[1])
    out = torch.empty(g, m, n, device=x.device)
    rows = max(1, TILE // max(1, g * n * BLOCK))
    panel = rows * max(1, PANEL // (rows * g * n * (k // BLOCK)))  # rows whose exponents one GEMM finds
    for p in range(0, m, panel):
        units = _units(wx[:, :, p : p + panel], wy, sum(min_exponents))
        for r in range(p, min(p + panel, m), rows):
            xs = x[:, r : r + rows]
            acc = torch.zeros(g, xs.shape[1], n, device=x.device)
            for j in range(k // BLOCK):
                block = slice(j * BLOCK, (j + 1) * BLOCK)
                acc = _block(xs[..., block], y[..., block], units[j, :, r - p : r - p + rows], acc)
            out[:, r : r + rows] = acc
    return out


def _exponent_weights(v: torch.Tensor, clamp: int) -> torch.Tensor:
    """``256 ** max(floor(log2|v|), clamp)`` in FP64, 0 for a zero value, blocks first:
    ``[g, rows, K]`` -> ``[K / 32, g, rows, 32]``. FP8 values are normal in FP32, so a table
    indexed by the biased FP32 exponent gives the weight (index 0: zero)."""
    e = (torch.arange(256) - 127).clamp_min(clamp)
    table = torch.where(torch.arange(256) > 0, ((8 * e + 1023) << 52).view(torch.float64), 0.0)
    weights = table.to(v.device)[(v.view(torch.int32) >> 23) & 0xFF]
    return weights.reshape(*v.shape[:-1], -1, BLOCK).movedim(-2, 0)


def _units(wx: torch.Tensor, wy: torch.Tensor, floor: int) -> torch.Tensor:
    """The FP32 bits of ``2**(E - 13)`` for each block and output, ``E`` the largest sum of clamped
    exponents over the block's nonzero products, floored at ``floor`` (see ``_block``).

    One GEMM finds every maximum: a sum of at most 32 powers ``256**(ex + ey)`` lies in
    ``[256**E, 32 * 256**E]`` in any order of FP64 additions (each rounding is monotone and both
    bounds are representable), so its binary exponent, shifted right by 3, is ``E``; a block
    without a nonzero product sums to 0, whose exponent is below any floor. The FP64's high word
    holds the biased exponent from bit 20 (the sign is 0), so one subtraction and one shift give
    ``E``; the 32-bit words halve the traffic of these per-block passes.
    """
    high = torch.matmul(wx, wy.mT).view(torch.int32)[..., _HIGH_WORD::2]
    e = ((high - (1023 << 20)) >> 23).clamp_min(floor)
    return (e + 127 - FRACTION_BITS) << 23


def _block(x: torch.Tensor, y: torch.Tensor, units: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One step of the chains: ``c`` [g, m, n] plus the block ``x [g, m, 32] . y [g, n, 32]``,
    with ``units`` [g, m, n] the FP32 bits of ``2**(E - 13)`` for the products alone.

    ``E`` was floored at the sum of the formats' clamps (>= -28) rather than the hardware's -132:
    below it there is no nonzero product, and ``c`` is a multiple of ``2**(floor - 13)`` (every
    block result is a multiple of its own ``2**(E - 13)``), so no term changes, and
    ``2**(E - 13)`` stays a normal FP32 number. ``c``'s own unit is its exponent bits less 13
    (negative, so never the larger, for +0).

    Exactness in FP32: a product of two FP8 values has at most 8 significant bits and lies within
    FP32's normal range; each truncated term is an integer below ``2**16`` in units of
    ``2**(E - 13)`` (a product is below ``2**(E + 2)``, ``c`` below ``2**(E + 1)``), so the 33
    terms add up to an integer below ``2**21``, exact in any order; times the power of two it is
    an exact normal FP32 number, whose low fraction bits the mask clears.

    A zero result is +0: a nonzero ``c`` is at least ``2**E_c`` and ``E >= E_c``, so its term is
    a nonzero integer, and a sum that cancels is +0 in round-to-nearest; ``c`` = +0 adds +0.
    """
    own = (c.view(torch.int32) & 0x7F800000) - (FRACTION_BITS << 23)
    q = torch.maximum(units, own).view(torch.float32)  # 2**(E - 13)
    products = x[..., :, None, :] * y[..., None, :, :]
    terms = products.div_(q[..., None], rounding_mode="trunc").sum(-1)
    s = terms + torch.div(c, q, rounding_mode="trunc")
    d = (s * q).view(torch.int32) & _RESULT_MASK
    return d.view(torch.float32)


def _nonfinite_as_ieee(acc: torch.Tensor, va: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """``acc`` with the FP32 GEMM's outputs wherever a row of ``a`` or a column of ``b`` holds a
    NaN or an infinity: the model covers finite values only."""
    rows, cols = ~torch.isfinite(va).all(-1), ~torch.isfinite(vb).all(-2)
    if not (bool(rows.any()) or bool(cols.any())):
        return acc
    return torch.where(rows[..., :, None] | cols[..., None, :], torch.matmul(va, vb), acc)
