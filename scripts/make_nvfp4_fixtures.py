"""Write tests/fixtures/nvfp4/nvfp4.npz: a grid of BF16 and FP32 tensors, the NVFP4 bits Transformer
Engine's Python reference gives for them, and torchao's NVFP4 bits beside.

    # a TE source tree: a checkout, or these files out of a TE git repository
    for f in build_tools/VERSION.txt transformer_engine/pytorch/custom_recipes/{reference_nvfp4,reference_utils,gemm}.py
    do mkdir -p "$TE_SRC/$(dirname $f)" && git -C "$TE_GIT" show "$TE_COMMIT:$f" > "$TE_SRC/$f"; done
    python scripts/make_nvfp4_fixtures.py --te-source "$TE_SRC" --te-label "VERSION (COMMIT)"

The reference is ``NVFP4QuantizerRef`` in TE's ``transformer_engine/pytorch/custom_recipes/
reference_nvfp4.py``, which tests/ check readback's NVFP4 quantiser against bit for bit without TE
installed. TE needs CUDA, so the script loads that file (with ``reference_utils.py`` and ``gemm.py``,
which it imports) from ``--te-source`` with importlib, after registering stand-ins for the modules of
TE's compiled library they import: ``transformer_engine.pytorch.quantized_tensor`` (``Quantizer``,
which keeps its rowwise/columnwise usage, and ``QuantizedTensorStorage``) and
``transformer_engine.pytorch.tensor.utils`` (``is_custom``). The script carries none of TE's code.
The committed file: TE 2.20.0.dev0 at d0067d0da6cb01811b8072a7d304f0e00344ce2b, torchao 0.18.0,
torch 2.13.0 on CPU, one thread.

The grid: 128 x 128 tensors. The cases of scripts/make_blockscale_fixtures.py's ``grid`` (``random``,
``zeros``, ``negzero``, ``subnormal``, ``top``, ``equal``, ``wide``; imported from that script), and
for NVFP4 (``nvfp4_cases``):

* ``wide16``: in every 16 elements of a row one huge value, (1..2) * 2**-(0..30), and one tiny,
  2**-(10..40) of the huge one, the rest N(0, 1/4) times the huge one: block amaxes from 2**-31 to 1
  of the tensor's, so the E4M3 block scales run through normals, subnormals and zero;
* ``blockrange``: N(0, 1) times 2**-k per 16-element block of a row, k uniform in 0..24;
* ``ties``: each 16 x 16 tile one E4M3 value s (half of them powers of two, tile (0, 0) 448); in a
  tile, +-6 s 2**j once in every row and column, +-(0.25, 0.75, 1.25, 1.75, 2.5, 3.5 or 5) s 2**j
  elsewhere. The tensor's amax is 6 * 448 * 2**j and every 1x16, 16x1 and 16x16 block's amax 6 s 2**j,
  so the block scale is s and the scaled elements land on E2M1's midpoints (exactly where s is a power
  of two; the script counts the hits);
* ``scaleties``: amax 6 * 1.5 * 448 * 2**j (the global encode scale, 2**-j / 1.5, is inexact) and each
  16-element block of a row an amax of 6 * 1.5 * h * 2**j with h halfway between two E4M3 values
  (subnormals' included), the rest uniform below it: the exact block scale is an E4M3 tie, so the
  FP32 rounding of its computation decides it;
* ``tiny``: every value below 448 * 6 / FP32's max (N(0, 1) times 2**-122 times 2**-(0..12) per
  block; an eighth BF16 subnormals), so the global encode scale 448 * 6 / amax overflows FP32.

Each case as BF16 (dtype ``bf16``); ``random``, ``wide16`` and ``blockrange`` also as FP32 (``fp32``:
the BF16 values with random low 16 mantissa bits; zeros stay zeros).

The configurations (``NVFP4QuantizerRef(dtype=Fp4Formats.E2M1, pow_2_scales=False, ...)``): ``1d``,
quant_tile_shape (1, 16), with_rht False; ``2d``, (16, 16), False; ``rht``, (1, 16), with_rht True
(with_random_sign_mask True). The RHT touches only the columnwise copy, so ``rht`` stores only that
(the script checks its rowwise copy is ``1d``'s).

Keys (``C`` the case, ``D`` ``bf16`` or ``fp32``; M = N = 128; every array C-contiguous):

* ``te_version``, ``torchao_version``: str (``--te-label``; torchao's ``__version__``); ``seed``: int64.
* ``{C}_{D}_x``: the input, M x N, int16 (BF16 bits) or int32 (FP32 bits).
* ``{C}_{D}_{cfg}_{dir}_data``, for ``1d`` and ``2d`` with ``rowwise`` and ``columnwise``, and
  ``rht`` with ``columnwise``: the E2M1 codes, uint8 0..15, one per element (bit 3 the sign, 0..7
  the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), unpacked from the reference's bytes (low nibble the
  even element). rowwise: M x N, of x; columnwise: N x M, of x.T (for ``rht``, of the RHT'd x.T).
* ``{C}_{D}_{cfg}_{dir}_scale``: the E4M3 block decode scales (to be multiplied by amax / (6 * 448)),
  uint8 codes, in the reference's layout: rowwise M x N/16 (row i, block b: elements 16b..16b+15 of
  row i of x), columnwise N x M/16 (the same of x.T); for ``2d`` the same shapes, each 16 x 16
  tile's scale repeated on its 16 rows.
* ``{C}_{D}_{cfg}_{dir}_amax``: float32, shape (1,): the reference's ``global_amax_row`` (rowwise)
  or ``global_amax_col`` (columnwise; for ``rht`` the RHT'd x.T's amax).
* ``{C}_{D}_rht_columnwise_x``: the RHT'd x.T that ``rht`` quantised (``_apply_rht(x.T)``), N x M,
  in the input's dtype (int16 or int32 bits): the CPU matmul's result. For BF16 inputs it is the
  exact product rounded once, except where products fall below FP32's normals (``subnormal``,
  ``wide``, ``tiny``); for FP32 inputs it depends on the summation order (the script prints the
  counts).
* ``{C}_{D}_torchao_rowwise_data`` / ``_scale``: torchao's ``nvfp4_quantize(x, 16,
  per_tensor_scale=per_tensor_amax_to_scale(max(|x|)))`` (1x16, no RHT, rowwise): codes as above,
  M x N, and E4M3 scale codes, M x N/16.

After writing, the script reads the file back and counts, by kind, where torchao's codes and scales
differ from the reference's 1d rowwise ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "nvfp4" / "nvfp4.npz"
SHAPE = (128, 128)
FP32_CASES = ("random", "wide16", "blockrange")
# name: (quant_tile_shape, with_rht, directions stored)
CONFIGS = {
    "1d": ((1, 16), False, ("rowwise", "columnwise")),
    "2d": ((16, 16), False, ("rowwise", "columnwise")),
    "rht": ((1, 16), True, ("columnwise",)),
}
DTYPES = {"bf16": (torch.bfloat16, torch.int16), "fp32": (torch.float32, torch.int32)}
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MIN_NORMAL_CODE = 0x08  # 2**-6, torch.finfo(torch.float8_e4m3fn).tiny
RECIPES = "transformer_engine.pytorch.custom_recipes"


def load_by_path(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def grid(seed: int) -> dict[str, torch.Tensor]:
    """The blockscale grid's cases, then ``nvfp4_cases``; BF16, each ``SHAPE``."""
    blockscale = load_by_path("make_blockscale_fixtures", ROOT / "scripts" / "make_blockscale_fixtures.py")
    if tuple(blockscale.SHAPE) != SHAPE:
        raise SystemExit(f"make_blockscale_fixtures.SHAPE is {blockscale.SHAPE}, not {SHAPE}")
    return {**blockscale.grid(seed), **nvfp4_cases(seed)}


def nvfp4_cases(seed: int) -> dict[str, torch.Tensor]:
    """``wide16``, ``blockrange`` and ``ties`` (see the docstring), BF16, each ``SHAPE``."""
    g = torch.Generator().manual_seed(seed + 1)
    m, k = SHAPE
    nb = k // 16

    def signs(*shape: int) -> torch.Tensor:
        return torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0).double()

    def pow2(exponents: torch.Tensor) -> torch.Tensor:
        return 2.0 ** exponents.double()

    def in_block(*shape: int) -> torch.Tensor:
        """A random column in each 16-element block: shape (..., nb), values 16b + 0..15."""
        return torch.arange(0, k, 16) + torch.randint(0, 16, shape, generator=g)

    cases = {}
    # wide16: per block, huge = (1..2) * 2**-e (e in 0..30), tiny = huge * 2**-(10..40), the rest
    # N(0, 1/4) times the huge one; all times one power of two for the tensor.
    huge = (1 + torch.rand(m, nb, generator=g).double()) * pow2(-torch.randint(0, 31, (m, nb), generator=g))
    tiny = huge * pow2(-torch.randint(10, 41, (m, nb), generator=g))
    wide16 = torch.randn(m, k, generator=g).double() / 4 * huge.repeat_interleave(16, 1)
    at_huge = in_block(m, nb)
    at_tiny = at_huge - at_huge % 16 + (at_huge % 16 + torch.randint(1, 16, (m, nb), generator=g)) % 16
    wide16.scatter_(1, at_huge, huge * signs(m, nb))
    wide16.scatter_(1, at_tiny, tiny * signs(m, nb))
    cases["wide16"] = wide16 * pow2(torch.randint(-20, 21, (), generator=g))
    # blockrange: N(0, 1) times 2**-k per 16-element block, k uniform in 0..24
    block_pow = pow2(-torch.randint(0, 25, (m, nb), generator=g)).repeat_interleave(16, 1)
    cases["blockrange"] = torch.randn(m, k, generator=g).double() * block_pow
    # ties: one E4M3 scale s per 16 x 16 tile (half of them powers of two, tile (0, 0) 448), a
    # permutation of +-6 s 2**j in it, +-midpoint * s 2**j elsewhere
    tiles = (m // 16, k // 16)
    codes = torch.randint(1, 0x7F, tiles, generator=g)  # every positive finite E4M3 code
    pow2_codes = torch.randint(1, 16, tiles, generator=g) * 8  # 2**-6 .. 2**8
    codes = torch.where(torch.rand(*tiles, generator=g) < 0.5, pow2_codes, codes)
    codes[0, 0] = 0x7E  # 448
    s = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    j = int(torch.randint(-20, 21, (), generator=g))
    mids = torch.tensor(MIDPOINTS, dtype=torch.float64)
    ties = mids[torch.randint(len(MIDPOINTS), (m, k), generator=g)]
    for tr in range(tiles[0]):
        for tc in range(tiles[1]):
            perm = torch.randperm(16, generator=g)
            ties[tr * 16 + torch.arange(16), tc * 16 + perm] = 6.0
    ties = ties * signs(m, k) * s.repeat_interleave(16, 0).repeat_interleave(16, 1) * 2.0**j
    cases["ties"] = ties
    # scaleties: the tensor's amax 6 * 1.5 * 2**j (so the global encode scale 2**-j / 1.5 is inexact)
    # and each 16-element block of a row an amax of 6 * 1.5 * m * 2**j, m halfway between two E4M3
    # values (those with 6 * 1.5 * m exact in BF16), the rest uniform below it
    halves = [(2 * i + 1) * 2.0**-10 for i in range(8)]  # between 0 and 2**-6 (subnormals)
    halves += [(16 + 2 * i + 1) / 16 * 2.0**e for e in range(-6, 9) for i in range(8)]
    halves = [h for h in halves if h < 448 and torch.tensor(9.0 * h).bfloat16().double() == 9.0 * h]
    j = int(torch.randint(-20, 21, (), generator=g))
    pick = torch.randint(len(halves), (m, nb), generator=g)
    block_max = 9.0 * 2.0**j * torch.tensor(halves, dtype=torch.float64)[pick]
    scaleties = torch.rand(m, k, generator=g).double() * 0.99 * block_max.repeat_interleave(16, 1)
    scaleties = scaleties.to(torch.bfloat16).double()
    scaleties.scatter_(1, in_block(m, nb), block_max)
    scaleties[0, 0] = 9.0 * 448 * 2.0**j
    cases["scaleties"] = scaleties * signs(m, k)
    # tiny: every value below 2688 / FP32's max, so 448 * 6 / amax overflows FP32: N(0, 1) times
    # 2**-122 times 2**-(0..12) per 16-element block, an eighth of them BF16 subnormals instead
    tiny = torch.randn(m, k, generator=g).double() * 2.0**-122
    tiny *= pow2(-torch.randint(0, 13, (m, nb), generator=g)).repeat_interleave(16, 1)
    subnormals = torch.randint(1, 128, (m, k), generator=g) * 2.0**-133 * signs(m, k)
    cases["tiny"] = torch.where(torch.rand(m, k, generator=g) < 0.125, subnormals, tiny)
    out = {name: x.to(torch.bfloat16) for name, x in cases.items()}
    for name in ("ties", "scaleties"):
        if not torch.equal(out[name].double(), cases[name]):
            raise SystemExit(f"{name}: values not exact in BF16")
    if not float(out["tiny"].abs().max()) < 448 * 6 / torch.finfo(torch.float32).max:
        raise SystemExit("tiny: amax too large")
    return out


def with_low_bits(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """BF16 ``x`` as FP32 with random low 16 mantissa bits (zeros stay zeros)."""
    bits = x.float().view(torch.int32) | torch.randint(0, 2**16, x.shape, generator=g, dtype=torch.int32)
    return torch.where(x == 0, x.float(), bits.view(torch.float32))


def load_reference(te_source: Path) -> Any:
    """TE's reference_nvfp4 module, run from ``te_source`` with stand-ins for the compiled library."""
    recipes_dir = te_source / "transformer_engine" / "pytorch" / "custom_recipes"
    for package in ("transformer_engine", "transformer_engine.pytorch", RECIPES, "transformer_engine.pytorch.tensor"):
        stub = types.ModuleType(package)
        stub.__path__ = []  # a package, but nothing else gets imported from it
        sys.modules[package] = stub

    class Quantizer:
        def __init__(self, rowwise: bool = True, columnwise: bool = True) -> None:
            self.rowwise_usage = rowwise
            self.columnwise_usage = columnwise

    class QuantizedTensorStorage:
        pass

    quantized_tensor = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
    quantized_tensor.Quantizer = Quantizer  # type: ignore[attr-defined]
    quantized_tensor.QuantizedTensorStorage = QuantizedTensorStorage  # type: ignore[attr-defined]
    sys.modules[quantized_tensor.__name__] = quantized_tensor
    utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    utils.is_custom = lambda x=None: bool(getattr(x, "custom", False))  # type: ignore[attr-defined]
    sys.modules[utils.__name__] = utils
    for name in ("reference_utils", "gemm", "reference_nvfp4"):
        module = load_by_path(f"{RECIPES}.{name}", recipes_dir / f"{name}.py")
        setattr(sys.modules[RECIPES], name, module)
    return sys.modules[f"{RECIPES}.reference_nvfp4"]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes holding two E2M1 codes (low nibble first) -> one code per element."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


class Reference:
    """Runs NVFP4QuantizerRef, keeping the scaled values it hands to its E2M1 cast."""

    def __init__(self, te_source: Path) -> None:
        self.ref = load_reference(te_source)
        self.utils = sys.modules[f"{RECIPES}.reference_utils"]
        self.scaled: list[torch.Tensor] = []
        cast: Callable[[torch.Tensor], torch.Tensor] = self.ref.cast_to_fp4x2

        def recording_cast(x: torch.Tensor) -> torch.Tensor:
            self.scaled.append(x.clone())
            return cast(x)

        self.ref.cast_to_fp4x2 = recording_cast

    def quantizer(self, config: str) -> Any:
        tile, rht, _ = CONFIGS[config]
        return self.ref.NVFP4QuantizerRef(
            dtype=self.utils.Fp4Formats.E2M1, quant_tile_shape=tile, pow_2_scales=False, with_rht=rht
        )

    def run(self, config: str, x: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """direction -> data (codes), scale (uint8), amax (float32, (1,)) and scaled (the
        reference's clipped scaled values, float32)."""
        self.scaled = []
        q = self.quantizer(config).quantize(x)
        rowwise, columnwise = self.scaled  # _quantize casts the rowwise copy first
        return {
            "rowwise": dict(
                data=unpack(q.data), scale=q.scale.view(torch.uint8), amax=q.global_amax_row, scaled=rowwise
            ),
            "columnwise": dict(
                data=unpack(q.data_t), scale=q.scale_t.view(torch.uint8), amax=q.global_amax_col, scaled=columnwise
            ),
        }

    def rht_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantizer("rht")._apply_rht(x.t().contiguous())


def torchao_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    amax = torch.max(torch.abs(x)).to(torch.float32)
    scale, packed = nvfp4_quantize(x.contiguous(), 16, per_tensor_scale=per_tensor_amax_to_scale(amax))
    return unpack(packed), scale.view(torch.uint8)


def scale_counts(scale: torch.Tensor) -> tuple[int, int, int, int]:
    """How many E4M3 scale codes are zero, subnormal, 448 and NaN."""
    mag = scale.to(torch.int32) & 0x7F
    return (
        int((mag == 0).sum()),
        int(((mag > 0) & (mag < E4M3_MIN_NORMAL_CODE)).sum()),
        int((mag == 0x7E).sum()),
        int((mag == 0x7F).sum()),
    )


def midpoint_hits(scaled: torch.Tensor) -> int:
    return int(torch.isin(scaled.abs(), torch.tensor(MIDPOINTS, dtype=scaled.dtype)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--te-source", type=Path, required=True, help="a TE source tree (holding transformer_engine/)")
    parser.add_argument("--te-label", help="what to record as TE's version (default: build_tools/VERSION.txt)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=33)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import torchao

    te_label = args.te_label or (args.te_source / "build_tools" / "VERSION.txt").read_text().strip()
    reference = Reference(args.te_source)
    arrays: dict[str, np.ndarray] = {
        "te_version": np.array(te_label),
        "torchao_version": np.array(torchao.__version__),
        "seed": np.array(args.seed, dtype=np.int64),
    }
    g = torch.Generator().manual_seed(args.seed + 2)
    inputs = {f"{case}_bf16": x for case, x in grid(args.seed).items()}
    for case in FP32_CASES:
        inputs[f"{case}_fp32"] = with_low_bits(inputs[f"{case}_bf16"], g)

    stored = [(config, direction) for config, (_, _, directions) in CONFIGS.items() for direction in directions]
    print("Per input and config/direction: E4M3 block scales zero, subnormal, 448, NaN (of 1024 scale entries),")
    print("E2M1 midpoint hits among the reference's scaled values (of 16384); rht exact: the recorded RHT'd")
    print("values equal to the float64 product with TE's Hadamard matrix rounded once (of 16384)")
    print(
        f"{'input':<16}"
        + "".join(f"| {f'{c} {d[:3]}':<8} zero  sub  448 NaN  mids " for c, d in stored)
        + "| rht exact"
    )
    totals: dict[tuple[str, str], list[torch.Tensor]] = {key: [] for key in stored}
    scaled: dict[str, torch.Tensor] = {}  # the reference's 1d rowwise scaled values, for the comparison
    for name, x in inputs.items():
        bits = DTYPES[name.rsplit("_", 1)[1]][1]
        arrays[f"{name}_x"] = x.view(bits).numpy()
        outs = {config: reference.run(config, x) for config in CONFIGS}
        row = f"{name:<16}"
        for config, direction in stored:
            out = outs[config][direction]
            for field in ("data", "scale", "amax"):
                arrays[f"{name}_{config}_{direction}_{field}"] = out[field].contiguous().numpy()
            totals[config, direction].append(out["scale"])
            counts = "".join(f"{n:5d}" for n in scale_counts(out["scale"]))
            row += f"| {'':<8}{counts[1:]} {midpoint_hits(out['scaled']):5d} "
        for field in ("data", "scale", "amax"):  # the RHT leaves the rowwise copy alone
            if not torch.equal(outs["rht"]["rowwise"][field], outs["1d"]["rowwise"][field]):
                raise SystemExit(f"{name}: the rht config's rowwise {field} is not the 1d one's")
        rht_x = reference.rht_input(x)
        again = reference.run("1d", rht_x)["rowwise"]  # the recorded RHT'd input gives the rht copy
        for field in ("data", "scale", "amax"):
            if not torch.equal(again[field], outs["rht"]["columnwise"][field]):
                raise SystemExit(f"{name}: quantising the recorded RHT'd input does not give the rht {field}")
        arrays[f"{name}_rht_columnwise_x"] = rht_x.contiguous().view(bits).numpy()
        hadamard = reference.quantizer("rht")._build_hadamard_matrix(16, x.device, torch.float64, True) / 4
        exact = (x.t().double().reshape(-1, 16) @ hadamard).reshape(rht_x.shape).to(x.dtype)
        print(f"{row}| {int((exact.view(bits) == rht_x.view(bits)).sum()):5d}")
        data, scale = torchao_rowwise(x)
        arrays[f"{name}_torchao_rowwise_data"] = data.numpy()
        arrays[f"{name}_torchao_rowwise_scale"] = scale.numpy()
        scaled[name] = outs["1d"]["rowwise"]["scaled"]

    print("\nPer config/direction, all inputs: elements, blocks; scales zero, subnormal, 448, NaN")
    for (config, direction), scales in totals.items():
        s = torch.stack(scales)
        blocks = s.numel() // 16 if config == "2d" else s.numel()
        zero, sub, top, nan = scale_counts(s)
        print(
            f"{config + ' ' + direction:<15} {s.numel() * 16:7d} {blocks:6d}; {zero:5d} {sub:5d} {top:5d} {nan:3d}"
            + (f" (of {s.numel()} entries: each tile's scale repeated over its 16 rows)" if config == "2d" else "")
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    size = args.out.stat().st_size
    print(f"\n{args.out}: {len(arrays)} arrays, {size} bytes, TE {te_label}, torchao {torchao.__version__}")
    compare(args.out, scaled)


def compare(path: Path, scaled: dict[str, torch.Tensor]) -> None:
    """torchao's rowwise codes and scales against the reference's 1d rowwise ones, as read from ``path``."""
    with np.load(path) as npz:
        f = {key: npz[key] for key in npz.files}
    print("\ntorchao against the TE reference, 1d rowwise. Scales differing (of 1024): all; TE's below 2**-6")
    print("where torchao's is 2**-6 (of TE's below 2**-6); TE's one E4M3 step above torchao's (of which the")
    print("exact scale is halfway between two E4M3 values); one step below; other. Codes differing (of 16384):")
    print("all; in blocks of differing scales; of equal scales: -0.0 in, TE 0 and torchao 8; TE's scaled value")
    print("within 4 FP32 ulps of an E2M1 midpoint; other.")
    names = [key[: -len("_x")] for key in f if key.endswith("_x") and not key.endswith("_rht_columnwise_x")]
    for name in names:
        bits = f[f"{name}_x"]
        x = torch.from_numpy(bits).view(torch.bfloat16 if bits.dtype == np.int16 else torch.float32)
        te_s = f[f"{name}_1d_rowwise_scale"].astype(np.int32)
        ao_s = f[f"{name}_torchao_rowwise_scale"].astype(np.int32)
        te_d, ao_d = f[f"{name}_1d_rowwise_data"], f[f"{name}_torchao_rowwise_data"]
        s_diff = te_s != ao_s
        below = te_s < E4M3_MIN_NORMAL_CODE
        clamped = s_diff & below & (ao_s == E4M3_MIN_NORMAL_CODE)
        up = s_diff & ~clamped & (te_s - ao_s == 1)
        down = s_diff & ~clamped & (te_s - ao_s == -1)
        other = s_diff & ~clamped & ~up & ~down
        # the exact block scale, 448 * 6 * block amax / (6 * amax), halfway between two E4M3 values?
        block_amax = x.double().abs().reshape(SHAPE[0], -1, 16).amax(-1).numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = block_amax * 448 / float(f[f"{name}_1d_rowwise_amax"][0])
            ulp = 2.0 ** (np.maximum(np.floor(np.log2(ratio)), -6) - 3)
            halfway = (ratio / ulp - 0.5) % 1 == 0
        d_diff = te_d != ao_d
        same = d_diff & ~np.repeat(s_diff, 16, axis=1)
        xf = x.float().numpy()
        negzero = same & (xf == 0) & np.signbit(xf) & (te_d == 0) & (ao_d == 8)
        v = scaled[name].abs().numpy().astype(np.float64)
        near = np.zeros_like(d_diff)
        for mid in MIDPOINTS:
            near |= np.abs(v - mid) <= 4 * np.spacing(np.float32(mid))
        tie = same & ~negzero & near
        print(
            f"{name:<16} scales {int(s_diff.sum()):4d} {int(clamped.sum()):4d} ({int(below.sum()):4d}) "
            f"{int(up.sum()):4d} ({int((up & halfway).sum()):4d}) {int(down.sum()):4d} {int(other.sum()):4d}"
            f"   codes {int(d_diff.sum()):5d} {int((d_diff & ~same).sum()):5d} {int(negzero.sum()):5d} "
            f"{int(tie.sum()):3d} {int((same & ~negzero & ~tie).sum()):3d}"
        )


if __name__ == "__main__":
    main()
