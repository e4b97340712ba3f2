"""Time Hopper's emulated FP8 accumulation (fast, split) against IEEE FP32, per GEMM of a FOG step.

    python benchmarks/accumulation.py                     # tiny FOG, micro-batch 16 x 128 tokens
    python benchmarks/accumulation.py --model small --rounds 3 --threads 2

Each GEMM of a training step's linears (qkv, proj, up, down, the tied LM head; fprop, dgrad and
wgrad, shapes from conf/model/<model>.yaml) runs as ``fp8_mm`` on random FP8 operands (E4M3
inputs and weights, E5M2 gradients) in each accumulation, the modes alternating within one loop
of ``--rounds`` rounds, so that a busy machine slows them alike; the table gives each median and
its ratio to ``ieee``. ``hopper`` is the recipe's mix: ``fast`` for fprop, ``split`` for dgrad and
wgrad; the last lines add up each mode's medians over the step's GEMMs (times ``n_layers`` for
the blocks' linears), without the LM head, which the study's recipe keeps in BF16
(``precision.bf16_layers: [lm_head]``), and with it. ``--step`` also times whole training steps
(forward, backward, ``end_step``) of the reuse_rounded experiment under
``precision.accumulation=ieee`` and ``=hopper``, alternating.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from readback.backends import build_model
from readback.config import CONF_DIR, typed
from readback.numerics import E4M3, E5M2, QTensor, fp8_mm
from readback.stopping import ends_on_ctrl_c

MODES = ("ieee", "fast", "split")
HOPPER = {"fprop": "fast", "dgrad": "split", "wgrad": "split"}


def gemm_shapes(model: str, tokens: int, vocab: int) -> list[tuple[str, str, int, int, int]]:
    """``(linear, gemm, m, k, n)`` of every GEMM of one step's linears, for ``tokens`` tokens."""
    c = OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml")
    hd = c.d_model // c.n_heads
    linears = {
        "qkv": (c.d_model, (c.n_heads + 2 * c.n_kv_groups) * hd),
        "proj": (c.n_heads * hd, c.d_model),
        "up": (c.d_model, c.ffn_dim),
        "down": (c.ffn_dim, c.d_model),
        "lm_head": (c.d_model, vocab),
    }
    shapes = []
    for name, (d_in, d_out) in linears.items():
        # y = x W^T; dx = dy W; dW = dy^T x
        shapes += [(name, "fprop", tokens, d_in, d_out), (name, "dgrad", tokens, d_out, d_in)]
        shapes.append((name, "wgrad", d_out, tokens, d_in))
    return shapes


def operands(gemm: str, m: int, k: int, n: int, generator: torch.Generator) -> tuple[QTensor, QTensor]:
    """Random FP8 operands in the formats a linear's GEMM multiplies: a gradient (E5M2) is the
    left operand of dgrad and wgrad."""
    left = E4M3 if gemm == "fprop" else E5M2

    def q(shape: tuple[int, int], fmt) -> QTensor:
        x = (torch.randn(shape, generator=generator) * fmt.max / 8).clamp(-fmt.max, fmt.max)
        return QTensor(x.to(fmt.dtype), torch.tensor(64.0), fmt)

    return q((m, k), left), q((k, n), E4M3)


def interleaved_ms(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each case, the cases alternating within each round (one warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(model: str, tokens: int, vocab: int, rounds: int, seed: int = 0) -> list[dict]:
    """One row per GEMM: its shape and the median milliseconds of each mode."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for name, gemm, m, k, n in gemm_shapes(model, tokens, vocab):
        a, b = operands(gemm, m, k, n, generator)
        cases = {mode: functools.partial(fp8_mm, a, b, accumulation=mode) for mode in MODES}
        rows.append(dict(linear=name, gemm=gemm, m=m, k=k, n=n, **interleaved_ms(cases, rounds)))
    return rows


def step_totals(rows: list[dict], n_layers: int, head: bool = False) -> dict[str, float]:
    """Each mode's milliseconds summed over a step's GEMMs, and ``hopper``'s (fast fprop, split
    dgrad and wgrad); the LM head's only if ``head`` (an FP8 head)."""
    count = {row["linear"]: int(head) if row["linear"] == "lm_head" else n_layers for row in rows}
    totals = {mode: sum(count[r["linear"]] * r[mode] for r in rows) for mode in MODES}
    totals["hopper"] = sum(count[r["linear"]] * r[HOPPER[r["gemm"]]] for r in rows)
    return totals


def step_ms(model: str, micro_batch: int, vocab: int, rounds: int) -> dict[str, float]:
    """Median milliseconds of a training step under ``precision.accumulation`` ``ieee`` and
    ``hopper``, the two alternating."""
    steps = {}
    for mode in ("ieee", "hopper"):
        overrides = [f"model={model}", "+experiment=reuse_rounded", f"model.vocab_size={vocab}"]
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = typed(compose("train", overrides=[*overrides, f"precision.accumulation={mode}"]))
        torch.manual_seed(0)
        fog = build_model(cfg)
        x = torch.randint(0, vocab, (micro_batch, cfg.model.seq_len))

        def step(fog=fog, x=x) -> None:
            fog(x, x.roll(-1, 1)).backward()
            fog.numerics.end_step()
            fog.zero_grad(set_to_none=True)

        steps[mode] = step
    return interleaved_ms(steps, rounds)


@ends_on_ctrl_c("benchmarks/accumulation.py")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048, help="the tied head's rows (the Shakespeare tokenizer's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step", action="store_true", help="also time whole training steps, ieee against hopper")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    c = OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml")
    tokens = args.micro_batch * c.seq_len
    rows = measure(args.model, tokens, args.vocab, args.rounds)
    print(
        f"{args.model}, {args.micro_batch} x {c.seq_len} tokens, median of {args.rounds} interleaved rounds, "
        f"{args.threads} thread(s), torch {torch.__version__}"
    )
    header = ["ieee ms", "fast ms", "split ms", "fast/ieee", "split/ieee"]
    print(f"  {'GEMM':<15}{'m x k x n':>18}" + "".join(f"{h:>11}" for h in header))
    for r in rows:
        shape = f"{r['m']}x{r['k']}x{r['n']}"
        print(
            f"  {r['linear'] + ' ' + r['gemm']:<15}{shape:>18}{r['ieee']:11.2f}{r['fast']:11.2f}{r['split']:11.2f}"
            f"{r['fast'] / r['ieee']:11.1f}{r['split'] / r['ieee']:11.1f}"
        )
    for head in (False, True):
        totals = step_totals(rows, c.n_layers, head)
        print(
            f"  a step's GEMMs ({'FP8' if head else 'BF16'} LM head): "
            + ", ".join(f"{mode} {ms:.0f} ms" for mode, ms in totals.items())
            + f"; hopper / ieee {totals['hopper'] / totals['ieee']:.1f}"
        )
    if args.step:
        steps = step_ms(args.model, args.micro_batch, args.vocab, args.rounds)
        print(
            f"  training step (reuse_rounded): ieee {steps['ieee']:.0f} ms, hopper {steps['hopper']:.0f} ms; "
            f"hopper / ieee {steps['hopper'] / steps['ieee']:.1f}"
        )


if __name__ == "__main__":
    main()
