"""FedAvg: the average of the nodes' models, weighted by how many examples each trained on.

``new[k] = sum_i n_i * p_i[k] / sum_i n_i``, accumulated in float64 and cast back to the
tensor's dtype (integer buffers are rounded), so that the order of the nodes changes nothing
beyond float64 rounding.  Tensors that are not averaged (buffers, when the plan averages
parameters only) keep the global model's value.

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lamploop.errors import FederatedError
from lamploop.federated.wire import in_order
from lamploop.modelspec import describe_mismatch, model_spec

__all__ = ["averaged_names", "federated_average"]


def averaged_names(module: torch.nn.Module, average: str) -> frozenset[str]:
    """The state-dict names the plan's ``average`` covers: parameters, or parameters and buffers."""
    names = {name for name, _ in module.named_parameters()}
    if average == "parameters_and_buffers":
        names |= {name for name, _ in module.named_buffers()}
    return frozenset(names)


def federated_average(
    global_model: Mapping[str, torch.Tensor],
    updates: Sequence[tuple[str, int, Mapping[str, torch.Tensor]]],
    *,
    names: frozenset[str],
) -> dict[str, torch.Tensor]:
    """The new global model from ``(node, sample count, state)`` updates.

    Args:
        global_model: the round's global model (every tensor, in order).
        updates: each answering node's name, sample count and state (same names, shapes, dtypes).
        names: the tensors to average; the others keep ``global_model``'s value.

    Raises:
        FederatedError: no update, no examples in all, a sample count that is not an int >= 0
            (naming the node), a name in ``names`` the global model lacks, or an update whose
            tensors do not match the global model (naming the node and the tensor).
    """
    if not updates:
        msg = "FedAvg of no update"
        raise FederatedError(msg)
    for node, count, _ in updates:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            msg = f"FedAvg: node {node!r} reported a sample count of {count!r}, not an int >= 0"
            raise FederatedError(msg)
    unknown = sorted(set(names) - set(global_model))
    if unknown:
        msg = f"FedAvg: names {unknown} are not tensors of the global model (it has {list(global_model)[:8]})"
        raise FederatedError(msg)
    total = sum(count for _, count, _ in updates)
    if total <= 0:
        msg = f"FedAvg: the nodes {[name for name, _, _ in updates]} trained on 0 examples in all"
        raise FederatedError(msg)
    expected = model_spec(global_model)
    updates = [(node, count, in_order(state, global_model)) for node, count, state in updates]
    for node, _, state in updates:
        mismatch = describe_mismatch(
            expected, model_spec(state), expected_label="the global model's", actual_label=f"node {node!r}'s"
        )
        if mismatch is not None:
            msg = f"node {node!r} answered with other tensors than the global model's: {mismatch}"
            raise FederatedError(msg)
    averaged = [name for name in global_model if name in names]
    sizes = [global_model[name].numel() for name in averaged]
    # Every averaged tensor of an update as one float64 vector: one multiply and one add per
    # update instead of per tensor, the same arithmetic element by element.
    accumulator = torch.zeros(sum(sizes), dtype=torch.float64)
    if averaged:
        for _, count, state in updates:
            flat = torch.cat([state[name].reshape(-1).to(torch.float64) for name in averaged])
            accumulator += flat * (count / total)
    pieces = dict(zip(averaged, accumulator.split(sizes), strict=True))
    result: dict[str, torch.Tensor] = {}
    for name, current in global_model.items():
        piece = pieces.get(name)
        if piece is None:
            result[name] = current.clone()
        elif current.is_floating_point():
            result[name] = piece.view(current.shape).to(current.dtype, copy=True)  # not a view of the sum
        else:
            result[name] = piece.view(current.shape).round().to(current.dtype)
    return result
