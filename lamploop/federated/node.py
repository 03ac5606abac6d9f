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

The work is done in modules of one job each: the round's training
(:mod:`lamploop.federated.node_trainer`), the settings (:mod:`lamploop.federated.settings`);
this module reaches the aggregator, answers or refuses its rounds, and reconnects.

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import attrs

# Imported before joining: the first optimizer step would import it inside round 0 (seconds).
import torch._dynamo  # noqa: F401

from lamploop.batches import BatchStreamFactory
from lamploop.checks import check_host
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
from lamploop.federated.models import ModelBuilders
from lamploop.federated.node_trainer import NodeTrainer
from lamploop.federated.node_trainer import seed_round as seed_round  # defined here before its module
from lamploop.federated.settings import NodeSettings
from lamploop.federated.wire import Finish, Refuse, RoundRefused, RoundReply, RoundTask, check_node_name
from lamploop.transport.connection import explain
from lamploop.transport.proofs import check_token
from lamploop.transport.settings import check_int_in
from lamploop.transport.tls import check_context, wrap

__all__ = ["NodeSettings", "NodeSummary", "run_node"]

logger = logging.getLogger("lamploop.federated")


@attrs.frozen
class NodeSummary:
    """What a node did: the rounds it trained and refused, and how the run ended."""

    trained: tuple[int, ...]
    refused: tuple[int, ...]
    finish_reason: str
    failed: bool


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
    check_int_in("run_node: port", port, 1, 65535)
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
    _check_builders(builders)
    check_host("run_node: host", host)
    check_host("run_node: server_hostname", server_hostname, optional=True)
    config = settings or NodeSettings()
    trainer = NodeTrainer(name, train_batches, validation_batches, builders)
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


def _check_builders(builders: object) -> None:
    """``builders`` is None or a mapping of architecture names to functions (``ModelBuilders``)."""
    if builders is None:
        return
    if not isinstance(builders, Mapping) or not all(
        isinstance(name, str) and callable(build) for name, build in builders.items()
    ):
        msg = (
            "run_node: builders must map architecture names to functions building a module from "
            f"the plan's options (e.g. {{'mlp': lamploop.federated.mlp}}), got {builders!r:.60}"
        )
        raise ConfigurationError(msg)


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
        connected = False
        try:
            with anyio.fail_after(min(config.handshake_timeout, max(deadline - time.monotonic(), 0.01))):
                stream = await _connect(host, port, context, server_hostname)
                connected = True
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
            if isinstance(exc, TimeoutError) and connected:  # it answered, then stalled
                last = f"connected, but the handshake did not finish within {config.handshake_timeout:g} s"
            if isinstance(exc, FrameError):  # not the aggregator being away: say it, then retry
                logger.warning("node %s: joining the aggregator failed, trying again: %s", name, last)
        await anyio.sleep(config.retry_interval)
    waited = config.connect_timeout
    msg = f"node {name!r} could not reach the aggregator at {host}:{port} for {waited:g} s: {last}"
    raise FederatedError(msg)


async def _serve(
    link: Link,
    trainer: NodeTrainer,
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
                silent = f"no message from the aggregator at {link.peer} for {config.idle_timeout:g} s"
                msg = f"node {trainer.name!r}: {silent} (frozen, cut off, or stuck)"
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


async def _answer(task: RoundTask, trainer: NodeTrainer, allow_path: Path) -> RoundReply | RoundRefused:
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
