"""Emulated FP8 GEMM: the one place where FP8 operands are multiplied.

Operands are exact FP8-grid values, so multiplying them as BF16 is exact; the BF16 matmul
accumulates in FP32 and writes BF16, like Transformer Engine's FP8 GEMMs, and the inverse scales
are applied afterwards. On Hopper GPUs ``torch._scaled_mm`` runs the same product as a real FP8
GEMM (never on CPU, where it is correct but about 10,000x slower).
"""

from __future__ import annotations

import functools

import torch

from readback.numerics.rounding import QTensor


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


def fp8_mm(a: QTensor, b: QTensor) -> torch.Tensor:
    """``a @ b`` of two quantized tensors in real units: the BF16-rounded product, scaled, in FP32.

    Batched operands (``..., m, k``) are allowed. On Hopper the real FP8 kernel applies the
    scales before its single BF16 rounding; the emulation rounds the unscaled product to BF16
    first, so the two can differ by one BF16 ulp.
    """
    if use_scaled_mm(a, b):
        out = torch._scaled_mm(
            a.data.contiguous(),
            b.data.t().contiguous().t(),  # column-major, as the kernel requires
            scale_a=a.scale_inv,
            scale_b=b.scale_inv,
            out_dtype=torch.bfloat16,
        )
        return out.float()
    product = torch.matmul(a.data.to(torch.bfloat16), b.data.to(torch.bfloat16))
    return product.float() * (a.scale_inv * b.scale_inv)


GEMM_PRECISIONS = ("fp8", "bf16", "fp32", "fp64")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def matmul(a: QTensor | torch.Tensor, b: QTensor | torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` in one of ``GEMM_PRECISIONS``; the result is FP32.

    ``fp8`` multiplies quantized operands (``QTensor``; FP8, or BF16 in the no-FP8 baseline);
    the others multiply the operands' real values in that dtype (``fp64``: rounding switched off,
    for gradcheck and the FP64 reference). The result is FP32, or FP64 for ``fp64``.
    """
    if precision == "fp8":
        return fp8_mm(a, b)
    dtype = _DTYPES[precision]
    values = [t.dequantize(dtype) if isinstance(t, QTensor) else t.to(dtype) for t in (a, b)]
    return torch.matmul(*values).to(torch.promote_types(dtype, torch.float32))
