"""What an op keeps for its backward: tensors and ``QTensor``s, through ``save_for_backward``.

Tensors kept as attributes of the autograd context cannot be traced by ``torch.compile``
(dynamo refuses intermediate tensors that leave the forward's subgraph that way); the saved
tensors can. ``save`` flattens each quantised tensor to its tensors; ``load`` rebuilds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from readback.numerics import BlockQTensor, QTensor


def save(fctx: Any, **values: torch.Tensor | QTensor | BlockQTensor | None) -> None:
    """``fctx.save_for_backward`` of ``values``: a quantised tensor (a ``QTensor``, ``BlockQTensor``
    or ``NVFP4Tensor``, frozen dataclasses) as its tensor fields, the others kept beside them;
    ``None`` stays ``None``."""
    tensors: list[torch.Tensor] = []
    layout: dict[str, tuple[Any, ...] | None] = {}
    for key, value in values.items():
        if value is None:
            layout[key] = None
        elif isinstance(value, torch.Tensor):
            layout[key] = (len(tensors), None, (), {})
            tensors.append(value)
        else:
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            names = tuple(n for n, v in fields.items() if isinstance(v, torch.Tensor))
            layout[key] = (len(tensors), type(value), names, {n: v for n, v in fields.items() if n not in names})
            tensors += [fields[n] if n == "data" else _own(fields[n]) for n in names]
    fctx.save_for_backward(*tensors)
    fctx.layout = layout


def _own(scale: torch.Tensor) -> torch.Tensor:
    """A scale to save. While compiling, a copy: one scale tensor is often shared by several
    saved values (and by the site's state), and dynamo drops saved tensors that alias."""
    return scale.clone() if torch.compiler.is_compiling() else scale


def load(fctx: Any) -> dict[str, Any]:
    """The ``values`` of ``save``, by name (``Any``: each op knows which of its values are
    tensors, quantised tensors or ``None``)."""
    tensors = fctx.saved_tensors
    out: dict[str, Any] = {}
    for key, spec in fctx.layout.items():
        if spec is None:
            out[key] = None
            continue
        start, cls, names, others = spec
        if cls is None:
            out[key] = tensors[start]
        else:
            out[key] = cls(**others, **{n: tensors[start + i] for i, n in enumerate(names)})
    return out
