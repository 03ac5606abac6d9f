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

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import numpy as np
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lamploop.checks import check_int, int_at_least, seconds
from lamploop.errors import ConfigurationError, FederatedError, PlanNotApprovedError, TransportError
from lamploop.federated.checkpoints import load_round_checkpoint, save_round_checkpoint
from lamploop.federated.fedavg import averaged_names, federated_average
from lamploop.federated.link import Link, accept_node
from lamploop.federated.models import build_model
from lamploop.federated.plan import TrainingPlan, plan_hash, plan_to_json
from lamploop.federated.records import FederatedResult, MissingNode, NodeReport, RoundRecord, pooled
from lamploop.federated.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Finish,
    RoundRefused,
    RoundReply,
    RoundTask,
    encode_frame,
    in_order,
)
from lamploop.modelspec import describe_mismatch, model_spec
from lamploop.transport.connection import remote
from lamploop.transport.listen import serve_tcp
from lamploop.transport.proofs import check_token
from lamploop.transport.strangers import PendingHandshakes, RefusalLog
from lamploop.transport.tls import check_context, wrap

__all__ = ["AggregatorSettings", "run_aggregator"]

logger = logging.getLogger("lamploop.federated")


@attrs.frozen(kw_only=True)
class AggregatorSettings:
    """How many rounds, how many nodes, and how long every wait may last.

    Attributes:
        rounds: rounds in all (a resumed run counts the rounds done already).
        min_nodes: a round needs at least this many answers.
        expected_nodes: before the first round, wait for this many nodes (default ``min_nodes``).
        join_timeout: the longest wait for those nodes before a round.
        round_timeout: the longest wait for a round's answers.
        round_attempts: how many times a round is sent before too few answers fail the run.
        handshake_timeout: a connection must prove the token within this.
        max_pending_handshakes: connections handshaking at once; past it the oldest is dropped.
        max_frame_bytes: the largest frame accepted from a node that proved the token.
        checkpoint_dir: checkpoint after every round there, and resume from there (``None``: no).
        keep_last: round checkpoints kept.
    """

    rounds: int = attrs.field(validator=int_at_least(None, 0))
    min_nodes: int = attrs.field(default=1, validator=int_at_least(None, 1))
    expected_nodes: int | None = None
    join_timeout: float = attrs.field(default=60.0, validator=seconds)
    round_timeout: float = attrs.field(default=600.0, validator=seconds)
    round_attempts: int = attrs.field(default=1, validator=int_at_least(None, 1))
    handshake_timeout: float = attrs.field(default=10.0, validator=seconds)
    max_pending_handshakes: int = attrs.field(default=64, validator=int_at_least(None, 1))
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_FRAME_BYTES, validator=int_at_least(None, 1))
    checkpoint_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    keep_last: int = attrs.field(default=3, validator=int_at_least(None, 1))

    def __attrs_post_init__(self) -> None:
        if self.expected_nodes is not None:
            check_int("expected_nodes", self.expected_nodes, self.min_nodes)


# -- what the connection tasks tell the round loop --


@attrs.frozen
class _Joined:
    name: str
    link: Link


@attrs.frozen
class _Answer:
    name: str
    link: Link
    message: RoundReply | RoundRefused


@attrs.frozen
class _Lost:
    name: str
    link: Link
    why: str


_Event = _Joined | _Answer | _Lost


class _Door:
    """Accepts connections: refuses strangers, hands joined nodes and their answers to the round loop."""

    def __init__(
        self,
        token: bytes,
        settings: AggregatorSettings,
        context: ssl.SSLContext | None,
        events: MemoryObjectSendStream[_Event],
    ) -> None:
        self.token, self.settings, self.context, self.events = token, settings, context, events
        self.pending = PendingHandshakes(settings.max_pending_handshakes)
        self.refusals = RefusalLog(who="federated aggregator")

    async def serve(self, host: str, port: int, *, task_status: TaskStatus[tuple[str, int]]) -> None:
        """Listen on ``host:port`` (the transport's listener) and handle each connection in a task."""
        async with anyio.create_task_group() as tg:
            await serve_tcp(
                host,
                port,
                on_connection=lambda stream: tg.start_soon(self.handle, stream),
                refusals=self.refusals,
                who="aggregator",
                checks_first_bytes=self.context is None,  # under TLS the client speaks first
                task_status=task_status,
            )

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        name, link = await self._handshake(stream, remote(stream))
        if name is None or link is None:
            return
        await self.events.send(_Joined(name, link))
        await self._read(name, link)

    async def _handshake(self, stream: Any, peer: str) -> tuple[str | None, Link | None]:
        link: Link | None = None
        with self.pending.slot() as slot:
            try:
                with anyio.fail_after(self.settings.handshake_timeout):
                    if self.context is not None:
                        stream = await wrap(stream, self.context, server_side=True)
                    link = Link(stream, max_frame_bytes=self.settings.max_frame_bytes, peer=peer)
                    return await accept_node(link, self.token), link
            except TimeoutError:
                why = f"no handshake within {self.settings.handshake_timeout:g} s"
            except TransportError as exc:  # HandshakeError, FrameError, a broken connection
                why = str(exc)
        if slot.cancelled_caught:
            why = "dropped: too many connections handshaking at once"
        self.refusals.refused(peer, why)
        if link is not None:
            await link.aclose()
        else:
            await anyio.aclose_forcefully(stream)
        return None, None

    async def _read(self, name: str, link: Link) -> None:
        try:
            while True:
                message = await link.receive()
                if message is None:
                    await self.events.send(_Lost(name, link, "it closed the connection"))
                    return
                if not isinstance(message, (RoundReply, RoundRefused)):
                    why = f"it sent a {type(message).__name__}, which nodes do not send"
                    await self.events.send(_Lost(name, link, why))
                    return
                await self.events.send(_Answer(name, link, message))
        except TransportError as exc:
            await self.events.send(_Lost(name, link, f"its connection failed: {exc}"))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the round loop is gone: the run is over
        finally:
            await link.aclose()


class _Rounds:
    """The round loop's state: the connected nodes and the global model."""

    def __init__(
        self,
        plan: TrainingPlan,
        settings: AggregatorSettings,
        events: MemoryObjectReceiveStream[_Event],
        model: dict[str, torch.Tensor],
        rounds: tuple[RoundRecord, ...],
        on_round: Callable[[RoundRecord], object] | None = None,
    ) -> None:
        self.plan, self.settings, self.events = plan, settings, events
        self.on_round = on_round
        self.digest = plan_hash(plan)
        self.plan_json = plan_to_json(plan)
        self.links: dict[str, Link] = {}
        self.model = model
        self.records = list(rounds)
        self.not_approved: set[str] = set()  # nodes that refused the plan's hash
        self.names = averaged_names(build_model(plan.model), plan.average)
        self.spec = model_spec(model)  # every round's global model's: FedAvg keeps names, shapes, dtypes

    def _track(self, event: _Event) -> None:
        if isinstance(event, _Joined):
            old = self.links.get(event.name)
            self.links[event.name] = event.link
            logger.info("node %s joined", event.name)
            if old is not None and old is not event.link:
                logger.warning("node %s connected again: its old connection is dropped", event.name)
        elif isinstance(event, _Lost) and self.links.get(event.name) is event.link:
            del self.links[event.name]
            logger.warning("node %s lost: %s", event.name, event.why)

    async def _gather(self, want: int, round_: int) -> None:
        with anyio.move_on_after(self.settings.join_timeout):
            while len(self.links) < want:
                self._track(await self.events.receive())
        if len(self.links) < self.settings.min_nodes:
            joined = ", ".join(sorted(self.links)) or "none"
            msg = (
                f"round {round_}: {len(self.links)} node(s) connected ({joined}) "
                f"within join_timeout={self.settings.join_timeout:g} s; min_nodes={self.settings.min_nodes}"
            )
            raise FederatedError(msg)

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        first = len(self.records)  # this run's first round (after a resume, not 0)
        for round_ in range(first, self.settings.rounds):
            for attempt in range(1, self.settings.round_attempts + 1):
                gathering = round_ == first and attempt == 1
                await self._gather(
                    (self.settings.expected_nodes or self.settings.min_nodes)
                    if gathering
                    else self.settings.min_nodes,
                    round_,
                )
                if attempt == 1:
                    started = time.perf_counter()
                answers, missing = await self._one_round(round_, tg)
                if len(answers) >= self.settings.min_nodes:
                    break
                self._too_few(round_, attempt, answers, missing)
            self._finish_round(round_, attempt, answers, missing, started)

    def _too_few(
        self, round_: int, attempt: int, answers: dict[str, RoundReply], missing: dict[str, str]
    ) -> None:
        detail = "; ".join(f"{name}: {why}" for name, why in sorted(missing.items())) or "no node was sent it"
        msg = (
            f"round {round_} (attempt {attempt} of {self.settings.round_attempts}): "
            f"{len(answers)} answer(s), "
            f"fewer than min_nodes={self.settings.min_nodes}; missing: {detail}"
        )
        if attempt < self.settings.round_attempts:
            logger.warning("%s; sending it again", msg)
            return
        if missing and set(missing) <= self.not_approved:
            raise PlanNotApprovedError(msg, plan_hash=self.digest)
        raise FederatedError(msg)

    async def _one_round(
        self, round_: int, tg: anyio.abc.TaskGroup
    ) -> tuple[dict[str, RoundReply], dict[str, str]]:
        frame = encode_frame(
            RoundTask(round_, self.plan_json, self.model), max_frame_bytes=self.settings.max_frame_bytes
        )
        sent: dict[str, Link] = {}
        answers: dict[str, RoundReply] = {}
        missing: dict[str, str] = {}

        def send(name: str, link: Link) -> None:
            sent[name] = link
            missing.pop(name, None)
            answers.pop(name, None)
            tg.start_soon(self._send, name, link, frame)

        for name, link in sorted(self.links.items()):
            send(name, link)
        with anyio.move_on_after(self.settings.round_timeout):
            while len(answers) + len(missing) < len(sent):
                event = await self.events.receive()
                self._track(event)
                if isinstance(event, _Joined):
                    send(event.name, event.link)  # a node that (re)joins gets the current round
                elif sent.get(event.name) is not event.link:
                    continue  # an old connection's, or a stranger's to this round
                elif isinstance(event, _Lost):
                    if event.name not in answers:
                        missing[event.name] = f"lost: {event.why}"
                elif event.message.round != round_:
                    continue  # a late answer to an earlier round
                elif isinstance(event.message, RoundRefused):
                    missing[event.name] = f"refused: {event.message.reason}"
                    if event.message.not_approved:
                        self.not_approved.add(event.name)
                elif event.message.plan_hash != self.digest:
                    missing[event.name] = f"answered plan {event.message.plan_hash}, not {self.digest}"
                else:
                    problem = self._check_reply(event.message)
                    if problem is None:
                        answers[event.name] = event.message
                    else:
                        missing[event.name] = problem
        for name in sent:
            if name not in answers and name not in missing:
                missing[name] = f"no answer within round_timeout={self.settings.round_timeout:g} s"
        return answers, missing

    def _check_reply(self, reply: RoundReply) -> str | None:
        mismatch = describe_mismatch(
            self.spec,
            model_spec(in_order(reply.tensors, self.model)),
            expected_label="the global model's",
            actual_label="its",
        )
        if mismatch is not None:
            return f"answered other tensors: {mismatch}"
        if not all(finite(t) for t in reply.tensors.values()):
            return "answered non-finite parameters"
        return None

    async def _send(self, name: str, link: Link, frame: bytes) -> None:
        try:
            with anyio.fail_after(self.settings.round_timeout):
                await link.send_frame(frame)
        except (TransportError, TimeoutError) as exc:
            logger.warning("sending the round to node %s failed: %s", name, exc)
            await link.aclose()  # its reader then reports it lost

    def _finish_round(
        self,
        round_: int,
        attempts: int,
        answers: dict[str, RoundReply],
        missing: dict[str, str],
        started: float,
    ) -> None:
        ordered = sorted(answers.items())
        self.model = federated_average(
            self.model,
            [(name, reply.sample_count, reply.tensors) for name, reply in ordered],
            names=self.names,
        )
        wall = time.perf_counter() - started  # from sending the round to the new global model
        total = sum(reply.sample_count for _, reply in ordered)
        training_loss = (
            sum(reply.training_loss * reply.sample_count for _, reply in ordered) / total
            if total
            else math.nan
        )
        reports = tuple(
            NodeReport(
                name, r.sample_count, r.train_wall_s, r.train_cpu_s, r.training_loss, r.before, r.after
            )
            for name, r in ordered
        )
        record = RoundRecord(
            round=round_,
            attempts=attempts,
            answered=reports,
            missing=tuple(MissingNode(name, why) for name, why in sorted(missing.items())),
            wall_s=wall,
            training_loss=training_loss,
            validation_before=pooled([r.before for _, r in ordered]),
            validation_after=pooled([r.after for _, r in ordered]),
        )
        self.records.append(record)
        if missing:
            logger.warning(
                "round %d went on without %s",
                round_,
                "; ".join(f"{n} ({w})" for n, w in sorted(missing.items())),
            )
        if self.settings.checkpoint_dir is not None:
            save_round_checkpoint(
                self.settings.checkpoint_dir,
                self.model,
                self.records,
                self.digest,
                keep_last=self.settings.keep_last,
            )
        if self.on_round is not None:
            self.on_round(record)

    async def finish(self, reason: str, *, failed: bool) -> None:
        with anyio.CancelScope(shield=True):
            for link in list(self.links.values()):
                await link.send_best_effort(Finish(reason, failed))


def finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (integer and bool tensors always are)."""
    if not tensor.is_floating_point():
        return True
    try:
        array = tensor.numpy()  # NumPy's check costs a fifth of torch's on small CPU tensors
    except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16...), or not on the CPU
        return bool(torch.isfinite(tensor).all())
    return bool(np.isfinite(array).all())


def _initial_state(
    model: torch.nn.Module | Mapping[str, torch.Tensor], plan: TrainingPlan
) -> dict[str, torch.Tensor]:
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
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
    model = _initial_state(initial_model, plan)
    digest = plan_hash(plan)
    rounds: tuple[RoundRecord, ...] = ()
    if settings.checkpoint_dir is not None:
        resumed = load_round_checkpoint(settings.checkpoint_dir, plan_hash=digest, model=model)
        if resumed is not None:
            model, rounds = resumed
            logger.info("resuming after round %d from %s", len(rounds) - 1, settings.checkpoint_dir)
    send_events, receive_events = anyio.create_memory_object_stream[_Event](1024)
    door = _Door(secret, settings, context, send_events)
    loop = _Rounds(plan, settings, receive_events, model, rounds, on_round)
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg, send_events, receive_events:
            try:
                address = await tg.start(door.serve, host, port)
            except OSError as exc:  # the address cannot be listened on: raised as itself, below
                failure = exc
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
        door.refusals.flush()
    if failure is not None:
        raise failure
    return FederatedResult(loop.model, tuple(loop.records), digest)
