"""The aggregator: runs R rounds of FedAvg over the nodes that connect to it.

Each round, on the aggregator::

    wait until enough nodes are connected (expected_nodes before the first round, then
        min_nodes), at most join_timeout seconds
    send (round, plan, global model) to every connected node, and to any that joins meanwhile
    collect answers until every node sent the round answered, refused or was lost, or
        round_timeout passed
    if at least min_nodes answered: global model = FedAvg of their parameters, weighted by
        their sample counts (float64); record the round, naming the missing and why;
        checkpoint
    else: send the round again (round_attempts in all), then fail naming the missing

Every wait is bounded: a node that dies in the middle of a round is dropped at once (its
connection breaks), a frozen one at the round's deadline.  Strangers (a wrong token,
garbage, an oversized frame, a connection that stays silent past handshake_timeout) are
refused and logged and never touch a round.  With ``checkpoint_dir``, the aggregator
checkpoints after every round and a new run with the same directory and plan resumes
after the last round checkpointed; the nodes reconnect by themselves.

The work is done in modules of one job each: the listener that admits nodes and turns their
messages into events (:mod:`lamploop.federated.node_listener`), the round loop
(:mod:`lamploop.federated.round_loop`), the settings (:mod:`lamploop.federated.settings`);
this module checks the arguments, resumes, and runs the two together.

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Mapping

import anyio
import torch

from lamploop.checks import check_callable, check_host
from lamploop.errors import ConfigurationError, FederatedError
from lamploop.federated.checkpoints import load_round_checkpoint
from lamploop.federated.fedavg import averaged_names
from lamploop.federated.models import BUILT_IN_BUILDERS, build_model
from lamploop.federated.node_listener import NodeEvent, NodeListener
from lamploop.federated.plan import TrainingPlan, plan_hash
from lamploop.federated.records import FederatedResult, RoundRecord
from lamploop.federated.round_loop import RoundLoop
from lamploop.federated.round_loop import finite as finite  # defined here before the round loop's module
from lamploop.federated.settings import AggregatorSettings
from lamploop.modelspec import describe_mismatch, model_spec
from lamploop.transport.proofs import check_token
from lamploop.transport.settings import check_int_in
from lamploop.transport.tls import check_context

__all__ = ["AggregatorSettings", "run_aggregator"]

logger = logging.getLogger("lamploop.federated")


def _initial_state(
    model: torch.nn.Module | Mapping[str, torch.Tensor], plan: TrainingPlan
) -> dict[str, torch.Tensor]:
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if not isinstance(state, Mapping) or not all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in state.items()
    ):
        msg = (
            "run_aggregator: initial_model must be a torch.nn.Module or a state dict (names to tensors), "
            f"got {type(model).__name__} {model!r:.60}"
        )
        raise ConfigurationError(msg)
    tensors = {name: tensor.detach().to("cpu").clone() for name, tensor in state.items()}
    mismatch = describe_mismatch(
        plan.model.tensors,
        model_spec(tensors),
        expected_label="the plan's",
        actual_label="the initial model's",
    )
    if mismatch is not None:
        msg = f"run_aggregator: the initial model does not fit the plan: {mismatch}"
        raise ConfigurationError(msg)
    return tensors


def _averaged_names(
    model: torch.nn.Module | Mapping[str, torch.Tensor], plan: TrainingPlan
) -> frozenset[str]:
    """The tensors the plan's ``average`` covers: from the initial module, else from the model built here.

    The aggregator needs no builder of its own: an architecture only the nodes register is
    told apart (parameters, buffers) by the initial model given as a module.
    """
    if isinstance(model, torch.nn.Module):
        return averaged_names(model, plan.average)
    if plan.average == "parameters_and_buffers":
        return frozenset(model)
    if plan.model.architecture not in BUILT_IN_BUILDERS:
        msg = (
            f"run_aggregator: architecture {plan.model.architecture!r} is not built in here: pass "
            "initial_model as the module, whose parameters tell which tensors average='parameters' covers"
        )
        raise ConfigurationError(msg)
    return averaged_names(build_model(plan.model), plan.average)


async def run_aggregator(
    *,
    plan: TrainingPlan,
    initial_model: torch.nn.Module | Mapping[str, torch.Tensor],
    token: str | bytes,
    settings: AggregatorSettings,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    on_listening: Callable[[int], object] | None = None,
    on_round: Callable[[RoundRecord], object] | None = None,
) -> FederatedResult:
    """Run the plan's rounds over the nodes that connect, and return the final global model.

    Args:
        plan: the training plan (nodes must have approved its hash).
        initial_model: the global model of round 0 (a module or a state dict fitting the plan).
        token: the shared secret every node proves it knows.
        settings: rounds, node counts, timeouts, checkpoints (:class:`AggregatorSettings`).
        host, port: where to listen (port 0: any free port, see ``on_listening``).
        ssl_context: a TLS server context, to speak TLS to the nodes.
        on_listening: called with the port once the aggregator listens.
        on_round: called with each round's record once the round is done (its global model
            computed and checkpointed), in the round loop: a quick call (a progress line, a
            timestamp); what it raises ends the run as a failure.

    Returns:
        The final model and every round's record.

    Raises:
        ConfigurationError: a bad argument (checked before listening).
        FederatedError: a round had fewer than ``min_nodes`` answers after ``round_attempts``
            (the missing nodes named, and why), or too few nodes joined in time, or the
            checkpoint directory holds another plan's run.
        PlanNotApprovedError: too few answers because the nodes refused the plan's hash.
        CheckpointError: the latest checkpoint is corrupt.
    """
    if not isinstance(plan, TrainingPlan):
        msg = f"run_aggregator: plan must be a TrainingPlan, got {type(plan).__name__}"
        raise ConfigurationError(msg)
    if not isinstance(settings, AggregatorSettings):
        msg = f"run_aggregator: settings must be AggregatorSettings, got {type(settings).__name__}"
        raise ConfigurationError(msg)
    secret = check_token(token)
    context = check_context("ssl_context", ssl_context, server_side=True)
    check_int_in("run_aggregator: port", port, 0, 65535)
    check_callable("run_aggregator: on_listening", on_listening, optional=True)
    check_callable("run_aggregator: on_round", on_round, optional=True)
    check_host("run_aggregator: host", host)
    model = _initial_state(initial_model, plan)
    names = _averaged_names(initial_model, plan)
    digest = plan_hash(plan)
    rounds: tuple[RoundRecord, ...] = ()
    if settings.checkpoint_dir is not None:
        resumed = load_round_checkpoint(settings.checkpoint_dir, plan_hash=digest, model=model)
        if resumed is not None:
            model, rounds = resumed
            logger.info("resuming after round %d from %s", len(rounds) - 1, settings.checkpoint_dir)
    send_events, receive_events = anyio.create_memory_object_stream[NodeEvent](1024)
    listener = NodeListener(secret, settings, context, send_events)
    loop = RoundLoop(plan, settings, receive_events, model, rounds, names, on_round)
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg, send_events, receive_events:
            try:
                address = await tg.start(listener.serve, host, port)
            except OSError as exc:  # the address cannot be listened on: raised below, naming it
                failure = FederatedError(f"the aggregator cannot listen on {host}:{port}: {exc}")
                failure.__cause__ = exc
                tg.cancel_scope.cancel()
            else:
                if on_listening is not None:
                    on_listening(address[1])
                try:
                    await loop.run(tg)
                except Exception as exc:  # raised below, outside the task group, as itself
                    failure = exc
                    await loop.finish(f"the run failed: {exc}", failed=True)
                else:
                    await loop.finish(f"the run is over after {settings.rounds} rounds", failed=False)
                tg.cancel_scope.cancel()
    finally:
        listener.refusals.flush()
    if failure is not None:
        raise failure
    return FederatedResult(loop.model, tuple(loop.records), digest)
