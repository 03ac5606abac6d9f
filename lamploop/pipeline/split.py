"""Cut a ``torch.nn.Sequential`` into stages, and find every stage's tensor shapes without running it.

The stages are slices of the model: they share its layers and parameters, and keep its
parameter names (``"2.weight"``), so the stages' state dicts together are the model's.

``torch.distributed.pipelining`` either is told each stage's input and output (its
*static* mode) or asks the neighbouring stage with ``send_object_list``, which pickles.
lamploop never pickles across processes, so every rank works the shapes out itself:
:func:`stage_examples` runs the whole model on the ``meta`` device (shapes and dtypes,
no memory, no arithmetic) for one micro-batch.  Every rank runs every stage there, so
a model that does not fit its input fails alike on every rank, before any message.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch.func import functional_call

from lamploop.errors import ConfigurationError
from lamploop.pipeline.spec import PipelineSpec

__all__ = ["StageExamples", "split_sequential", "stage_examples"]


def split_sequential(model: torch.nn.Module, boundaries: Sequence[int]) -> tuple[torch.nn.Sequential, ...]:
    """Cut ``model`` into ``len(boundaries) + 1`` stages at the given layer indices.

    Args:
        model: a ``torch.nn.Sequential``.
        boundaries: the first layer of every stage but the first, strictly increasing,
            in ``1..len(model) - 1``.

    Returns:
        The stages, each a ``Sequential`` sharing ``model``'s layers (and names).

    Raises:
        ConfigurationError: ``model`` is not a ``Sequential`` or a boundary is out of range.

    >>> from torch import nn
    >>> stages = split_sequential(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)), [2])
    >>> [list(s.state_dict()) for s in stages]
    [['0.weight', '0.bias'], ['2.weight', '2.bias']]
    """
    if isinstance(boundaries, str | bytes) or not isinstance(boundaries, Sequence):
        what = type(boundaries).__name__
        msg = f"split_sequential: boundaries must be a sequence of layer indices, got {what}"
        raise ConfigurationError(msg)
    ranges = PipelineSpec(tuple(boundaries)).layer_ranges(model)
    assert isinstance(model, torch.nn.Sequential)
    return tuple(model[r.start : r.stop] for r in ranges)  # type: ignore[misc]


@attrs.frozen
class StageExamples:
    """One stage's input and output for one micro-batch, as empty tensors of the right shape.

    Attributes:
        inputs: what the stage receives (the features on the first stage).
        outputs: what it sends on (the model's output on the last stage).
    """

    inputs: torch.Tensor
    outputs: torch.Tensor


def _on_meta(module: torch.nn.Module, value: torch.Tensor, where: str) -> torch.Tensor:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    state = {name: torch.empty_like(t, device="meta") for name, t in tensors}
    try:
        out = functional_call(module, state, (value,))
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as exc:
        msg = f"{where} fails on a micro-batch of shape {tuple(value.shape)} ({value.dtype}): {exc}"
        raise ConfigurationError(msg) from exc
    if not isinstance(out, torch.Tensor):
        msg = f"{where} returns {type(out).__name__}, not one tensor (a pipeline stage sends one tensor on)"
        raise ConfigurationError(msg)
    return out


def stage_examples(
    stages: Sequence[torch.nn.Module], features: torch.Tensor, *, training: bool
) -> tuple[StageExamples, ...]:
    """Every stage's input and output for micro-batches shaped like ``features``.

    Args:
        stages: the stages, in order (from :func:`split_sequential`).
        features: one micro-batch of the first stage's input (only its shape and dtype count).
        training: gradients flow back (floating-point tensors between stages require grad).

    Raises:
        ConfigurationError: a stage fails on its input or does not return one tensor; the
            message names the stage.
    """
    value = torch.empty(features.shape, dtype=features.dtype, device="meta")
    shapes: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, stage in enumerate(stages):
        out = _on_meta(stage, value, f"pipeline stage {index} (layers {_layer_names(stage)})")
        shapes.append((value, out))
        value = out

    def example(meta: torch.Tensor, *, grad: bool) -> torch.Tensor:
        wants_grad = grad and training and meta.dtype.is_floating_point
        return torch.empty(meta.shape, dtype=meta.dtype).requires_grad_(wants_grad)

    return tuple(
        StageExamples(inputs=example(inp, grad=index > 0), outputs=example(out, grad=True))
        for index, (inp, out) in enumerate(shapes)
    )


def _layer_names(stage: torch.nn.Module) -> str:
    names = [name for name, _ in stage.named_children()]
    return f"{names[0]}..{names[-1]}" if len(names) > 1 else (names[0] if names else "none")
