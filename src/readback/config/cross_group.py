"""The rules between config groups, which no single group's dataclass can check: the batch split
against the model, the learning-rate floor, the vocabulary against the data, and what FP8 asks of
the model and the backend. ``readback.config.validate`` runs them once every group has checked
its own ranges.
"""

from __future__ import annotations

from collections.abc import Mapping

from readback.backends.attention_kernel import kernel_cannot_run
from readback.errors import ConfigError, require
from readback.numerics import DelayedScaling
from readback.numerics.precision_settings import Fp8Settings, amax_spike_of, underflow_words
from readback.ops import attention_triton, numerics_spec
from readback.train.settings import Config

FP8_ALIGNMENT = 16  # FP8 GEMMs need every dimension divisible by 16


def check_between_groups(cfg: Config) -> None:
    """Raise ``ConfigError`` (one line) for the first rule between groups that ``cfg`` breaks."""
    m, t = cfg.model, cfg.trainer
    require(
        m.global_batch % t.micro_batch == 0,
        "trainer.micro_batch",
        t.micro_batch,
        f"a divisor of model.global_batch={m.global_batch}",
    )
    require(t.optim.min_lr <= m.lr, "trainer.optim.min_lr", t.optim.min_lr, f"a number in [0, model.lr = {m.lr}]")
    require(
        m.vocab_size is None or m.vocab_size >= cfg.data.vocab_size,
        "model.vocab_size",
        m.vocab_size,
        f"null (the data's) or an integer >= data.vocab_size={cfg.data.vocab_size}",
    )
    cfg.numerics.check()
    if cfg.attention.kernel == "triton":
        _check_triton(cfg)
    if isinstance(cfg.precision, Fp8Settings):
        _check_fp8(cfg, cfg.precision)


def _check_triton(cfg: Config) -> None:
    """``attention.kernel=triton`` where the kernel runs: on CUDA or in the interpreter, under
    settings, a head dim and instruments that it runs."""
    reason = kernel_cannot_run(cfg.numerics) or attention_triton.cannot_run_here()
    require(reason is None, "attention.kernel", cfg.attention.kernel, f"ops ({reason})")
    head_dim = cfg.model.d_model // cfg.model.n_heads
    require(
        attention_triton.runs_head_dim(head_dim),
        "attention.kernel",
        cfg.attention.kernel,
        f"ops (the triton kernel's tiles need a power-of-two head dim of 16 or more; model head_dim is {head_dim})",
    )
    require(
        not cfg.probe.bias_every,
        "attention.kernel",
        cfg.attention.kernel,
        "ops (with probe.bias_every: the bias meter's variants run FP32 attention backwards, not the kernel's)",
    )


def _check_fp8(cfg: Config, p: Fp8Settings) -> None:
    from readback.model.fog import rounding_owners, rounding_sites

    m = cfg.model
    for key, value in (
        ("model.d_model", m.d_model),
        ("model.ffn_dim", m.ffn_dim),
        ("model head_dim", m.d_model // m.n_heads),
    ):
        require(value % FP8_ALIGNMENT == 0, key, value, f"a multiple of {FP8_ALIGNMENT} under precision=fp8")
    sites = rounding_sites(m.n_layers)
    if p.site_margin is not None:
        check_site_margin(p.site_margin, cfg, sites)
    _check_amax_spike(cfg, p, sites)
    if p.site_margin is not None or p.amax_spike is not None:
        _check_margin_sums(cfg, p, sites)
    require(
        cfg.backend.name == "emulated" or (p.accumulation == "native" and not p.accumulation_gemms),
        "precision.accumulation",
        p.accumulation,
        "native with backend=te (Transformer Engine's GPU accumulates as it does)",
    )
    owners = rounding_owners(m.n_layers)
    for entry in p.bf16_layers:
        matches = any(o.startswith(entry) or entry.startswith(o + ".") for o in owners)
        require(
            matches,
            "precision.bf16_layers",
            entry,
            f"names of layers or sites, e.g. lm_head, layers.0.attn, layers.{m.n_layers - 1}.mlp.down",
        )


def check_site_margin(
    site_margin: Mapping[str, object], cfg: Config, sites: list[str], key: str = "precision.site_margin"
) -> None:
    """The rules of site margins, ``precision.site_margin``'s and the bias meter's
    ``--site-margin`` alike: a mapping of site patterns under precision=fp8 with backend=emulated,
    each matching one of ``sites``, to margins >= 0 (what the margins add up to at each site:
    :func:`_check_margin_sums`)."""
    from readback.numerics.site_patterns import require_site_pattern

    require(
        isinstance(site_margin, dict) and all(isinstance(k, str) for k in site_margin),
        key,
        site_margin,
        "a mapping {site pattern: margin}, e.g. {attn.core.output: 14}",
    )
    require(
        isinstance(cfg.precision, Fp8Settings),
        key,
        dict(site_margin),
        "null under precision=bf16 (no FP8 scale to divide)",
    )
    require(
        cfg.backend.name == "emulated",
        key,
        dict(site_margin),
        "null with backend=te (Transformer Engine has one margin per recipe)",
    )
    for pattern, margin in site_margin.items():
        require_site_pattern(key, pattern, sites)
        require_margin(f"{key}.{pattern}", margin)


def require_margin(key: str, margin: object) -> None:
    """``ConfigError`` naming ``key`` unless ``margin`` is a site margin: an integer >= 0."""
    require(isinstance(margin, int) and not isinstance(margin, bool) and margin >= 0, key, margin, "an integer >= 0")


def _check_amax_spike(cfg: Config, p: Fp8Settings, sites: list[str]) -> None:
    """An amax spike needs readback's own sites (``NumericsSettings.check``: delayed scaling), a
    step after which the run still trains, and a pattern that matches FP8 ``sites`` of the model
    that keep a history (BF16 sites, and sites scaled otherwise under another ``attention.recipe``,
    it also matches are left alone, as by ``precision.site_margin``)."""
    from readback.numerics.site_patterns import require_site_pattern
    from readback.numerics.spec import in_bf16_layers

    spike = amax_spike_of(p.amax_spike)  # its shape: checked with the group
    if spike is None:
        return
    value = dict(p.amax_spike)
    require(
        cfg.backend.name == "emulated",
        "precision.amax_spike",
        value,
        "null with backend=te (Transformer Engine keeps its own amax history)",
    )
    steps = cfg.trainer.steps
    require(
        spike.step < steps,
        "precision.amax_spike.step",
        spike.step,
        f"an integer in [1, {steps - 1}]: a spike at step t lowers the scale from step t + 1 on, "
        f"and trainer.steps={steps}",
    )
    require_site_pattern("precision.amax_spike.site", spike.site, sites)
    spec = numerics_spec(cfg.numerics)  # which recipe, and so which history, each site has
    fp8_sites = [s for s in sites if not in_bf16_layers(s, p.bf16_layers)]
    require_site_pattern(
        "precision.amax_spike.site",
        spike.site,
        fp8_sites,
        "site patterns (globs) matching FP8 sites (those in precision.bf16_layers have no amax history):",
    )
    require_site_pattern(
        "precision.amax_spike.site",
        spike.site,
        [s for s in fp8_sites if isinstance(spec.recipe_for(s), DelayedScaling)],
        f"site patterns (globs) matching sites with an amax history (precision.recipe={p.recipe}, "
        f"attention.recipe={cfg.attention.recipe}):",
    )


def _check_margin_sums(cfg: Config, p: Fp8Settings, sites: list[str]) -> None:
    """``precision.margin`` plus the site margins matching a site, and an amax spike's ``k``
    there (for ``amax_history_len`` steps it lowers the scale as a margin of ``k`` would), against
    the bound of the site's format (``FP8Format.zero_margin``); the largest of them is refused."""
    from readback.model.fog import is_gradient_site
    from readback.numerics.site_patterns import site_matches
    from readback.numerics.spec import in_bf16_layers

    spike = amax_spike_of(p.amax_spike)
    spec = numerics_spec(cfg.numerics)
    for site in sites:
        if in_bf16_layers(site, p.bf16_layers):
            continue  # BF16 sites are unscaled: no margin applies
        fmt = spec.recipe_for(site).fp8_format  # the attention recipe's at the attention core's sites
        site_fmt = fmt.bwd if is_gradient_site(site) else fmt.fwd
        margins = {pattern: k for pattern, k in (p.site_margin or {}).items() if site_matches(site, pattern)}
        spiked = spike.k if spike is not None and site_matches(site, spike.site) else 0
        matched = {f"precision.site_margin.{pattern}": k for pattern, k in margins.items()}
        matched |= {"precision.amax_spike.k": spiked} if spiked else {}
        total = p.margin + sum(matched.values())
        if matched and total >= site_fmt.zero_margin:
            key = max(matched, key=matched.__getitem__)
            parts = f"precision.margin={p.margin}"
            parts += f" + site margins {' + '.join(str(k) for k in margins.values())}" if margins else ""
            parts += f" + amax_spike.k {spiked}" if spiked else ""
            raise ConfigError(
                key,
                matched[key],
                f"margins adding up to at most {site_fmt.zero_margin - 1} at the {site_fmt} site {site} (here "
                f"{parts} = {total}): " + underflow_words(site_fmt),
            )
