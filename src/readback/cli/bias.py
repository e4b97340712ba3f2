"""``python -m readback.cli.bias CHECKPOINT_OR_RUN_DIR [--batches N] [--out DIR] [--dtype fp64|fp32]
[--site-margin PATTERN=K ...] [--sweep-margin PATTERN=K1,K2,...] [--accumulation NAME]
[--accumulation-gemm GEMM=MODE ...] [--precision KEY=VALUE ...] [--attention KEY=VALUE ...]
[--parts [BACKWARD,...]]``

Loads a training checkpoint (its directory, or a run directory's newest intact one: each is
verified as a resume verifies it, a damaged one skipped with a warning), and runs the bias meter at its
weights and FP8 scales on the run's first N validation batches; writes ``bias.json``,
``bias.md`` and ``bias.png`` to DIR (default ``<run dir>/bias/step<step>``) and prints the
table's total rows.

``--site-margin PATTERN=K`` (repeatable) replaces the run's own ``precision.site_margin``: the
meter runs with the given margins only (K=0: none at the matched sites, the scale as the
recipe sets it). A pattern given twice keeps its last K; overlapping patterns add at the sites
both match, as the config's margins do. Default DIR then ``<run dir>/bias/step<step>-<margins>``.
``--sweep-margin PATTERN=K1,K2,...`` runs the meter once per K with PATTERN=K added to the
``--site-margin`` ones (replacing one of the same pattern): ``bias.*`` in DIR/margin<K>, and
``dose.json``, ``dose.png`` in DIR (default ``<run dir>/bias/step<step>-dose-<PATTERN>``).

``--precision KEY=VALUE`` (repeatable; VALUE read as YAML) replaces a ``precision`` key, e.g.
``recipe=nvfp4`` or ``disable_2d_quantization=true``: the meter runs the checkpoint's weights
under another recipe, checked as the config checks it (with its own default ``fp8_format``
unless one is given). A recipe other than the run's starts
from fresh scaling states (block and current scales come from the tensors themselves); a
change to delayed scaling from another recipe, of the linears or of the attention core, is
refused (no amax history to start from), but a one-step history (a current-scaling attention's
P and dS) starts as in training, from one forward and backward of the first validation batch.
Default DIR then gets ``-precision-<KEY=VALUE,...>`` appended. ``--attention KEY=VALUE`` likewise
replaces an ``attention`` key, e.g. ``round_grad_output=false`` (a part of the backward set apart):
``-attention-<KEY=VALUE,...>``.

``--accumulation NAME`` and ``--accumulation-gemm GEMM=MODE`` replace the run's
``precision.accumulation`` and its per-GEMM overrides (``hopper``: the linears' forward GEMMs
add as Hopper's fast accumulation, dgrad and wgrad as its split one); the meter then attributes
the backward GEMMs' accumulation (``contrib.ieee_acc.dgrad``, ``contrib.ieee_acc.wgrad``).
Default DIR then gets ``-acc-<NAME>`` appended.

``--parts`` meters the reuse against each part of the attention backward instead of the reads
one at a time (``readback.bias.backward_parts``): ``reuse_rounded``, ``fresh_reround`` and ``no_saved_copy`` under
TE's FP8 and BF16 backwards and under each backward between them that ``--parts`` names (default
all: each part switched alone from either end, and D's dO for D's 2 x 2), with each part's
interaction with the reuse paired within the batch. Default DIR then gets ``-parts`` appended.
``--seq-len T`` meters at sequences of T tokens (the model's positions are rotary: any T runs;
the scaling states are still the run's, from its own T): ``-T<T>``.

Exit code 2, one line on stderr, when there is no intact checkpoint to read or a margin is refused (a
pattern that matches no site of the run, a K below 0, a run without FP8 sites).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from pathlib import Path

from readback.cli.bias_options import (
    accumulation_keys,
    accumulation_label,
    group_keys,
    group_label,
    label,
    parse_margin,
    part_variants_of,
    single_margin,
)
from readback.errors import ConfigError, require
from readback.probe.settings import DTYPES
from readback.stopping import ends_on_ctrl_c


def load_run(
    path: Path,
    site_margin: dict[str, int] | None = None,
    precision: dict | None = None,
    attention: dict | None = None,
    seq_len: int | None = None,
):
    """``(model, stream, step, run_dir)`` from a checkpoint or a run directory's newest one; with
    ``site_margin`` the model's numerics are built from the run's config with its
    ``precision.site_margin`` replaced by that mapping (``ConfigError`` if a pattern matches no
    site the run rounded at); with ``precision`` (e.g. ``{accumulation: NAME}``, ``{recipe:
    nvfp4}``) those keys replaced, and so the ``attention`` group's with ``attention``, checked as
    the config checks them; under another recipe the scaling states start fresh (module docstring);
    with ``seq_len`` the model reads (and the stream serves) sequences of that length."""
    from readback.backends import build_model
    from readback.config import check_site_margin, from_saved
    from readback.data import build_data
    from readback.overrides import with_current_keys
    from readback.train.checkpoint import (
        checkpoint_dir,
        is_checkpoint,
        list_checkpoints,
        load_checkpoint,
        load_latest_checkpoint,
        verify,
    )

    if is_checkpoint(path):
        verify(path)
    else:
        ckpt_dir = checkpoint_dir(path) if list_checkpoints(checkpoint_dir(path)) else path
        found = load_latest_checkpoint(ckpt_dir, move_damaged=False)  # a reader leaves the run as it is
        if found is None:
            raise FileNotFoundError(f"no intact checkpoint in {path} (nor in {checkpoint_dir(path)})")
        path = found[0]
    state = load_checkpoint(path)
    saved, numerics_state = state["config"], state["ranks"][0]["numerics"]
    if seq_len is not None:
        saved = {**saved, "model": {**saved["model"], "seq_len": seq_len}}
    cfg = from_saved(saved)
    replaced = dict(precision or {})
    if "recipe" in replaced and "fp8_format" not in replaced:
        replaced["fp8_format"] = None  # the new recipe's own default, not the run's
    if site_margin is not None:  # a new config whose margins replace the run's (a merge would add them)
        check_site_margin(site_margin, cfg, list(numerics_state["sites"]), key="--site-margin")  # the run's sites
        replaced["site_margin"] = dict(site_margin)
    if replaced or attention:
        saved = with_current_keys(saved)
        groups = {
            "precision": {**saved["precision"], **replaced},
            "attention": {**saved["attention"], **(attention or {})},
        }
        cfg = from_saved({**saved, **groups})
    stream = build_data(cfg.data, cfg.layout(rank=0, world_size=1))
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    recipe = cfg.precision.recipe if hasattr(cfg.precision, "recipe") else None
    same_core = cfg.attention.recipe == with_current_keys(saved)["attention"].get("recipe")
    if recipe == saved["precision"].get("recipe") and same_core:
        model.numerics.load_state_dict(numerics_state)
    else:
        _start_histories(model, stream, recipe)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return model, stream, int(state["step"]), run_dir


def _start_histories(model, stream, recipe: str | None) -> None:
    """Fresh scaling states under another recipe than the run's: refused where a delayed history
    longer than one step would start empty (this run has none to give); a history of one step (a
    current-scaling attention's P and dS, ``numerics.spec.DELAYED_UNDER_CURRENT``) gets what
    training would hold, the previous step's amax, from one forward and backward of the first
    validation batch (weights untouched)."""
    from readback.numerics import DelayedScaling
    from readback.numerics.spec import ATTENTION_SITES

    spec = model.numerics.spec
    recipes = [spec.recipe, *(spec.recipe_for(f"core.{site}") for site in ATTENTION_SITES)] if spec.recipe else []
    delayed = [r for r in recipes if isinstance(r, DelayedScaling)]
    if any(r.amax_history_len > 1 for r in delayed):
        key, value = (
            ("--precision recipe", recipe)
            if isinstance(spec.recipe, DelayedScaling)
            else ("attention.recipe", "delayed")
        )
        raise ConfigError(key, value, "another than delayed (this run has no amax history to give)")
    if delayed:
        inputs, targets = next(iter(stream.val_batches(1)))
        model(inputs, targets).backward()
        model.zero_grad(set_to_none=True)
        model.numerics.end_step()


@ends_on_ctrl_c("python -m readback.cli.bias")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m readback.cli.bias", description=__doc__.split("\n\n")[1])
    parser.add_argument("path", type=Path, metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("--batches", type=int, default=8, help="validation batches to average over (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp64", help="precision of the reference replay")
    parser.add_argument(
        "--show",
        default="total,*.attn.qkv",
        help="comma-separated globs of the groups printed (the files have all; default total,*.attn.qkv)",
    )
    parser.add_argument(
        "--site-margin",
        action="append",
        default=None,
        metavar="PATTERN=K",
        help="replace the run's site margins (repeatable; the last K of a pattern counts)",
    )
    parser.add_argument("--sweep-margin", default=None, metavar="PATTERN=K1,K2,...", help="one meter per K")
    parser.add_argument(
        "--precision", action="append", default=[], metavar="KEY=VALUE", help="replace a precision key (repeatable)"
    )
    parser.add_argument(
        "--attention", action="append", default=[], metavar="KEY=VALUE", help="replace an attention key (repeatable)"
    )
    parser.add_argument("--seq-len", type=int, default=None, metavar="T", help="meter at sequences of T tokens")
    parser.add_argument(
        "--parts",
        nargs="?",
        const="",
        default=None,
        metavar="BACKWARD,...",
        help="meter the reuse under each part of the attention backward (default all backwards)",
    )
    parser.add_argument("--accumulation", default=None, metavar="NAME", help="replace precision.accumulation")
    parser.add_argument(
        "--accumulation-gemm",
        action="append",
        default=[],
        metavar="GEMM=MODE",
        help="replace precision.accumulation_gemms (repeatable; e.g. dgrad=ieee)",
    )
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.exit(2, f"{parser.prog}: error: --batches must be >= 1, got {args.batches}\n")
    if args.seq_len is not None and args.seq_len < 2:
        parser.exit(2, f"{parser.prog}: error: --seq-len must be >= 2, got {args.seq_len}\n")
    os.environ.setdefault("MPLBACKEND", "Agg")
    from readback.train.checkpoint import Damaged

    try:
        args.accumulation_keys = accumulation_keys(args.accumulation, args.accumulation_gemm)
        args.precision_keys = group_keys("precision", args.precision)
        args.attention_keys = group_keys("attention", args.attention)
        replaced = group_label("precision", args.precision) + group_label("attention", args.attention)
        replaced += "" if args.parts is None else "-parts"
        replaced += "" if args.seq_len is None else f"-T{args.seq_len}"
        args.part_variants = part_variants_of(args.parts)
        given = None if args.site_margin is None else dict(single_margin(parse_margin(m)) for m in args.site_margin)
        sweep = parse_margin(args.sweep_margin) if args.sweep_margin else None
        if sweep is None:
            suffix = "" if given is None else "-" + label(",".join(f"{p}={k}" for p, k in given.items()))
            suffix += accumulation_label(args.accumulation_keys) + replaced
            _measure(args, given, lambda run_dir, step: args.out or run_dir / "bias" / f"step{step}{suffix}")
            return 0
        pattern, margins = sweep
        points, dose_dir = [], args.out
        for k in margins:

            def out_for(run_dir: Path, step: int, k: int = k) -> Path:
                dose = f"step{step}-dose-{label(pattern)}{accumulation_label(args.accumulation_keys)}"
                dose += replaced
                base = args.out or run_dir / "bias" / dose
                return base / f"margin{k}"

            result, out = _measure(args, {**(given or {}), pattern: k}, out_for, shown=False)
            points.append((k, result, out.name))
            dose_dir = out.parent
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except (OSError, Damaged, RuntimeError, KeyError) as error:
        parser.exit(2, f"{parser.prog}: error: cannot read a checkpoint at {args.path}: {error}\n")
    from readback.bias.dose import combine, write_dose

    paths = write_dose(combine(pattern, points), dose_dir)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _measure(args, site_margin: dict[str, int] | None, out_for, shown: bool = True):
    """The meter on ``args.path`` under ``site_margin`` (None: the run's own), written to
    ``out_for(run_dir, step)``; prints the ``--show`` rows when ``shown``. ``(result, its directory)``."""
    from readback.bias import measure_bias
    from readback.bias.backward_parts import part_contrasts
    from readback.bias.report import to_markdown, write
    from readback.train.records.identity import code_version, cpu_kind

    precision = (args.accumulation_keys or {}) | args.precision_keys
    model, stream, step, run_dir = load_run(args.path, site_margin, precision, args.attention_keys, args.seq_len)
    start = time.perf_counter()
    batches = list(stream.val_batches(args.batches))
    if args.part_variants is None:
        result = measure_bias(model, batches, dtype=DTYPES[args.dtype])
    else:  # the backwards between TE's two are an FP8 forward's
        precision = model.numerics.spec.precision.name
        require(
            precision == "fp8", "--parts", args.parts or "every backward", f"a run with an FP8 forward, not {precision}"
        )
        result = measure_bias(model, batches, args.part_variants, DTYPES[args.dtype], contrasts=part_contrasts)
    result.info = {
        "checkpoint_step": step,
        "run_dir": str(run_dir),
        "site_margin_from": "checkpoint" if site_margin is None else "command line",
        "accumulation": list(model.numerics.spec.accumulation),
        "precision_from_command_line": args.precision_keys,
        "attention_from_command_line": args.attention_keys,
        "seq_len_from_command_line": args.seq_len,
        "code": code_version(),
        "cpu": cpu_kind(),  # kinds differ in bits: one meter's variants all run on this one
    }
    out = out_for(run_dir, step)
    paths = write(result, out)
    if shown:
        groups = [g for g in result.groups if any(fnmatch.fnmatchcase(g, p) for p in args.show.split(","))]
        print(to_markdown(result, groups=groups or ["total"]))
    print(f"wrote {', '.join(str(p) for p in paths.values())} ({time.perf_counter() - start:.1f} s)")
    return result, out


if __name__ == "__main__":
    sys.exit(main())
