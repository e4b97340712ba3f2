"""``readback.convert`` on an ``nn.Sequential`` and on a tiny transformers Llama: forward equal
to the unconverted model with rounding off, gradients that read what the READS tables declare
(classified by the audit), the probe's ``exact`` policy equal to its reference, training, the
report, bad recipes, and torchao's emulated Float8Linear multiplying the same FP8 operands."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import readback
import toys
from readback.audit.core import audit
from readback.backends.converted import SDPARouter
from readback.errors import ConfigError
from readback.numerics.state import Numerics, Site
from readback.ops import linear as linear_op
from readback.ops import norm as norm_op
from specs import make_spec
from toys import REPO

# FP8 forward, FP32 backward GEMMs: what a gradient read is then told apart from GEMM round-off.
FP32_BACKWARD = {"recipe": "current", "override_linear_precision": [False, True, True]}


def sequential(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.LayerNorm(64),
        nn.Linear(64, 48, bias=False),
        nn.GELU(),
        nn.LayerNorm(48),
        nn.Linear(48, 16),
        nn.Linear(16, 3),
    )


class LossOf(nn.Module):
    """What the probe calls: ``model(x, target) -> loss`` and ``model.numerics``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net, self.numerics = net, net.numerics

    def forward(self, x, target):
        return F.mse_loss(self.net(x).float(), target)


def llama(seed: int = 0, vocab: int = 64) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (extra hf)")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        use_cache=False,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def converted_llama(seed=0, **kwargs):
    from readback.backends.hf import HFCausalLM

    lm = llama(seed)
    report = readback.convert(lm, filter=["lm_head"], **kwargs)
    return HFCausalLM(lm, report, seq_len=16), report


def tokens(seed: int = 0, batch: int = 2, seq: int = 16, vocab: int = 64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------
# nn.Sequential of Linear / LayerNorm


def test_sequential_with_rounding_off_equals_the_unconverted_model():
    reference = sequential()
    model = copy.deepcopy(reference)
    weights = dict(model.named_parameters())
    report = readback.convert(model, precision="off")
    assert dict(model.named_parameters()) == weights  # the very Parameters
    assert set(report.swapped) == {"0", "1", "2", "4", "5"}
    assert report.left == {"6": "shape (3, 16) not a multiple of 16"}
    assert type(model[6]) is nn.Linear and type(model[3]) is nn.GELU
    x = torch.randn(4, 7, 32, generator=torch.Generator().manual_seed(1))
    for net in (reference, model):
        net(x).square().sum().backward()
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    expected = grads(reference)
    for name, grad in grads(model).items():
        assert torch.allclose(grad, expected[name], rtol=1e-4, atol=1e-6), name


def test_sequential_fp8_gradients_read_what_the_rules_declare():
    """The linear after a LayerNorm multiplies the norm's rounded copy: its weight gradient reads
    that copy, the norm's gain gradient the unrounded normalised value (classified by the audit)."""
    model = sequential()
    readback.convert(model, precision=FP32_BACKWARD)
    numerics = model.numerics
    with numerics.taping() as tape:
        x = torch.randn(4, 7, 32, generator=torch.Generator().manual_seed(2))
        norm_out = {}
        model[1].register_forward_hook(lambda m, i, o: norm_out.setdefault("y", o).retain_grad())
        model[2].register_forward_hook(lambda m, i, o: norm_out.setdefault("dy", o).retain_grad())
        model(x).square().sum().backward()
    tape = dict(tape)
    assert "2.input" not in numerics.sites  # the copy came from the norm's site
    y, out = norm_out["y"], norm_out["dy"]
    copy_q = tape["2"]["input"]
    assert copy_q.scale.item() == numerics.site("1.output").state.scale_for(y).item()
    original = y.detach().reshape(-1, 64).double()
    rounded = copy_q.dequantize(torch.float64)
    d_out = out.grad.reshape(-1, 48).double()
    wgrad = {"rounded": d_out.mT @ rounded, "original": d_out.mT @ original}
    normalized = F.layer_norm(model[0](x).detach().double(), (64,))
    d_y = y.grad.reshape(-1, 64).double()
    gain = {
        "original": (d_y * normalized.reshape(-1, 64)).sum(0),
        "rounded": (d_y * (rounded - model[1].bias.double()) / model[1].weight.double()).sum(0),
    }
    rows = [
        *audit(
            "converted Linear after LayerNorm",
            "wgrad",
            model[2].weight.grad,
            wgrad["rounded"],
            wgrad,
            declared=linear_op.READS["exact"],
        ),
        *audit(
            "converted LayerNorm", "gain", model[1].weight.grad, gain["original"], gain, declared=norm_op.READS["exact"]
        ),
    ]
    assert [(r.reads, r.declared, r.ok) for r in rows] == [("rounded", "rounded", True), ("original", "original", True)]


def test_sequential_probe_exact_matches_its_reference():
    model = sequential()
    readback.convert(model, precision=FP32_BACKWARD, policy="exact")
    g = torch.Generator().manual_seed(3)
    x, target = torch.randn(4, 7, 32, generator=g), torch.randn(4, 7, 3, generator=g)
    errors = toys.probe(every=1).measure(LossOf(model), x, target)
    assert errors["grad_error/rel_err/total"] < 1e-5
    assert errors["grad_error/rel_err/net.2.weight"] < 1e-5


# ---------------------------------------------------------------------------------------------
# transformers Llama


def test_llama_with_rounding_off_equals_the_unconverted_model_and_reports_every_swap():
    reference = llama()
    model = copy.deepcopy(reference)
    report = readback.convert(model, precision="off", filter=["lm_head"])
    linears = {n for n, m in reference.named_modules() if isinstance(m, nn.Linear)} - {"lm_head"}
    norms = {n for n, m in reference.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    attention = {f"model.layers.{i}.self_attn" for i in range(2)}
    assert set(report.swapped) == linears | norms | attention
    assert report.left == {"model.embed_tokens": "unknown type Embedding", "lm_head": "filtered (lm_head)"}
    ids, targets = tokens()
    for lm in (reference, model):
        F.cross_entropy(lm(input_ids=ids).logits.flatten(0, 1), targets.flatten()).backward()
    assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert report.attention == dict.fromkeys(attention, 2)  # every SDPA call ran readback's op
    expected = grads(reference)
    got = grads(model)
    assert set(got) == set(expected)
    for name, grad in got.items():
        assert torch.allclose(grad, expected[name], rtol=1e-3, atol=1e-6), name


def _o_proj_audit(policy: str):
    model, _ = converted_llama(precision=FP32_BACKWARD, policy=policy, attention_bwd_precision="fp32")
    numerics = model.numerics
    with numerics.taping() as tape:
        seen = {}
        o_proj = model.lm.model.layers[0].self_attn.o_proj
        o_proj.register_forward_hook(lambda m, i, o: seen.setdefault("out", o).retain_grad())
        model(*tokens()).backward()
    record = dict(tape)["model.layers.0.self_attn.core"]
    d_out = seen["out"].grad.reshape(-1, 64).double()
    candidates = {
        "rounded": d_out.mT @ record["output"].dequantize(torch.float64).reshape(-1, 64),
        "original": d_out.mT @ record["out"].double().reshape(-1, 64),
    }
    rows = audit(
        "converted o_proj",
        "wgrad",
        o_proj.weight.grad,
        candidates["rounded"],
        candidates,
        declared=linear_op.READS[policy],
    )
    moments = numerics.observations.moments["attn_rowsum/model.layers.0.self_attn.core"]
    return rows[0], (moments[2] / moments[0]).sqrt().item()


def test_llama_fp8_o_proj_reads_the_cores_o8_and_the_d_term_follows_the_policy():
    """The output projection multiplies the attention core's O8 (wgrad reads it); under
    ``no_saved_copy`` every row of dS sums to 0, under ``reuse_rounded`` it does not."""
    row, rowsum_exact = _o_proj_audit("no_saved_copy")
    assert (row.reads, row.declared, row.ok) == ("rounded", "rounded", True)
    row, rowsum_reuse = _o_proj_audit("reuse_rounded")
    assert row.ok is True
    assert rowsum_exact < 1e-9 and rowsum_reuse > 1e3 * rowsum_exact


def test_llama_probe_exact_matches_its_reference_and_reuse_rounded_does_not():
    ids, targets = tokens(4)
    errors = {}
    for policy in ("exact", "reuse_rounded"):
        model, _ = converted_llama(precision=FP32_BACKWARD, policy=policy, attention_bwd_precision="fp32")
        errors[policy] = toys.probe(every=1).measure(model, ids, targets)
    assert errors["exact"]["grad_error/rel_err/total"] < 1e-5
    q_proj = "grad_error/rel_err/lm.model.layers.0.self_attn.q_proj.weight"
    assert errors["reuse_rounded"][q_proj] > 100 * max(errors["exact"][q_proj], 1e-9)


def test_llama_fp8_trains_20_steps():
    model, _ = converted_llama(precision={"recipe": "delayed", "amax_history_len": 16}, policy="reuse_rounded")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, targets = tokens(5, batch=4)
    losses = []
    for _ in range(20):
        loss = model(ids, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.numerics.end_step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_filter_patterns_leave_whole_subtrees():
    model = llama()
    report = readback.convert(model, filter=["lm_head", "model.layers.1*"])
    assert all(not n.startswith("model.layers.1") for n in report.swapped)
    assert report.left["model.layers.1.mlp.up_proj"] == "filtered (model.layers.1*)"
    assert type(model.model.layers[1].mlp.up_proj) is nn.Linear


def test_a_filter_pattern_naming_no_module_is_refused_listing_the_modules_before_any_swap():
    model = llama()
    with pytest.raises(ConfigError) as error:
        readback.convert(model, filter=["lm_head", "model.layer.1*"])
    line = str(error.value)
    assert (error.value.key, error.value.value) == ("filter", "model.layer.1*") and "\n" not in line
    assert "e.g. model.embed_tokens, model.layers.*.self_attn.q_proj," in line and "lm_head" in line
    assert not hasattr(model, "numerics") and type(model.model.layers[0].mlp.up_proj) is nn.Linear


# ---------------------------------------------------------------------------------------------
# what is refused or left


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MaskedAttention()

    def forward(self, x, mask=None):
        return self.attn(x, mask)


def test_sdpa_calls_readback_cannot_express_run_torchs_sdpa_and_are_reported():
    model = Net()
    reference = copy.deepcopy(model)
    report = readback.convert(model, precision="off")
    assert report.swapped["attn"].startswith("SDPA -> readback.ops.attention")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.allclose(model(x, mask), reference(x, mask), atol=1e-6)
    assert report.attention_left == {"attn": "an attn_mask (readback's op is causal, mask-free)"}
    assert report.attention == {}
    assert torch.allclose(model(x), reference(x), atol=1e-6)
    assert report.attention == {"attn": 1}
    assert not isinstance(F.scaled_dot_product_attention, SDPARouter)  # torch's again after the forward


@pytest.mark.parametrize(
    "precision, key",
    [
        ({"marginn": 1}, "precision"),
        ({"fp8_format": "E5M2"}, "precision.fp8_format"),
        ({"amax_history_len": 0}, "precision.amax_history_len"),
        ({"override_linear_precision": [True]}, "precision.override_linear_precision"),
        ("fp4", "precision.name"),
    ],
)
def test_a_bad_recipe_is_one_line_naming_the_key(precision, key):
    with pytest.raises(ConfigError) as error:
        readback.convert(sequential(), precision=precision)
    assert error.value.key == key and "\n" not in str(error.value) and "valid:" in str(error.value)


def test_a_bad_policy_or_backend_is_refused():
    with pytest.raises(ConfigError, match="policy='reuse'"):
        readback.convert(sequential(), policy="reuse")
    with pytest.raises(ConfigError, match="backend='tex'"):
        readback.convert(sequential(), backend="tex")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_te_backend_without_cuda_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="needs CUDA and transformer_engine"):
        readback.convert(sequential(), backend="te")


# ---------------------------------------------------------------------------------------------
# torchao


def test_converted_linear_multiplies_torchaos_fp8_operands_bit_for_bit(monkeypatch):
    """Current (tensorwise, dynamic) scaling and nearest rounding: the FP8 codes and scales of
    input, weight (forward) and output gradient (backward) that readback's converted Linear
    multiplies are those of torchao's emulated Float8Linear."""
    pytest.importorskip("torchao", reason="torchao not installed (extra dev)")
    import torchao.float8.float8_linear as ao_linear
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(7)
    reference = nn.Sequential(nn.Linear(64, 32, bias=False))
    ao, ours = copy.deepcopy(reference), copy.deepcopy(reference)
    convert_to_float8_training(ao, config=Float8LinearConfig(emulate=True))
    readback.convert(ours, precision={"recipe": "current", "fp8_format": "HYBRID"})
    casts = {}
    original_cast = ao_linear.hp_tensor_to_float8_dynamic

    def spy(tensor, *args, **kwargs):
        out = original_cast(tensor, *args, **kwargs)
        casts.setdefault(kwargs["gemm_input_role"].name, out)  # the first cast of each role
        return out

    monkeypatch.setattr(ao_linear, "hp_tensor_to_float8_dynamic", spy)
    rounded = {}  # readback's: every QTensor its sites produced, by site
    site_quantize = Site.quantize

    def record_site(site, tensor, *args, **kwargs):
        rounded[site.name] = site_quantize(site, tensor, *args, **kwargs)
        return rounded[site.name]

    monkeypatch.setattr(Site, "quantize", record_site)
    g = torch.Generator().manual_seed(8)
    x, upstream = torch.randn(8, 16, 64, generator=g) * 3, torch.randn(8, 16, 32, generator=g)
    ao(x).backward(upstream)
    ours(x).backward(upstream)
    mine = {
        role: (rounded[f"0.{site}"].data, rounded[f"0.{site}"].scale)
        for role, site in (("INPUT", "input"), ("WEIGHT", "weight"), ("GRAD_OUTPUT", "grad_output"))
    }
    mine["WEIGHT"] = (mine["WEIGHT"][0].t(), mine["WEIGHT"][1])  # torchao casts the transposed weight
    assert set(casts) >= set(mine)
    for role, (codes, scale) in mine.items():
        theirs = casts[role]
        assert theirs._data.dtype == codes.dtype, role
        their_codes = theirs._data.reshape(codes.shape).view(torch.uint8)
        assert torch.equal(their_codes, codes.contiguous().view(torch.uint8)), role
        assert theirs._scale.item() == scale.item(), role


def test_the_own_model_pages_example_runs():
    pytest.importorskip("transformers", reason="transformers not installed (extra hf)")
    section = (REPO / "docs/own_model.md").read_text()
    code = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    namespace: dict = {}
    exec(
        compile(
            code.replace("print(report)", "first = model.model.layers[0].self_attn.q_proj"), "own_model.md", "exec"
        ),
        namespace,
    )
    assert type(namespace["first"]).__name__ == "ConvertedLinear"
    assert namespace["loss"].item() < 5.5  # from ln(256) = 5.55 at the start


def test_readbacks_own_modules_are_not_converted_again():
    """FOG is built from the parts the converter swaps in, and a converted model has them: both
    are refused; a FOG inside another model is left as it is."""
    from readback.model import FOG, FOGConfig

    fog = FOG(
        FOGConfig(n_layers=1, d_model=32, n_heads=2, n_kv_groups=1, ffn_dim=48, vocab_size=64, seq_len=8),
        Numerics(make_spec("off")),
    )
    model = sequential()
    readback.convert(model)
    for converted in (fog, model):
        with pytest.raises(ConfigError, match="converted, or built from readback's parts"):
            readback.convert(converted)
    report = readback.convert(nn.ModuleDict({"fog": fog, "head": nn.Linear(32, 16)}), precision="off")
    assert report.swapped == {"head": "Linear -> readback.ops.linear"} and report.left == {}


def test_hf_model_counts_the_flops_of_every_linear():
    model, _ = converted_llama()
    c = model.lm.config
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q, o; k, v (2 KV heads of 16); gate, up, down
    expected = 6 * (2 * per_layer + 64 * 64) + 6 * c.num_hidden_layers * 16 * 64
    assert model.flops_per_token() == expected
