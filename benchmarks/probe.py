"""Cost of the gradient probe relative to a plain training step (forward + backward).

    python benchmarks/probe.py [--model tiny] [--experiment reuse_rounded] [--repeats 1 4] [--steps 5]

Prints the median milliseconds of a plain step and of a probe with K repeats, and their ratio.
A probe with K repeats runs K executed forward/backward passes and K reference replays. A probed
step, as the trainer runs it in one process, is a taped training step whose backward the probe
takes as repeat 0: the step, K reference replays and K - 1 executed passes.
"""

import argparse
import dataclasses
import functools

import torch
from hydra import compose, initialize_config_dir

from readback.backends import build_model
from readback.config import CONF_DIR, typed
from readback.probe import GradientProbe, train_taped
from readback.stopping import ends_on_ctrl_c
from timing import median_ms


@ends_on_ctrl_c("benchmarks/probe.py")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--experiment", default="reuse_rounded")
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = typed(
            compose(
                "train", overrides=[f"model={args.model}", f"+experiment={args.experiment}", "model.vocab_size=2048"]
            )
        )
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 2048, (args.batch, cfg.model.seq_len))
    y = x.roll(-1, 1)

    def step():
        model(x, y).backward()
        model.zero_grad(set_to_none=True)

    plain = median_ms(step, args.steps)
    print(
        f"{args.model} {args.experiment}, batch {args.batch} x {cfg.model.seq_len}, {torch.get_num_threads()} threads"
    )
    print(f"  plain step (forward + backward)   {plain:9.1f} ms   1.00x")
    for k in args.repeats:
        probe = GradientProbe(dataclasses.replace(cfg.probe, every=1, repeats=k))

        def probed_step(probe=probe):
            probe.measure(model, x, y, train_taped(model, x, y)[1])
            model.zero_grad(set_to_none=True)

        ms = median_ms(functools.partial(probe.measure, model, x, y), args.steps)
        print(f"  probe, repeats={k:<2}                {ms:9.1f} ms   {ms / plain:5.2f}x")
        ms = median_ms(probed_step, args.steps)
        print(f"  probed step, repeats={k:<2}          {ms:9.1f} ms   {ms / plain:5.2f}x")


if __name__ == "__main__":
    main()
