"""Emulated FP8 GEMM: the one place where FP8 operands are multiplied.

The semantics are those of the real kernel (``torch._scaled_mm``, cuBLASLt, Transformer Engine):
the FP8 codes' values are multiplied and accumulated in FP32 (each product of two FP8 values is
exact in FP32), the accumulator is multiplied by both inverse scales in FP32, and the result is
rounded once, to BF16. On FP8 GPUs ``torch._scaled_mm`` runs it as a real FP8 GEMM; on the CPU
the emulation is an FP32 GEMM of the decoded codes (``_scaled_mm`` runs there too, only slower),
or, with ``accumulation`` ``fast`` or ``split``, Hopper's tensor-core accumulation bit for bit
(``readback.numerics.accumulation``). BF16 GEMMs are ``bf16_mm``'s.
"""

from __future__ import annotations

import functools

import torch

from readback.numerics.accumulation import MODES, accumulate, epilogue
from readback.numerics.blockscale import BlockQTensor
from readback.numerics.formats import BF16
from readback.numerics.nvfp4 import NVFP4Tensor
from readback.numerics.rounding import QTensor, decode


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def use_scaled_mm(a: QTensor, b: QTensor) -> bool:
    """Real FP8 GEMM only on FP8-capable CUDA devices, for FP8 operands (not the BF16 sites) of
    the 2-D shapes it accepts (dimensions multiples of 16, at most one E5M2 operand)."""
    if a.data.device.type != "cuda" or not _has_fp8_tensor_cores(a.data.device.index or 0):
        return False
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.data.dtype not in fp8 or b.data.dtype not in fp8 or a.data.dim() != 2 or b.data.dim() != 2:
        return False
    both_e5m2 = a.data.dtype == b.data.dtype == torch.float8_e5m2
    return not both_e5m2 and all(n % 16 == 0 for n in (*a.data.shape, *b.data.shape))


# precision.bf16_gemm: how a BF16 GEMM runs off CUDA (``bf16_mm``); the first is the default
BF16_GEMMS = ("fp32", "native")


def bf16_mm(a: torch.Tensor, b: torch.Tensor, kernel: str) -> torch.Tensor:
    """``a @ b`` of operands that hold BF16 values (as BF16, or as FP32: ``decoded``) as a tensor
    core computes it: exact products, FP32 sums, the output rounded once to BF16; returned in FP32.

    ``kernel`` ``fp32`` runs it as an FP32 GEMM of the BF16 values (a BF16 x BF16 product is
    exact in FP32), at FP32 speed on any CPU; ``native`` as torch's BF16 GEMM, about 20x slower
    than FP32 on a CPU without BF16 instructions. The two differ only in the order of the FP32
    sums, where a sum falls on either side of a BF16 rounding boundary; neither is a GPU's order
    (tensor cores align blocks of products and truncate; cuBLAS may split K). CUDA runs its own
    BF16 kernel whatever ``kernel`` says.
    """
    if kernel not in BF16_GEMMS:
        raise ValueError(f"bf16_gemm={kernel!r}; valid: {BF16_GEMMS}")
    if kernel == "native" or a.device.type == "cuda":
        return torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()
    return torch.matmul(a.float(), b.float()).to(torch.bfloat16).float()


def fp8_mm(a: QTensor, b: QTensor, accumulation: str = "ieee", bf16_gemm: str = BF16_GEMMS[0]) -> torch.Tensor:
    """``a @ b`` of two quantized tensors in real units, rounded once to BF16, returned in FP32.

    Batched operands (``..., m, k``) are allowed. BF16 operands (the no-FP8 baseline and BF16
    sites) take ``bf16_mm`` with kernel ``bf16_gemm``; BF16 is never
    scaled, so nothing is applied afterwards. ``accumulation`` (``accumulation.MODES``) says how
    FP8 products are added: ``ieee`` in FP32 (on CUDA too: an FP32 GEMM of the decoded values),
    ``fast`` or ``split`` as Hopper's tensor cores do (the real kernel where it runs, with
    ``use_fast_accum`` for ``fast``).
    """
    if accumulation not in MODES:
        raise ValueError(f"unknown accumulation {accumulation!r}; valid: {MODES}")
    if accumulation != "ieee" and use_scaled_mm(a, b):
        out = torch._scaled_mm(
            a.data.contiguous(),
            b.data.t().contiguous().t(),  # column-major, as the kernel requires
            scale_a=a.scale_inv,
            scale_b=b.scale_inv,
            out_dtype=torch.bfloat16,
            use_fast_accum=accumulation == "fast",
        )
        return out.float()
    if a.fmt is BF16 and b.fmt is BF16:  # unscaled (round_bf16): no scale to apply
        return bf16_mm(a.data, b.data, bf16_gemm)
    clamps = _min_exponents(a, b)
    if accumulation != "ieee" and clamps is not None:
        acc = accumulate(a.data, b.data, accumulation, clamps)
        return epilogue(acc, a.scale_inv, b.scale_inv, torch.bfloat16).float()
    scale = a.scale_inv * b.scale_inv
    if a.data.dim() == 2 or a.data.shape[:-2] != b.data.shape[:-2]:
        return _decoded_product(a.data, b.data, scale)
    # A batch of products runs a block of matrices at a time (the same products, bit for bit),
    # so that the FP32 copies of the operands stay within DECODED_BLOCK elements (operands
    # decoded already take none).
    x, y = a.data.flatten(0, -3), b.data.flatten(0, -3)
    to_decode = sum(t[0].numel() for t in (x, y) if t.dtype != torch.float32)
    step = max(1, DECODED_BLOCK // to_decode) if to_decode else len(x)
    if step >= len(x):
        return _decoded_product(a.data, b.data, scale)
    out = torch.empty(len(x), x.shape[-2], y.shape[-1], device=x.device)
    for i in range(0, len(x), step):
        out[i : i + step] = _decoded_product(x[i : i + step], y[i : i + step], scale)
    return out.reshape(*a.data.shape[:-1], y.shape[-1])


DECODED_BLOCK = 1 << 20  # FP32 elements (4 MiB) of decoded operands per block of a batched product


def _decoded_product(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 GEMM of the codes' values (exact products, FP32 sums), scaled, rounded once to BF16.
    The scaling writes BF16: the product is computed in FP32 and rounded as it is stored (the
    bits of scaling in FP32 and then casting), a pass less over the output."""
    acc = accumulate(a, b, "ieee")
    return torch.mul(acc, scale, out=torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)).float()


def _min_exponents(a: QTensor, b: QTensor) -> tuple[int, int] | None:
    """The exponent clamps of two operands of FP8 values (codes, or decoded by ``decoded``);
    None if either is not FP8 (BF16, or not rounded)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.fmt is None or b.fmt is None or a.fmt.dtype not in fp8 or b.fmt.dtype not in fp8:
        return None
    return a.fmt.min_exponent, b.fmt.min_exponent


def native_accumulation(a: QTensor, b: QTensor) -> str:
    """What the device computes when nothing is asked: ``split`` (``torch._scaled_mm``'s default)
    where the FP8 kernel runs, else ``ieee``."""
    return "split" if use_scaled_mm(a, b) else "ieee"


def decoded(q: QTensor, bf16_gemm: str = BF16_GEMMS[0]) -> QTensor:
    """``q`` with its codes decoded to their FP32 values, for an operand that enters several
    emulated GEMMs (a gradient's dgrad and wgrad, attention's row blocks): each GEMM would
    decode it again. The values, and so every product, are the same. Unchanged where the GEMM
    takes the codes themselves: on CUDA, and BF16 under ``bf16_gemm`` ``native``."""
    if q.data.device.type == "cuda" or (q.fmt is BF16 and bf16_gemm == "native"):
        return q
    if q.data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        return q
    return q.map(lambda data: decode(data, torch.float32))


GEMM_PRECISIONS = ("fp8", "bf16", "fp32", "fp64")
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def block_mm(a: QTensor | BlockQTensor, b: QTensor | BlockQTensor) -> torch.Tensor:
    """``a @ b`` of block-scaled operands (one may be scaled per tensor): the readback model of a
    block-scaled GEMM, an FP32 GEMM of the operands' dequantised values (``decode(data) *
    scale_inv`` per block, FP32), rounded once to BF16, returned in FP32. It is not Hopper's or
    Blackwell's kernel bit for bit: those apply each block's scales to partial sums as they go
    along K and accumulate in an order (and precision) of their own. Two NVFP4 copies rotated
    along the reduction axis (a wgrad's) multiply as stored: the rotation cancels in their product."""
    if isinstance(a, NVFP4Tensor) and isinstance(b, NVFP4Tensor) and (a.rotated_axis, b.rotated_axis) == (1, 0):
        product = torch.matmul(a.stored_values(), b.stored_values())
    else:
        product = torch.matmul(a.dequantize(torch.float32), b.dequantize(torch.float32))
    return product.to(torch.bfloat16).float()


Operand = QTensor | BlockQTensor | torch.Tensor


def matmul(
    a: Operand,
    b: Operand,
    precision: str,
    accumulation: str = "native",
    bf16_gemm: str = BF16_GEMMS[0],
) -> torch.Tensor:
    """``a @ b`` in one of ``GEMM_PRECISIONS``; the result is FP32.

    ``fp8`` multiplies quantized operands (``QTensor``; FP8, or BF16 in the no-FP8 baseline),
    accumulating as ``accumulation`` says (``fp8_mm``; ``native``: ``native_accumulation``);
    the others multiply the operands' real values in that dtype (``fp64``: rounding switched off,
    for gradcheck and the FP64 reference). The result is FP32, or FP64 for ``fp64``. Every BF16
    GEMM runs as ``bf16_mm`` with kernel ``bf16_gemm`` (``BF16_GEMMS``).
    """
    if precision == "fp8":
        if isinstance(a, BlockQTensor) or isinstance(b, BlockQTensor):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                raise TypeError("matmul(precision='fp8') multiplies quantised tensors")
            return block_mm(a, b)
        if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
            raise TypeError("matmul(precision='fp8') multiplies QTensors")
        return fp8_mm(a, b, native_accumulation(a, b) if accumulation == "native" else accumulation, bf16_gemm)
    dtype = PRECISION_DTYPES[precision]
    if precision == "bf16":
        return bf16_mm(_bf16_values(a), _bf16_values(b), bf16_gemm)
    x, y = (t.to(dtype) if isinstance(t, torch.Tensor) else t.dequantize(dtype) for t in (a, b))
    return torch.matmul(x, y).to(torch.promote_types(dtype, torch.float32))


def _bf16_values(t: Operand) -> torch.Tensor:
    """``t``'s values rounded to BF16; a BF16 ``QTensor``'s data holds them already (as BF16, or
    as FP32 once ``decoded``)."""
    if isinstance(t, torch.Tensor):
        return t.to(torch.bfloat16)
    return t.data if t.fmt is BF16 else t.dequantize(torch.bfloat16)


class SplitK:
    """One GEMM ``sum_i a_i @ b_i`` whose K arrives in blocks, as a tiled kernel loops over K:
    each block's products are added into one accumulator (FP32; FP64 for ``fp64``) and the output
    is rounded once, at ``result``, as ``matmul`` rounds it; a block may cover only the first
    rows of the output (``rows``). With one block it is ``matmul``'s GEMM bit for bit, but for the
    BF16 kernel: BF16 values multiply as ``bf16_mm``'s ``fp32`` kernel whatever ``bf16_gemm`` says
    (torch's BF16 kernel rounds each call's output). FP8 operands take the ``ieee`` accumulation,
    with one scale for every block (each operand's scale is the whole tensor's)."""

    def __init__(self, shape: tuple[int, ...], precision: str, device: torch.device) -> None:
        self.precision = precision
        self.acc = torch.zeros(shape, dtype=torch.float64 if precision == "fp64" else torch.float32, device=device)
        self.scale: torch.Tensor | None = None  # both inverse scales of FP8 operands

    def add(self, a: QTensor | torch.Tensor, b: QTensor | torch.Tensor, rows: slice) -> None:
        """Add ``a @ b``'s products into the output's ``rows``."""
        if self.precision == "fp8":
            assert isinstance(a, QTensor) and isinstance(b, QTensor), "matmul(precision='fp8') multiplies QTensors"
            if a.fmt is BF16 and b.fmt is BF16:
                acc = torch.matmul(a.data.float(), b.data.float())
            else:
                acc, self.scale = accumulate(a.data, b.data, "ieee"), a.scale_inv * b.scale_inv
        elif self.precision == "bf16":
            acc = torch.matmul(_bf16_values(a).float(), _bf16_values(b).float())
        else:
            dtype = PRECISION_DTYPES[self.precision]
            x, y = (t.to(dtype) if isinstance(t, torch.Tensor) else t.dequantize(dtype) for t in (a, b))
            acc = torch.matmul(x, y)
        self.acc[..., rows, :] += acc

    def result(self) -> torch.Tensor:
        """The output, rounded as ``matmul`` rounds it (FP32; FP64 for ``fp64``); the accumulator
        is let go."""
        acc, self.acc = self.acc, torch.empty(0)
        if self.scale is not None:
            bf16 = torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)
            return torch.mul(acc, self.scale, out=bf16).float()
        if self.precision in ("fp8", "bf16"):
            return acc.to(torch.bfloat16).float()
        return acc
