"""Record every tensor autograd saves in one forward, and swap any one of them at unpack time.

The forward runs once under ``torch.autograd.graph.saved_tensors_hooks``: each saved tensor is
kept with the module that was running when it was saved, and is named afterwards by the graph
node that saved it (``MmBackward0.self``, ``SoftmaxBackward0.result``, ...). Because unpacking
goes through the hook, each later backward (``retain_graph``) can see one chosen saved tensor
replaced by another version of it, with everything else as saved: the same forward, many
backwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass
class Saved:
    index: int
    tensor: torch.Tensor
    module: str
    op: str = "?"

    @property
    def name(self) -> str:
        return f"{self.module or '<root>'}/{self.op}"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class SavedTensors:
    """The saved tensors of one forward, and the switch that replaces one of them on unpack."""

    def __init__(self) -> None:
        self.saved: list[Saved] = []
        self.replacement: tuple[int, torch.Tensor] | None = None
        self._modules: list[str] = []

    def _pack(self, tensor: torch.Tensor) -> int:
        self.saved.append(Saved(len(self.saved), tensor, self._modules[-1] if self._modules else ""))
        return len(self.saved) - 1

    def _unpack(self, index: int) -> torch.Tensor:
        if self.replacement is not None and self.replacement[0] == index:
            return self.replacement[1]
        return self.saved[index].tensor

    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module):
        """Run the forward inside: saved tensors are recorded with their module's name."""

        def enter(name):
            return lambda module, args: self._modules.append(name)  # returns None: args unchanged

        def leave(module, args, output):
            self._modules.pop()  # returns None: output unchanged

        handles = []
        for name, module in model.named_modules():
            handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def name_ops(self, loss: torch.Tensor) -> None:
        """Name each saved tensor by the graph node and attribute that saved it."""

        def key(t: torch.Tensor) -> tuple:
            """Storage, shape, strides and dtype: unpacking a saved tensor may re-wrap it."""
            return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

        unnamed: dict[tuple, list[Saved]] = {}
        for s in self.saved:
            unnamed.setdefault(key(s.tensor), []).append(s)
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack += [n for n, _ in node.next_functions]
            attrs = [(a[len("_saved_") :], getattr(node, a, None)) for a in dir(node) if a.startswith("_saved_")]
            if not attrs:  # a custom autograd.Function: its ctx.save_for_backward list
                with contextlib.suppress(Exception):
                    attrs = [(f"saved_tensors[{i}]", t) for i, t in enumerate(cast(Any, node).saved_tensors)]
            for attr, value in attrs:
                for i, t in enumerate(value if isinstance(value, (tuple, list)) else [value]):
                    if isinstance(t, torch.Tensor) and unnamed.get(key(t)):
                        suffix = f"[{i}]" if isinstance(value, (tuple, list)) else ""
                        # one tensor saved by several nodes: the walk from the loss meets the last saver first
                        unnamed[key(t)].pop().op = f"{node.name()}.{attr}{suffix}"

    @contextlib.contextmanager
    def replaced(self, index: int, tensor: torch.Tensor):
        """Backwards inside read ``tensor`` in place of saved tensor ``index``."""
        self.replacement = (index, tensor)
        try:
            yield
        finally:
            self.replacement = None
