"""The aggregator's round loop: each round sent, its answers collected and checked, FedAvg, a record.

:class:`RoundLoop` holds the connected nodes (as the listener's events say,
:mod:`lamploop.federated.node_listener`) and the global model, and runs the rounds of
:func:`~lamploop.federated.aggregator.run_aggregator`'s pseudocode: gather enough nodes, send
the round to every one (and to any that joins meanwhile), collect answers until each node sent
it answered, refused or was lost or ``round_timeout`` passed, then average the answers that fit
the global model (:func:`~lamploop.federated.fedavg.federated_average`), record the round and
checkpoint it; too few answers send the round again, ``round_attempts`` in all, then fail the
run naming the missing nodes and why.

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import anyio
import anyio.abc
import numpy as np
import torch
from anyio.streams.memory import MemoryObjectReceiveStream

from lamploop.errors import FederatedError, PlanNotApprovedError, TransportError
from lamploop.federated.checkpoints import save_round_checkpoint
from lamploop.federated.fedavg import federated_average
from lamploop.federated.link import Link
from lamploop.federated.node_listener import NodeEvent, NodeJoined, NodeLost
from lamploop.federated.plan import TrainingPlan, plan_hash, plan_to_json
from lamploop.federated.records import MissingNode, NodeReport, RoundRecord, pooled
from lamploop.federated.settings import AggregatorSettings
from lamploop.federated.wire import Finish, RoundRefused, RoundReply, RoundTask, encode_frame, in_order
from lamploop.modelspec import describe_mismatch, model_spec

__all__ = ["RoundLoop", "finite"]

logger = logging.getLogger("lamploop.federated")


class RoundLoop:
    """The round loop's state: the connected nodes and the global model."""

    def __init__(
        self,
        plan: TrainingPlan,
        settings: AggregatorSettings,
        events: MemoryObjectReceiveStream[NodeEvent],
        model: dict[str, torch.Tensor],
        rounds: tuple[RoundRecord, ...],
        names: frozenset[str],
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
        self.names = names  # the tensors FedAvg averages (the others keep the global model's)
        self.spec = model_spec(model)  # every round's global model's: FedAvg keeps names, shapes, dtypes

    def _track(self, event: NodeEvent) -> None:
        if isinstance(event, NodeJoined):
            old = self.links.get(event.name)
            self.links[event.name] = event.link
            logger.info("node %s joined", event.name)
            if old is not None and old is not event.link:
                logger.warning("node %s connected again: its old connection is dropped", event.name)
        elif isinstance(event, NodeLost) and self.links.get(event.name) is event.link:
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
        """Run the rounds left (after a resume, from the first not checkpointed); sends start in ``tg``.

        Raises:
            FederatedError: too few nodes joined in time, or a round had too few answers.
            PlanNotApprovedError: too few answers because the nodes refused the plan's hash.
        """
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
                if isinstance(event, NodeJoined):
                    send(event.name, event.link)  # a node that (re)joins gets the current round
                elif sent.get(event.name) is not event.link:
                    continue  # an old connection's, or a stranger's to this round
                elif isinstance(event, NodeLost):
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
        """Tell every connected node the run is over, and why (best effort, shielded from cancellation)."""
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
