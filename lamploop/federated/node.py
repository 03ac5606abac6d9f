"""A federated node: connects out to the aggregator, trains the rounds of approved plans on its own data.

Each round, on the node::

    plan = the round's plan; refuse (naming its hash) unless the hash is on the allow-list
    model = the plan's model (built here, checked against the plan), loaded with the global model
    before = validate(model)                     # on this node's validation stream
    train local_epochs epochs (or local_steps steps) with this node's optimizer
        (state kept from its previous round or reset, per the plan)
    after = validate(model)
    reply: parameters, sample count, training wall and CPU time, before, after

Only parameters and aggregate statistics leave the node.  The node connects out (it needs no
open port) and retries until the aggregator listens; when the connection is lost it
reconnects, for up to ``connect_timeout`` seconds, and gets the current round again.  A round
sent twice (the aggregator restarted in the middle of it) is trained from the same optimizer
state and the same data order, so the answer is the same.

.. versionadded:: 0.3
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import ssl
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch
import torch._dynamo

from lamploop.batches import Batch, BatchContext, BatchStream, BatchStreamFactory, epoch_seed
from lamploop.checks import check_int, seconds
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    FederatedError,
    FrameError,
    HandshakeError,
    NonFiniteLossError,
    TransportError,
)
from lamploop.federated.approval import load_allow_list
from lamploop.federated.link import Link, join_aggregator
from lamploop.federated.models import ModelBuilders, build_model, build_optimizer, build_supervised_model
from lamploop.federated.plan import TrainingPlan, canonical_json, plan_from_json, plan_hash
from lamploop.federated.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Evaluation,
    Finish,
    Refuse,
    RoundRefused,
    RoundReply,
    RoundTask,
    check_node_name,
    in_order,
)
from lamploop.loop import one_epoch
from lamploop.metrics import metrics_of
from lamploop.modelspec import ModelSpec, describe_mismatch, model_spec
from lamploop.transport.connection import explain
from lamploop.transport.proofs import check_token
from lamploop.transport.tls import check_context, wrap

__all__ = ["NodeSettings", "NodeSummary", "run_node"]

logger = logging.getLogger("lamploop.federated")


@attrs.frozen(kw_only=True)
class NodeSettings:
    """How a node reaches the aggregator and how long it waits.

    Attributes:
        connect_timeout: keep trying to reach the aggregator this long (at the start, and
            after a lost connection) before giving up.
        retry_interval: seconds between connection attempts.
        handshake_timeout: the TLS and token handshake must finish within this.
        idle_timeout: once joined, the longest wait for the aggregator's next message.
        max_frame_bytes: the largest frame accepted from the aggregator.
    """

    connect_timeout: float = attrs.field(default=60.0, validator=seconds)
    retry_interval: float = attrs.field(default=0.2, validator=seconds)
    handshake_timeout: float = attrs.field(default=10.0, validator=seconds)
    idle_timeout: float = attrs.field(default=3600.0, validator=seconds)
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_FRAME_BYTES)

    def __attrs_post_init__(self) -> None:
        check_int("max_frame_bytes", self.max_frame_bytes, 1)


@attrs.frozen
class NodeSummary:
    """What a node did: the rounds it trained and refused, and how the run ended."""

    trained: tuple[int, ...]
    refused: tuple[int, ...]
    finish_reason: str
    failed: bool


class _Counted:
    """A batch stream that counts the examples (targets' rows) it yields; stops after ``limit`` batches."""

    def __init__(self, streams: AsyncIterator[BatchStream], limit: int | None) -> None:
        self._streams = streams
        self._limit = limit
        self.examples = 0

    async def __aiter__(self) -> AsyncIterator[Batch]:
        taken = 0
        async for stream in self._streams:
            async for batch in stream:
                if self._limit is not None and taken >= self._limit:
                    return
                features, target = batch
                self.examples += int(target.shape[0])
                taken += 1
                yield features, target
            if self._limit is not None and taken >= self._limit:
                return


async def _epochs(factory: BatchStreamFactory, first: int, count: int | None) -> AsyncIterator[BatchStream]:
    epoch = first
    while count is None or epoch < first + count:
        yield factory(BatchContext(epoch=epoch))
        epoch += 1


def seed_round(module: torch.nn.Module, seed: int) -> None:
    """Seed the generators ``module`` draws from (dropout...): what ``torch.manual_seed`` does for them.

    A module whose tensors are all on the CPU draws from the CPU's default generator only:
    seeding it alone gives the same numbers as ``torch.manual_seed(seed)``, without the
    latter's lazy seeding of every accelerator backend that is not in use (on a machine
    without CUDA each round queued three seed calls, each with a formatted stack, ~0.4 ms).
    A module with tensors elsewhere gets ``torch.manual_seed``.
    """
    if all(t.device.type == "cpu" for t in itertools.chain(module.parameters(), module.buffers())):
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class _Trainer:
    """The node's model and optimizer across rounds, and one round's work."""

    def __init__(
        self,
        name: str,
        train_batches: BatchStreamFactory,
        validation_batches: BatchStreamFactory | None,
        builders: ModelBuilders | None,
    ) -> None:
        self.name = name
        self.train_batches = train_batches
        self.validation_batches = validation_batches
        self.builders = builders
        self.digest: str | None = None
        self.module: torch.nn.Module | None = None
        self.spec: ModelSpec | None = None  # the module's, taken when it is built
        # The last plan received, as canonical JSON, with what it parsed to: a run sends the
        # same plan every round, which is then parsed and hashed once.
        self.plan_seen: tuple[bytes, TrainingPlan, str] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # The optimizer state at the start of the round in progress, to train that round again
        # from the same state when it is sent again (after an aggregator restart).
        self.round_started: int | None = None
        self.state_at_start: dict[str, Any] | None = None

    def read_plan(self, obj: dict[str, Any], round_: int) -> tuple[TrainingPlan, str]:
        """The plan a task carries and its hash; the same plan as the last one is not parsed again.

        Raises:
            ConfigurationError: the plan does not parse.
        """
        key = canonical_json(obj)
        if self.plan_seen is not None and self.plan_seen[0] == key:
            return self.plan_seen[1], self.plan_seen[2]
        plan = plan_from_json(obj, where=f"round {round_}'s plan")
        digest = plan_hash(plan)
        self.plan_seen = (key, plan, digest)
        return plan, digest

    def _prepare(self, plan: TrainingPlan, digest: str, task: RoundTask) -> torch.nn.Module:
        if digest != self.digest:
            self.module = build_model(plan.model, self.builders)
            self.spec = model_spec(self.module)
            self.optimizer, self.round_started, self.state_at_start = None, None, None
            self.digest = digest
        module, spec = self.module, self.spec
        assert module is not None  # set above
        assert spec is not None
        received = in_order(task.tensors, module.state_dict())
        mismatch = describe_mismatch(
            spec,
            model_spec(received),
            expected_label="the plan's",
            actual_label="the received",
        )
        if mismatch is not None:
            msg = f"the global model received does not fit the plan: {mismatch}"
            raise ConfigurationError(msg)
        with torch.no_grad():
            module.load_state_dict(received, strict=True)
        if plan.optimizer_state == "reset" or self.optimizer is None:
            self.optimizer = build_optimizer(plan.optimizer, module)
        if plan.optimizer_state == "keep":
            if self.round_started == task.round and self.state_at_start is not None:
                self.optimizer.load_state_dict(copy.deepcopy(self.state_at_start))
            else:
                self.round_started = task.round
                self.state_at_start = copy.deepcopy(self.optimizer.state_dict())
        return module

    async def _evaluate(self, plan: TrainingPlan, module: torch.nn.Module, round_: int) -> Evaluation | None:
        if self.validation_batches is None:
            return None
        stream = _Counted(_epochs(self.validation_batches, round_, 1), None)
        result = await one_epoch(
            model=build_supervised_model(plan, module), batches=stream, forward_only=True
        )
        return Evaluation(float(result), metrics_of(result), stream.examples)

    async def run_round(self, plan: TrainingPlan, digest: str, task: RoundTask) -> RoundReply:
        module = self._prepare(plan, digest, task)
        optimizer = self.optimizer
        assert optimizer is not None  # set by _prepare
        # Dropout and other randomness: a pure function of the plan's seed, the round and the node.
        seed_round(module, epoch_seed(plan.seed, task.round, zlib.crc32(self.name.encode())))
        before = await self._evaluate(plan, module, task.round)
        model = build_supervised_model(plan, module, metrics=False)  # training metrics are not sent
        wall, cpu = time.perf_counter(), time.process_time()
        if plan.local_steps is not None:
            # Round r chains the stream's epochs from r * S on: S steps never span more than S epochs.
            streams = [
                _Counted(_epochs(self.train_batches, task.round * plan.local_steps, None), plan.local_steps)
            ]
        else:
            epochs = plan.local_epochs or 1
            streams = [
                _Counted(_epochs(self.train_batches, task.round * epochs + e, 1), None) for e in range(epochs)
            ]
        loss_sum = 0.0
        for stream in streams:
            loss = await one_epoch(
                model=model, batches=stream, step_optimizer=optimizer.step, epoch=task.round
            )
            loss_sum += float(loss) * stream.examples
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        examples = sum(stream.examples for stream in streams)
        after = await self._evaluate(plan, module, task.round)
        state = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
        return RoundReply(
            round=task.round,
            plan_hash=digest,
            sample_count=examples,
            train_wall_s=max(wall, 0.0),
            train_cpu_s=max(cpu, 0.0),
            training_loss=loss_sum / examples if examples else math.nan,
            before=before,
            after=after,
            tensors=state,
        )


async def _connect(host: str, port: int, ssl_context: ssl.SSLContext | None, hostname: str | None) -> Any:
    stream: Any = await anyio.connect_tcp(host, port)
    if ssl_context is not None:
        stream = await wrap(stream, ssl_context, server_side=False, hostname=hostname or host)
    return stream


async def run_node(
    *,
    name: str,
    host: str,
    port: int,
    token: str | bytes,
    allow_list: str | os.PathLike[str],
    train_batches: BatchStreamFactory,
    validation_batches: BatchStreamFactory | None = None,
    builders: ModelBuilders | None = None,
    settings: NodeSettings | None = None,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> NodeSummary:
    """Serve the aggregator's rounds until it says the run is over.

    Args:
        name: this node's name, as the aggregator's records show it.
        host, port: the aggregator's address (the node connects out).
        token: the shared secret both ends prove they know.
        allow_list: this node's allow-list file of approved plan hashes (read every round).
        train_batches: this node's private training stream; epoch ``e`` of round ``r`` is
            ``train_batches(BatchContext(epoch=r * local_epochs + e))``.
        validation_batches: its validation stream (``BatchContext(epoch=r)``), or ``None``.
        builders: the architectures this node can build (default: the built-in ones).
        settings: timeouts and limits (:class:`NodeSettings`).
        ssl_context: a TLS client context, to speak TLS to the aggregator.
        server_hostname: the name in the aggregator's certificate (default ``host``).

    Returns:
        What the node did, once the aggregator finished the run.

    Raises:
        ConfigurationError: a bad argument.
        HandshakeError: the aggregator refused this node (wrong token) or did not prove the token.
        FederatedError: the aggregator could not be reached for ``connect_timeout`` seconds,
            or was silent for ``idle_timeout`` seconds.
    """
    reason = check_node_name(name)
    if reason is not None:
        raise ConfigurationError(reason)
    secret = check_token(token)
    context = check_context("ssl_context", ssl_context, server_side=False)
    if not callable(train_batches) or not (validation_batches is None or callable(validation_batches)):
        msg = "run_node: train_batches and validation_batches are batch-stream factories (context -> stream)"
        raise ConfigurationError(msg)
    if not isinstance(allow_list, (str, os.PathLike)):
        msg = (
            f"run_node: allow_list is the path of the node's allow-list file, got {type(allow_list).__name__}"
        )
        raise ConfigurationError(msg)
    if settings is not None and not isinstance(settings, NodeSettings):
        msg = f"run_node: settings must be NodeSettings, got {type(settings).__name__}"
        raise ConfigurationError(msg)
    config = settings or NodeSettings()
    trainer = _Trainer(name, train_batches, validation_batches, builders)
    trained: list[int] = []
    refused: list[int] = []
    allow_path = Path(allow_list)
    while True:
        link = await _reach(host, port, secret, name, config, context, server_hostname)
        logger.info("node %s joined the aggregator at %s:%d", name, host, port)
        try:
            finish = await _serve(link, trainer, allow_path, config, trained, refused)
        finally:
            await link.aclose()
        if finish is not None:
            return NodeSummary(tuple(trained), tuple(refused), finish.reason, finish.failed)
        logger.warning("node %s lost the aggregator; reconnecting", name)


async def _reach(
    host: str,
    port: int,
    secret: bytes,
    name: str,
    config: NodeSettings,
    context: ssl.SSLContext | None,
    server_hostname: str | None,
) -> Link:
    deadline = time.monotonic() + config.connect_timeout
    last = "no attempt"
    while time.monotonic() < deadline:
        try:
            with anyio.fail_after(min(config.handshake_timeout, max(deadline - time.monotonic(), 0.01))):
                stream = await _connect(host, port, context, server_hostname)
                link = Link(stream, max_frame_bytes=config.max_frame_bytes, peer=f"{host}:{port}")
                try:
                    await join_aggregator(link, secret, name)
                except BaseException:
                    await link.aclose()
                    raise
                return link
        except HandshakeError:
            raise
        except (OSError, TransportError, TimeoutError) as exc:
            last = explain(exc)
            if isinstance(exc, FrameError):  # not the aggregator being away: say it, then retry
                logger.warning("node %s: joining the aggregator failed, trying again: %s", name, last)
        await anyio.sleep(config.retry_interval)
    waited = config.connect_timeout
    msg = f"node {name!r} could not reach the aggregator at {host}:{port} for {waited:g} s: {last}"
    raise FederatedError(msg)


async def _serve(
    link: Link,
    trainer: _Trainer,
    allow_path: Path,
    config: NodeSettings,
    trained: list[int],
    refused: list[int],
) -> Finish | None:
    """Answer rounds until Finish (returned) or the connection is lost (``None``)."""
    while True:
        try:
            with anyio.move_on_after(config.idle_timeout) as idle:
                message = await link.receive()
            if idle.cancelled_caught:
                msg = f"node {trainer.name!r}: no message from the aggregator for {config.idle_timeout:g} s"
                raise FederatedError(msg)
        except TransportError as exc:
            logger.warning("node %s: %s", trainer.name, exc)
            return None
        if message is None:
            return None
        if isinstance(message, Finish):
            return message
        if isinstance(message, Refuse):
            msg = f"the aggregator refused node {trainer.name!r}: {message.reason}"
            raise HandshakeError(msg)
        if not isinstance(message, RoundTask):
            logger.warning("node %s: ignoring an unexpected %s", trainer.name, type(message).__name__)
            continue
        answer = await _answer(message, trainer, allow_path)
        (refused if isinstance(answer, RoundRefused) else trained).append(message.round)
        try:
            await link.send(answer)
        except TransportError as exc:
            logger.warning("node %s: %s", trainer.name, exc)
            return None


async def _answer(task: RoundTask, trainer: _Trainer, allow_path: Path) -> RoundReply | RoundRefused:
    try:
        plan, digest = trainer.read_plan(task.plan, task.round)
    except ConfigurationError as exc:
        return RoundRefused(task.round, "", f"node {trainer.name!r} cannot read the plan: {exc}")
    try:
        approved = load_allow_list(allow_path, missing_ok=True).allows(digest)
    except ConfigurationError as exc:
        approved = False
        logger.error("node %s: %s", trainer.name, exc)
    if not approved:
        reason = f"plan {digest} ({plan.name!r}) is not on node {trainer.name!r}'s allow-list {allow_path}"
        logger.warning("node %s refused round %d: %s", trainer.name, task.round, reason)
        return RoundRefused(task.round, digest, reason, not_approved=True)
    try:
        return await trainer.run_round(plan, digest, task)
    except (ConfigurationError, BatchError, NonFiniteLossError) as exc:  # this round only: say why
        reason = f"node {trainer.name!r} cannot train plan {digest}: {exc}"
        logger.warning("%s", reason)
        return RoundRefused(task.round, digest, reason)
