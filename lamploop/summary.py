"""A model at a glance: its parameters per top-level module, trainable or not, and in all.

:func:`summarize` is what Lightning's ``ModelSummary`` shows at the start of training: one
row per top-level module (its name, type, parameters and whether they are trainable), the
totals (trainable, non-trainable, all) and the parameters' size in MB.  :func:`lamploop.fit`
computes it once per run and hands it to the reporters on
:class:`~lamploop.reporting.events.RunStarted` (``model_summary``); the
:class:`~lamploop.reporting.LoggingReporter` and the
:class:`~lamploop.reporting.ProgressReporter` print :meth:`ModelSummary.lines`.

:func:`summarize_tensors` does the same from tensor names, shapes and dtypes alone (a
``state_dict``, or the tensor specs a checkpoint records): ``lamploop inspect`` shows it.
A checkpoint does not say which tensors are parameters and which are buffers, nor which are
trainable, so it counts every tensor.

>>> import torch
>>> module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> module[0].requires_grad_(False)  # doctest: +ELLIPSIS
Linear(...)
>>> summary = summarize(module)
>>> summary.total_parameters, summary.trainable_parameters, summary.non_trainable_parameters
(58, 18, 40)
>>> print(summary)
model: Sequential, 58 parameters (18 trainable, 40 non-trainable), 0.000 MB
  name  type    parameters  trainable
  0     Linear          40  no
  1     ReLU             0  -
  2     Linear          18  yes

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs
import torch
from torch.nn.parameter import is_lazy

from lamploop.checks import check_int
from lamploop.errors import ConfigurationError
from lamploop.model import unwrapped

__all__ = [
    "OWN",
    "LayerSummary",
    "ModelSummary",
    "TensorGroup",
    "TensorSummary",
    "summarize",
    "summarize_tensors",
]

OWN = "(own)"
"""The row of the tensors a module holds itself, beside its submodules' (a ``torch.nn.Parameter``
attribute of the model, not of a layer)."""


def _megabytes(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:.3f} MB"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Rows under a header, two spaces apart, columns in ``right`` right-aligned; indented by 2."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  "
        + "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in [header, *rows]
    ]


@attrs.frozen
class LayerSummary:
    """One module of the model: its dotted name, its class and its parameters.

    Attributes:
        name: its name in ``named_modules()`` (``"0"``, ``"encoder"``, ``"encoder.fc"``), or
            :data:`OWN` for the parameters the model holds itself.
        type: its class name (``"Linear"``).
        parameters: the elements of its parameters (its submodules' included); a parameter
            shared by two modules counts in both rows, once in the model's totals.
        trainable: of those, the elements of parameters with ``requires_grad``.
    """

    name: str
    type: str
    parameters: int
    trainable: int

    @property
    def trainable_text(self) -> str:
        """``"yes"``, ``"no"``, ``"partly"`` (some of its parameters are frozen) or ``"-"`` (none)."""
        if self.parameters == 0:
            return "-"
        if self.trainable == self.parameters:
            return "yes"
        return "no" if self.trainable == 0 else "partly"


@attrs.frozen
class ModelSummary:
    """What :func:`summarize` finds: the rows, the totals and the parameters' size.

    Attributes:
        type: the model's class name.
        layers: one row per module down to the depth asked for (top-level modules by
            default), in ``named_modules()`` order.
        trainable_parameters, non_trainable_parameters: the elements of the model's
            parameters with and without ``requires_grad`` (each shared parameter once).
        size_bytes: the bytes those parameters take (elements times each dtype's size;
            buffers such as BatchNorm's running statistics are not counted).
        uninitialized: parameters of lazy modules (``torch.nn.LazyLinear``...) not
            materialized yet, which no count includes.
    """

    type: str
    layers: tuple[LayerSummary, ...]
    trainable_parameters: int
    non_trainable_parameters: int
    size_bytes: int
    uninitialized: int = 0

    @property
    def total_parameters(self) -> int:
        """Every parameter element, trainable or not."""
        return self.trainable_parameters + self.non_trainable_parameters

    @property
    def size_mb(self) -> float:
        """:attr:`size_bytes` in MB (10^6 bytes)."""
        return self.size_bytes / 1e6

    def heading(self) -> str:
        """``model: Sequential, 17,226 parameters (17,226 trainable, 0 non-trainable), 0.069 MB``."""
        counts = f"{self.trainable_parameters:,} trainable, {self.non_trainable_parameters:,} non-trainable"
        size = _megabytes(self.size_bytes)
        text = f"model: {self.type}, {self.total_parameters:,} parameters ({counts}), {size}"
        if self.uninitialized:
            text += f", and {self.uninitialized} uninitialized lazy parameter tensor(s)"
        return text

    def lines(self) -> list[str]:
        """The heading, then a table of the rows (none without rows)."""
        if not self.layers:
            return [self.heading()]
        rows = [
            [layer.name, layer.type, f"{layer.parameters:,}", layer.trainable_text] for layer in self.layers
        ]
        return [self.heading(), *_table(["name", "type", "parameters", "trainable"], rows, right={2})]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _count(parameters: Iterable[torch.nn.Parameter]) -> tuple[int, int, int, int]:
    """(all elements, trainable elements, bytes, uninitialized tensors) of ``parameters``."""
    total = trainable = size = lazy = 0
    for p in parameters:
        if is_lazy(p):
            lazy += 1
            continue
        n = p.numel()
        total += n
        size += n * p.element_size()
        if p.requires_grad:
            trainable += n
    return total, trainable, size, lazy


def summarize(module: torch.nn.Module, depth: int = 1) -> ModelSummary:
    """The parameters of ``module`` per submodule (down to ``depth`` levels) and in all.

    ``depth=1`` gives a row per top-level module (``named_children()``), ``depth=2`` adds
    their children (``"encoder.fc"``) after each, ``depth=0`` no row at all (the totals
    only).  When the model also holds parameters of its own beside its submodules, a row
    named :data:`OWN` counts them.  A ``torch.compile`` wrapper is looked through.

    It reads the parameters' shapes and dtypes only (no value, no device synchronisation).

    Raises:
        ConfigurationError: ``module`` is not a ``torch.nn.Module``, or ``depth`` not an int >= 0.
    """
    if not isinstance(module, torch.nn.Module):
        msg = f"summarize: module must be a torch.nn.Module, got {type(module).__name__}"
        raise ConfigurationError(msg)
    depth = check_int("summarize: depth", depth, 0)
    root = unwrapped(module)
    total, trainable, size, lazy = _count(root.parameters())
    layers: list[LayerSummary] = []
    if depth > 0:
        own = list(root.parameters(recurse=False))
        children = list(root.named_children())
        if own and children:
            own_total, own_trainable, _, _ = _count(own)
            layers.append(LayerSummary(OWN, type(root).__name__, own_total, own_trainable))
        for name, submodule in root.named_modules():
            level = name.count(".") + 1
            if name and level <= depth:
                sub_total, sub_trainable, _, _ = _count(submodule.parameters())
                layers.append(LayerSummary(name, type(submodule).__name__, sub_total, sub_trainable))
    return ModelSummary(
        type=type(root).__name__,
        layers=tuple(layers),
        trainable_parameters=trainable,
        non_trainable_parameters=total - trainable,
        size_bytes=size,
        uninitialized=lazy,
    )


class TensorLike(Protocol):
    """A tensor's name, shape and dtype name (``"float32"``): a :class:`lamploop.modelspec.TensorSpec`."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...


@attrs.frozen
class TensorGroup:
    """The tensors under one name prefix (a top-level module): how many, their elements and bytes."""

    name: str
    tensors: int
    elements: int
    size_bytes: int


@attrs.frozen
class TensorSummary:
    """What :func:`summarize_tensors` finds: one :class:`TensorGroup` per prefix, in order of appearance."""

    groups: tuple[TensorGroup, ...]

    @property
    def tensors(self) -> int:
        """The number of tensors."""
        return sum(g.tensors for g in self.groups)

    @property
    def elements(self) -> int:
        """Their elements in all."""
        return sum(g.elements for g in self.groups)

    @property
    def size_bytes(self) -> int:
        """Their bytes in all."""
        return sum(g.size_bytes for g in self.groups)

    @property
    def size_mb(self) -> float:
        """:attr:`size_bytes` in MB (10^6 bytes)."""
        return self.size_bytes / 1e6

    def lines(self) -> list[str]:
        """A table: a row per group (its tensors, elements and MB), then the total."""
        rows = [
            [g.name, f"{g.tensors:,}", f"{g.elements:,}", f"{g.size_bytes / 1e6:.3f}"] for g in self.groups
        ]
        rows.append(["total", f"{self.tensors:,}", f"{self.elements:,}", f"{self.size_mb:.3f}"])
        return _table(["module", "tensors", "values", "MB"], rows, right={1, 2, 3})


def _itemsize(dtype: str | torch.dtype) -> int:
    found = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else 0


def summarize_tensors(
    tensors: Mapping[str, torch.Tensor] | Iterable[TensorLike], depth: int = 1
) -> TensorSummary:
    """Group named tensors by the module that holds them, down to ``depth`` name components.

    ``tensors`` is a ``state_dict()`` or tensor specs (``ModelSpec.tensors``). A tensor
    named ``"encoder.fc.weight"`` is held by ``"encoder.fc"``, grouped under ``"encoder"``
    at ``depth=1``; a tensor with no module in its name (``"scale"``) goes under
    :data:`OWN`.  A dtype torch does not know counts 0 bytes.

    Raises:
        ConfigurationError: ``depth`` is not an int >= 1.
    """
    depth = check_int("summarize_tensors: depth", depth, 1)
    if isinstance(tensors, Mapping):
        specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    else:
        specs = [(t.name, tuple(t.shape), t.dtype) for t in tensors]
    groups: dict[str, list[int]] = {}
    for name, shape, dtype in specs:
        holder = name.rpartition(".")[0]
        key = ".".join(holder.split(".")[:depth]) if holder else OWN
        elements = 1
        for d in shape:
            elements *= int(d)
        entry = groups.setdefault(key, [0, 0, 0])
        entry[0] += 1
        entry[1] += elements
        entry[2] += elements * _itemsize(dtype)
    return TensorSummary(tuple(TensorGroup(name, *counts) for name, counts in groups.items()))
