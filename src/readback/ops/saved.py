"""What an op keeps for its backward: tensors and ``QTensor``s, through ``save_for_backward``.

Tensors kept as attributes of the autograd context cannot be traced by ``torch.compile``
(dynamo refuses intermediate tensors that leave the forward's subgraph that way); the saved
tensors can. ``save`` flattens each ``QTensor`` to its data and scale; ``load`` rebuilds them.
"""

from __future__ import annotations

from typing import Any

import torch

from readback.numerics import BlockQTensor, QTensor


def save(fctx: Any, **values: torch.Tensor | QTensor | BlockQTensor | None) -> None:
    """``fctx.save_for_backward`` of ``values`` (a ``BlockQTensor`` as its codes and block scales);
    ``None`` stays ``None``."""
    tensors: list[torch.Tensor] = []
    layout: dict[str, tuple[Any, ...] | None] = {}
    for key, value in values.items():
        if value is None:
            layout[key] = None
            continue
        if isinstance(value, torch.Tensor):
            layout[key] = (len(tensors),)
            tensors.append(value)
            continue
        layout[key] = (len(tensors), value.fmt) + ((value.block,) if isinstance(value, BlockQTensor) else ())
        tensors += [value.data, _own(value.scale)]
    fctx.save_for_backward(*tensors)
    fctx.layout = layout


def _own(scale: torch.Tensor) -> torch.Tensor:
    """A scale to save. While compiling, a copy: one scale tensor is often shared by several
    saved values (and by the site's state), and dynamo drops saved tensors that alias."""
    return scale.clone() if torch.compiler.is_compiling() else scale


def load(fctx: Any) -> dict[str, Any]:
    """The ``values`` of ``save``, by name (``Any``: each op knows which of its values are
    tensors, ``QTensor``s or ``None``)."""
    tensors = fctx.saved_tensors
    out: dict[str, Any] = {}
    for key, spec in fctx.layout.items():
        if spec is None:
            out[key] = None
        elif len(spec) == 3:
            out[key] = BlockQTensor(tensors[spec[0]], tensors[spec[0] + 1], spec[1], spec[2])
        elif len(spec) == 2:
            out[key] = QTensor(tensors[spec[0]], tensors[spec[0] + 1], spec[1])
        else:
            out[key] = tensors[spec[0]]
    return out
