"""A node's training: its model and optimizer across rounds, and one round's work on its own data.

:class:`NodeTrainer` does what a node does between receiving a round and answering it
(:mod:`lamploop.federated.node`'s pseudocode): read the round's plan (parsed and hashed once
while the plan stays the same), build the plan's model (again only when the plan changes) and
load the global model into it, keep or reset the optimizer state as the plan says, validate,
train ``local_epochs`` epochs or ``local_steps`` steps with :func:`~lamploop.loop.one_epoch`,
validate again, and return the reply.  A round's randomness (dropout...) and data order are
pure functions of the plan's seed, the round and the node's name, and a round sent twice is
trained from the optimizer state it first started from, so the answer is the same.

.. versionadded:: 0.3
"""

from __future__ import annotations

import copy
import itertools
import math
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import torch

from lamploop.batches import Batch, BatchContext, BatchStream, BatchStreamFactory, epoch_seed
from lamploop.errors import ConfigurationError
from lamploop.federated.models import ModelBuilders, build_model, build_optimizer, build_supervised_model
from lamploop.federated.plan import TrainingPlan, canonical_json, plan_from_json, plan_hash
from lamploop.federated.wire import Evaluation, RoundReply, RoundTask, in_order
from lamploop.loop import one_epoch
from lamploop.metrics import metrics_of
from lamploop.modelspec import ModelSpec, describe_mismatch, model_spec

__all__ = ["NodeTrainer", "seed_round"]


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


class NodeTrainer:
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
        """Train ``task``'s round of ``plan`` (whose hash is ``digest``) on this node's data; the reply.

        Raises:
            ConfigurationError: the global model received does not fit the plan.
            BatchError: a malformed batch.
            NonFiniteLossError: the loss was NaN or infinite.
        """
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
