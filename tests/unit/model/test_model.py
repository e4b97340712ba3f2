"""The FOG architecture: each feature of DESIGN.md section 3, and the sizes' parameter counts."""

import math

import pytest
import torch

from readback.backends import build_model
from readback.model import ActivationStats, kurtosis
from readback.model.fog import FOG, FOGConfig, Parts, rope, rotation, rounding_owners
from readback.numerics.state import Numerics
from readback.ops.activation import BETA, EPS
from specs import make_spec
from toys import config as compose
from toys import train_on_one_batch

VOCAB_128 = ("data=synthetic", "data.vocab_size=128", "model.vocab_size=128")


def _tiny(precision="off", **kw):
    cfg = FOGConfig(n_layers=2, d_model=32, n_heads=4, n_kv_groups=2, ffn_dim=48, vocab_size=64, seq_len=8, **kw)
    torch.manual_seed(0)
    return FOG(cfg, Numerics(make_spec(precision)))


@pytest.mark.parametrize(
    "size, expected",
    [("fog_390m", 385_908_768), ("fog_1p5b", 1_543_569_440), ("fog_8b", 8_053_325_888)],
)
def test_parameter_counts_of_fog_sizes_on_meta(size, expected):
    model = build_model(compose(f"model={size}"), "meta")
    assert next(model.parameters()).device.type == "meta"
    assert model.n_params() == expected


def test_390m_count_from_the_architecture():
    """The count above, worked out from the table: tied 131072 x 1024 embedding, 16 layers."""
    d, hd, ffn = 1024, 128, 6144
    per_layer = d * (8 + 2 * 4) * hd + 8 * hd * d + 2 * d * ffn + 2 * d + 2
    assert build_model(compose("model=fog_390m"), "meta").n_params() == 131072 * d + 16 * per_layer


def test_untied_sizes_have_a_separate_head():
    model = build_model(compose("model=fog_1p5b"), "meta")
    assert model.lm_head is not None and model.lm_head.weight.shape == (131072, 2048)
    assert build_model(compose("model=fog_390m"), "meta").lm_head is None


def test_post_norm_before_residual_add_and_gain_init():
    model = _tiny()
    block = model.layers[0]
    assert torch.allclose(block.attn_norm.gain, torch.full((32,), 1 / math.sqrt(2)))
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    attn_out = block.attn(x)
    mid = x + block.attn_norm(attn_out)
    expected = mid + block.mlp_norm(block.mlp(mid))
    assert torch.allclose(block(x), expected)
    # The residual stream itself is never normalised: scaling the input scales the skip path.
    normed = attn_out * torch.rsqrt(attn_out.pow(2).mean(-1, keepdim=True) + 1e-6) * block.attn_norm.gain
    assert torch.allclose(mid - x, normed)


def test_qk_norm_gains_are_frozen():
    model = _tiny()
    names = [n for n, _ in model.named_parameters()]
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    assert not any("q_norm" in n or "k_norm" in n for n in model.state_dict())
    for norm in (model.layers[0].attn.q_norm, model.layers[0].attn.k_norm):
        assert not norm.gain.requires_grad and torch.equal(norm.gain, torch.ones(8))


def test_embeddings_are_multiplied_by_50_and_there_is_no_final_norm():
    model = _tiny()
    idx = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        x = model.embedding[idx].double() * 50
        for block in model.layers:
            x = block(x)
        logits = x @ model.embedding.double().t()  # tied head straight on the last block's output
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        assert torch.allclose(model(idx, idx), expected)


def test_xielu_parameters_start_at_0_8():
    act = _tiny().layers[0].mlp.act
    assert torch.nn.functional.softplus(act.p).item() == pytest.approx(0.8)
    assert (BETA + torch.nn.functional.softplus(act.n)).item() == pytest.approx(0.8)


def test_xielu_values_and_gradient_in_the_model():
    act = _tiny().layers[0].mlp.act
    x = torch.tensor([-3.0, -1e-7, 0.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    y = act(x)
    a = 0.8
    expected = [
        a * math.expm1(-3.0) + 3 * a - 1.5,
        a * math.expm1(EPS) + a * 1e-7 - 0.5e-7,
        a * math.expm1(EPS),
        a * 0.25 + 0.25,
        a * 4 + 1,
    ]
    assert torch.allclose(y, torch.tensor(expected, dtype=torch.float64))
    y.sum().backward()
    slope = [a * math.exp(-3.0) - a + 0.5, -a + 0.5, -a + 0.5, 2 * a * 0.5 + 0.5, 2 * a * 2 + 0.5]
    assert torch.allclose(x.grad, torch.tensor(slope, dtype=torch.float64))


def test_rope_rotates_pairs_and_keeps_norms():
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    y = rope(x, 500000.0)
    assert torch.allclose(y[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    angle = 1.0  # position 1, first pair: frequency base**0 = 1
    rotated = torch.stack(
        [
            x[..., 1, 0] * math.cos(angle) - x[..., 1, 1] * math.sin(angle),
            x[..., 1, 0] * math.sin(angle) + x[..., 1, 1] * math.cos(angle),
        ],
        -1,
    )
    assert torch.allclose(y[..., 1, :2], rotated)


def _rope_angles(seq: int, dim: int) -> torch.Tensor:
    """RoPE's angles (T, dim / 2) in FP64 at base 500000, from the formula."""
    positions = torch.arange(float(seq), dtype=torch.float64)
    return torch.outer(positions, 500000.0 ** (-torch.arange(0, dim, 2.0, dtype=torch.float64) / dim))


def test_rope_is_the_pairwise_rotation_bit_for_bit_and_so_is_its_gradient():
    """The swap form computes the same products and sums as rotating each pair from slices."""
    x = torch.randn(2, 3, 16, 8, requires_grad=True)
    angles = _rope_angles(16, 8)
    cos, sin = angles.cos().float(), angles.sin().float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    pairwise = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    y = rope(x, 500000.0)
    assert torch.equal(y.view(torch.int32), pairwise.view(torch.int32))
    dy = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, dy)
    (pairwise_grad,) = torch.autograd.grad(pairwise, x, dy)
    assert torch.equal(grad, pairwise_grad)  # values (a zero's sign may differ: slices' backward adds +0)


def test_gqa_groups_and_no_biases():
    model = _tiny()
    qkv = model.layers[0].attn.qkv.weight
    assert qkv.shape == ((4 + 2 * 2) * 8, 32)
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())


def test_softmax_scale_is_0_125():
    assert _tiny().cfg.softmax_scale == 0.125


def test_model_gradcheck_with_rounding_off():
    """Every custom backward together, in float64: the norm gains, the xIELU scalars and one
    attention projection (each element perturbed, so the tensors are kept small)."""
    model = _tiny().double()
    idx = torch.randint(0, 64, (1, 8))
    block = model.layers[1]
    params = [block.attn_norm.gain, block.mlp.act.p, block.mlp.act.n, block.attn.proj.weight]
    torch.autograd.gradcheck(lambda *_: model(idx, idx), params, eps=1e-6, atol=1e-5, fast_mode=True)


def test_kurtosis_of_gaussian_and_outliers():
    torch.manual_seed(0)
    assert kurtosis(torch.randn(64, 4096)) == pytest.approx(3.0, abs=0.1)
    spiky = torch.randn(64, 4096)
    spiky[:, 0] = 100
    assert kurtosis(spiky) > 100


def test_fog_takes_every_linear_norm_core_and_activation_from_its_parts():
    made = []

    class Recording(Parts):  # a backend that hands out readback's modules and says which it made
        def linear(self, d_in, d_out, name, std):
            made.append(name)
            return super().linear(d_in, d_out, name, std)

        def norm(self, dim, gain, name, eps, frozen=False):
            made.append(name + (" (frozen)" if frozen else ""))
            return super().norm(dim, gain, name, eps, frozen)

        def attention_core(self, cfg, name, index):
            made.append(name)
            return super().attention_core(cfg, name, index)

    cfg = FOGConfig(n_layers=1, d_model=32, n_heads=4, n_kv_groups=2, ffn_dim=48, vocab_size=64, seq_len=8, tied=False)
    numerics = Numerics(make_spec("off"))
    model = FOG(cfg, numerics, Recording(numerics))
    names = ["qkv", "q_norm (frozen)", "k_norm (frozen)", "core", "proj"]
    assert made == [
        *(f"layers.0.attn.{n}" for n in names),
        "layers.0.attn_norm",
        "layers.0.mlp.up",
        "layers.0.mlp.down",
        "layers.0.mlp_norm",
        "lm_head",
    ]
    assert model.numerics is numerics and model.parts.numerics is numerics


def test_activation_stats_hooks_measure_every_layer_only_when_active():
    model = _tiny()
    stats = ActivationStats(model)
    idx = torch.randint(0, 64, (2, 8))
    seen = {"attn_out": [], "ffn_in": []}
    for block in model.layers:  # the tensors the hooks must see, recomputed by hand
        block.attn.core.register_forward_hook(lambda m, i, out: seen["attn_out"].append(kurtosis(out[0])))
        block.mlp.register_forward_pre_hook(lambda m, i: seen["ffn_in"].append(kurtosis(i[0])))
    model(idx, idx)
    assert stats.pop() == {}  # inactive: nothing measured
    stats.active = True
    loss = model(idx, idx)
    measured = stats.pop()
    assert measured == {f"kurtosis/{k}_max": max(v[-2:]) for k, v in seen.items()}
    assert len(seen["attn_out"]) == 4 and stats.pop() == {}  # two layers per forward; popped once
    assert loss.dim() == 0  # the model returns its loss only


@pytest.mark.parametrize("experiment", ["reuse_rounded", "bf16_baseline"])
def test_tiny_model_learns(experiment):
    """A few steps on a fixed batch lower the loss in FP8 and in BF16 alike."""
    cfg = compose(f"+experiment={experiment}", *VOCAB_128)
    torch.manual_seed(0)
    model = build_model(cfg)
    losses = train_on_one_batch(model, torch.randint(0, 128, (4, 32)), steps=15)
    assert losses[-1] < losses[0] - 0.5


def test_lm_head_stays_bf16_under_fp8():
    model = build_model(compose("+experiment=reuse_rounded", *VOCAB_128))
    model(torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16)))
    sites = model.numerics.sites
    assert sites["lm_head.weight"].fmt.name == "BF16"
    assert sites["layers.0.attn.qkv.weight"].fmt.name == "E4M3"
    assert sites["layers.0.attn.core.output"].fmt.name == "E4M3"


def test_flops_per_token_counts_gemms_and_attention():
    model = build_model(compose("model=fog_390m"), "meta")
    gemm = 16 * (1024 * 2048 + 1024 * 1024 + 2 * 1024 * 6144) + 131072 * 1024
    assert model.flops_per_token() == 6 * gemm + 6 * 16 * 4096 * 1024


@pytest.mark.parametrize("tied", [True, False])
def test_rounding_owners_are_the_ops_whose_sites_a_step_rounds(tied):
    """``precision.bf16_layers`` is checked against ``rounding_owners``: every site a forward and
    backward round belongs to one of them, and each of them rounds at least one site."""
    model = _tiny("fp8", tied=tied)
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    sites = list(model.numerics.sites)
    owners = rounding_owners(model.cfg.n_layers)
    assert all(any(s.startswith(o + ".") for o in owners) for s in sites), sites
    assert all(any(s.startswith(o + ".") for s in sites) for o in owners), owners


def test_rope_tables_are_computed_once_per_shape_and_are_the_fp64_formula():
    first = rotation(7, 8, 500000.0, torch.device("cpu"), torch.float32)
    again = rotation(7, 8, 500000.0, torch.device("cpu"), torch.float32)
    assert all(a is b for a, b in zip(first, again))  # kept, not recomputed
    angles = _rope_angles(7, 8)
    cos, sin = angles.cos().float(), angles.sin().float()
    assert torch.equal(first[0][:, 0::2], cos) and torch.equal(first[0][:, 1::2], cos)
    assert torch.equal(first[1][:, 0::2], -sin) and torch.equal(first[1][:, 1::2], sin)
    bf16 = rotation(7, 8, 500000.0, torch.device("cpu"), torch.bfloat16)
    # one rounding from FP64
    assert bf16[0].dtype == torch.bfloat16 and torch.equal(bf16[0][:, 1::2], angles.cos().bfloat16())
