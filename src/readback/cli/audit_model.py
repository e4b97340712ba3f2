"""``python -m readback.cli.audit_model {fog,hf,torchao,MODULE:FUNCTION} [--out DIR]``

Audits one training step of a model: ``fog`` (readback's FOG, its executed FP8 forward), ``hf``
(a tiny Hugging Face Llama, no download), ``torchao`` (a torchao float8-training MLP), or any
``MODULE:FUNCTION`` returning ``(model, loss_fn)``. Writes ``audit.json``, ``audit.md`` and
``audit.png`` to DIR (default ``audit_model/<name>``) and prints the table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from readback.stopping import ends_on_ctrl_c


@ends_on_ctrl_c("python -m readback.cli.audit_model")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m readback.cli.audit_model", description=__doc__.split("\n\n")[1])
    parser.add_argument("model", metavar="fog|hf|torchao|MODULE:FUNCTION")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default audit_model/<name>)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    from readback.audit_model import EXAMPLES, audit_saved, to_markdown, write
    from readback.audit_model.examples import missing

    if args.model in EXAMPLES:
        build, package = EXAMPLES[args.model]
        reason = missing(package) if package else None
        if reason:
            parser.exit(2, f"{parser.prog}: error: model {args.model!r} needs {reason}\n")
    elif ":" in args.model:
        module, function = args.model.split(":", 1)
        try:
            build = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as error:
            parser.exit(2, f"{parser.prog}: error: cannot load {args.model!r}: {error}\n")
    else:
        parser.exit(2, f"{parser.prog}: error: model {args.model!r}; valid: {', '.join(EXAMPLES)}, MODULE:FUNCTION\n")
    model, loss_fn = build()
    rows = audit_saved(model, loss_fn)
    name = args.model.replace(":", "_")
    paths = write(rows, args.out or Path("audit_model") / name, title=f"audit_model: {args.model}")
    print(to_markdown(rows, f"audit_model: {args.model}"))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
