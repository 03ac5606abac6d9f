"""The training pass of :func:`~lamploop.loop.epoch_pass.one_epoch`: one rank's steps.

:class:`TrainingPass` runs the loop of :mod:`lamploop.loop.epoch_pass`'s module doc: up to k
forwards and backwards per step, the step's sum over ranks, the gradient sync's reduce, the
optimizer step, and the step boundary's checkpoint and stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import torch

from lamploop.batches import BatchStream
from lamploop.errors import BatchError, NonFiniteLossError, mark_detected_by_every_rank
from lamploop.loop.batch_checks import NONE_BATCH, check_finite, prepare
from lamploop.loop.boundary import EpochStart, EpochStopped, StepBoundary, StepProgress
from lamploop.loop.forward import BackwardSeeds, Forward
from lamploop.loop.metric_sums import MetricSums
from lamploop.loop.non_finite import NonFiniteLossPolicy, bad_ranks, step_error, step_loss
from lamploop.loop.pass_totals import Yielder, epoch_totals
from lamploop.loop.precision import LossScale, unscale_and_check
from lamploop.loop.profiler import StepProfiler
from lamploop.loop.step_timing import StepTimes, communication_clock
from lamploop.loop.stop_aware import watching
from lamploop.model import SupervisedModel
from lamploop.sync.channel import PendingSum, TensorChannel
from lamploop.sync.strategy import CountsStepExamples, GradientSync, reduces_linearly

__all__ = ["StepExtras", "TrainingPass"]

# The skipped-step warning keeps the logger name it had before the pass moved here: a
# user's logging configuration (and tests/loop/test_non_finite.py) filter on it.
_log = logging.getLogger("lamploop.loop.epoch_pass")


@attrs.frozen
class StepExtras:
    """What a training step does beyond forward, backward and the optimizer step (see ``one_epoch``)."""

    policy: NonFiniteLossPolicy
    forward: Forward
    metrics: MetricSums
    max_gradient_norm: float | None
    loss_scale: LossScale | None
    before_step: Callable[[int], object] | None
    after_step: Callable[[int, float | torch.Tensor], object] | None
    step_times: StepTimes | None = None
    profiler: StepProfiler | None = None


_ENDED: Any = object()
"""``anext``'s default: the stream ended (a ``None`` it yields is a malformed batch)."""


class TrainingPass:
    """One training pass of one rank; :meth:`run` is the loop of the module doc."""

    def __init__(
        self,
        model: SupervisedModel,
        channel: TensorChannel,
        step_optimizer: Callable[[], object],
        k: int,
        device: torch.device | None,
        epoch: int | None,
        start: EpochStart,
        boundary: StepBoundary | None,
        extras: StepExtras,
    ) -> None:
        self.model, self.channel, self.step_optimizer, self.k = model, channel, step_optimizer, k
        self.device, self.epoch, self.boundary = device, epoch, boundary
        self.policy, self.forward, self.metrics = extras.policy, extras.forward, extras.metrics
        self.max_gradient_norm, self.loss_scale = extras.max_gradient_norm, extras.loss_scale
        self.before_step, self.after_step = extras.before_step, extras.after_step
        self.times, self.profiler = extras.step_times, extras.profiler
        self.rank, self.single = channel.rank, channel.nranks == 1
        # A strategy that steps on the root alone (reduce_to_root) sends the stepped parameters
        # to the others after the step: a follower's own step would be work and optimizer
        # state for nothing.
        strategy = getattr(channel, "strategy", None)
        self.steps_here = self.rank == 0 or getattr(strategy, "steps_on_every_rank", True) is not False
        self.losses: list[torch.Tensor] = []
        self.first_index = start.steps_done * k
        self.start_loss_sum = start.loss_sum
        self.count = start.example_count
        self.steps_done = start.steps_done
        self.previous_global_count = start.last_step_examples
        self.scales = BackwardSeeds()
        self.upcoming: Any = None
        self.step_first = 0  # where the current step's batches start in self.losses
        self.skipped_steps = 0
        self.exact_units = False  # set by run() from the sync (see sync.strategy's module doc)
        # A sync whose every forward is a collective (fsdp, ``pads_steps``): every rank runs k
        # forwards per step, a rank without a batch a zero-seeded stand-in (see _stand_in).
        self.pads = False
        self.stand_in: Any = None
        self.any_more = True  # some rank has a batch for the next step (carried in the step sum)

    def _requests(self) -> list[float]:
        requests = (
            [0.0, 0.0]
            if self.boundary is None
            else [float(f) for f in self.boundary.requests(self.steps_done)]
        )
        return [*requests, float(self.upcoming is not None)] if self.pads else requests

    def _loss_sum(self) -> float:
        """This rank's loss sum so far, added up one batch after the other in float64.

        A sequential sum (a CPU cumsum is one) from the resumed pass's starting sum gives
        the bits of the uninterrupted pass's sum: resuming at a boundary changes nothing.
        """
        start = torch.tensor([self.start_loss_sum], dtype=torch.float64)
        if not self.losses:
            return float(start[0])
        losses = torch.stack(self.losses).to(device="cpu", dtype=torch.float64).reshape(-1)
        return float(torch.cat([start, losses]).cumsum(0)[-1])

    async def run(self, batches: BatchStream) -> tuple[float, float, list[float]]:
        """Train over ``batches``; the pass's loss sum, example count and metric sums over all ranks.

        A stop-aware stream's waits are watched by one task for the whole pass
        (:func:`~lamploop.loop.stop_aware.watching`); see :meth:`_run`.
        """
        async with watching(batches):
            return await self._run(batches)

    async def _run(self, batches: BatchStream) -> tuple[float, float, list[float]]:
        """The pass of :meth:`run`.

        Skips the batches of the steps a resumed pass has done, then runs steps until the
        step's sum over ranks counts no example: each step is ``_forward_backward`` (up to k
        batches), the sum of counts and boundary requests (waited for here unless
        ``_exact_divisor`` did), the sync's reduce, the optimizer step (or a non-finite
        step's raise or skip), ``after_step``, and at a requested boundary a checkpoint or
        stop (:class:`~lamploop.loop.boundary.EpochStopped`).  The pass ends with the sync's
        ``end_pass``, the buffers' sync and one all-reduce of the epoch's totals.

        Raises:
            NonFiniteLossError: a non-finite loss under ``"raise"``, or every step skipped.
            BatchError: (padding syncs) some ranks have no batch to start the pass with.
            EpochStopped: the ranks stopped at a step boundary on request.
        """
        sync = self.channel.gradient_sync(self.model.module)
        told_examples = sync if isinstance(sync, CountsStepExamples) else None
        # A sync that is not linear is given the step's exact units (see sync.strategy).
        self.exact_units = not self.single and not reduces_linearly(sync)
        self.pads = not self.single and getattr(sync, "pads_steps", False) is True
        self.model.module.train()
        sync.begin_pass()
        yield_now = Yielder()
        stream: AsyncIterator[Any] = aiter(batches)
        for index in range(self.first_index):  # the steps a resumed pass has done already
            done = await anext(stream, None)
            if done is None:
                break
            if index == 0 and self.pads:  # the uninterrupted pass's stand-in, as it took it
                self.stand_in = done
        if self.profiler is not None:
            self.profiler.start()  # before the clock starts: turning it on is no step's time
        times = self.times
        if times is not None:
            times.begin(communication_clock(self.channel))
        await self._next_batch(stream)
        if self.pads:
            self.any_more = self._every_rank_starts()
        while True:
            exact_step = self._exact_first_step()
            expected, group_count, pending = await self._forward_backward(stream, sync, exact_step)
            if times is not None:
                times.backward_done()
            if self.single:
                # One rank looks at its requests after the step (below): a stop requested while
                # the step ran ends the pass at the step's own boundary.
                global_count, checkpoint, stop = group_count, 0, 0
                if self.boundary is not None and global_count == 0:
                    checkpoint, stop = self.boundary.requests(self.steps_done)
                step_losses = self._local_step_losses()
            else:
                if pending is None:  # no batch left here: take part with zero examples
                    pending = self._begin_step_sum(group_count)
                counts, wants_checkpoint, wants_stop, *step_losses = pending.wait()
                global_count, checkpoint, stop = int(counts), int(wants_checkpoint), int(wants_stop)
                if self.pads:
                    more, *step_losses = step_losses
                    self.any_more = more > 0
            if global_count == 0 and len(self.losses) > self.step_first:
                # Batches came but their loss counted no example: a step that counts none is
                # the end of the pass, which would drop the rest of the epoch without a word.
                first = self.first_index + self.step_first
                msg = (
                    f"epoch {self.epoch}, batch {first}, rank {self.rank}: the loss counted 0 examples "
                    f"in this step's {len(self.losses) - self.step_first} batch(es) (on every rank); "
                    "a step that counts none ends the pass, so every step must count at least one "
                    "example (leave out batches whose examples are all masked)"
                )
                raise BatchError(msg)
            if global_count == 0:
                if stop and self.boundary is not None:
                    # Every rank waited for a batch when a stop was requested (no producer yet,
                    # or a stalled one): stop at this boundary (DESIGN.md section 8).
                    await self._at_boundary(sync, stop=True)
                if times is not None:
                    times.not_a_step()
                break
            if self.exact_units or exact_step:  # also on a rank without a batch: every rank's scale is 1.0
                expected = global_count
            self.previous_global_count = global_count
            if told_examples is not None:
                told_examples.step_examples(expected=expected, local=group_count, total=global_count)
            sync.reduce(expected / global_count)
            bad = bad_ranks(step_losses)
            if bad:
                self._non_finite_step(bad, step_losses)
            else:
                self.count += group_count
                self._step()
            sync.after_step()
            if times is not None:
                times.optimizer_done()
            self.steps_done += 1
            if self.profiler is not None:
                self.profiler.step()
            if self.after_step is not None:
                self.after_step(global_count, sum(step_losses) if step_losses else self._step_loss())
            await yield_now()  # other tasks' turn; a signal that came during the step reaches the request
            if self.single and self.boundary is not None:
                checkpoint, stop = self.boundary.requests(self.steps_done - 1)
            if (checkpoint or stop) and self.boundary is not None:
                began = time.perf_counter()
                await self._at_boundary(sync, stop=bool(stop))
                if times is not None:
                    times.checkpointed(began)
            if times is not None:
                times.step_done()
        sync.end_pass()
        self.channel.sync_buffers(self.model.module)
        total_loss, global_total, metric_totals = await epoch_totals(
            self.channel, [self._loss_sum(), self.count], self.metrics
        )
        check_finite(self.losses, total_loss, self.epoch, self.rank, first_index=self.first_index)
        if global_total == 0 and self.skipped_steps > 0:
            place = "" if self.epoch is None else f" of epoch {self.epoch}"
            msg = f"all {self.skipped_steps} steps{place} had a non-finite loss and were skipped"
            raise NonFiniteLossError(msg, epoch=self.epoch, batch=None)
        return total_loss, global_total, metric_totals

    def _step(self) -> None:
        """The optimizer step on the step's complete gradients (unscaled and clipped first)."""
        if self.loss_scale is not None:
            found_inf = unscale_and_check(list(self.model.module.parameters()), self.loss_scale.scale)
            self.loss_scale.update(found_inf=found_inf)
            if found_inf:  # every rank holds the same reduced gradients: every rank skips
                return
        if self.max_gradient_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.module.parameters(), self.max_gradient_norm)
        if self.before_step is not None:
            self.before_step(self.steps_done)
        if self.steps_here:
            self.step_optimizer()

    def _begin_step_sum(self, group_count: int) -> PendingSum:
        """Start the step's sum over ranks: [examples, checkpoint?, stop?] + every rank's loss sum."""
        per_rank = step_loss(self.losses[self.step_first :])
        return self.channel.begin_all_reduce_sum([group_count, *self._requests()], per_rank=per_rank)

    def _step_loss(self) -> float | torch.Tensor:
        """This rank's loss sum of the step just done (a tensor: not read, not waited for)."""
        return step_loss(self.losses[self.step_first :])

    def _local_step_losses(self) -> list[float]:
        """One rank: its step's loss sum, when reading it waits for nothing (or a skip needs it)."""
        loss = step_loss(self.losses[self.step_first :])
        if isinstance(loss, float) or self.policy == "skip_step":
            return [float(loss)]
        return []  # on a device, "raise" is left to the epoch's end: no wait per step

    def _non_finite_step(self, ranks: tuple[int, ...], step_losses: Sequence[float]) -> None:
        """A step with a non-finite loss on ``ranks``: raise, or drop it on every rank alike."""
        step_batches = self.losses[self.step_first :]
        first = self.first_index + self.step_first  # this step's first batch, on every rank
        batch = None
        if self.rank in ranks:
            batch = first + torch.isfinite(torch.stack(step_batches)).tolist().index(False)
        error = step_error(
            epoch=self.epoch,
            step=self.steps_done,
            batches=range(first, first + self.k),
            ranks=ranks,
            per_rank=step_losses,
            rank=self.rank,
            batch=batch,
            skipped=self.policy == "skip_step",
        )
        if self.policy == "raise":
            raise error
        # The step's batches leave the epoch's loss (zeros keep the batch positions).
        self.losses[self.step_first :] = [torch.zeros_like(loss) for loss in step_batches]
        if self.metrics:
            self.metrics.drop_from(self.step_first)
        self.skipped_steps += 1
        _log.warning("%s", error)

    async def _at_boundary(self, sync: GradientSync, *, stop: bool) -> None:
        if self.boundary is None:
            return
        sync.end_pass()  # nothing in flight: every rank holds the step's parameters
        self.channel.sync_buffers(self.model.module)  # what the checkpoint holds, every rank holds
        progress = StepProgress(
            steps_done=self.steps_done,
            loss_sum=self._loss_sum(),
            example_count=self.count,
            last_step_examples=self.previous_global_count,
            metric_sums=tuple(self.metrics.totals()) if self.metrics else (),
        )
        await self.boundary.reached(progress, stop=stop)
        if stop:
            raise EpochStopped(progress)

    def _exact_first_step(self) -> bool:
        """Whether this step waits for its global count before its last backward although its
        sync reduces linearly: a pass's first step under fp16's loss scale on several ranks.

        The guess of a step's count is the previous step's, 1 at a pass's first step, and the
        reduce corrects by guess / count; but fp16's gradients are seeded with scale / guess, and
        a guess the step's count times too small overflows them, so that GradScaler's rules skip a
        step that the same batches on one rank would take.
        """
        return self.loss_scale is not None and not self.single and not self.previous_global_count

    def _exact_divisor(self, pending: PendingSum, *, guess: int) -> int:
        """The step's global example count, waited for before its last backward.

        The step's earlier batches were backpropagated with ``guess``: their gradients are
        rescaled to the count (only when the guess missed, at a pass's first step or where
        the count changes), so the sync is handed gradients of the step's mean loss.
        """
        total = int(pending.wait()[0])
        if total != guess and len(self.losses) - self.step_first > 1:
            grads = [p.grad for p in self.model.module.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, guess / total)
        return total

    async def _next_batch(self, stream: AsyncIterator[Any]) -> None:
        """Await the batch after the one in hand into ``self.upcoming`` (``None``: the stream
        ended; a ``None`` the stream yields is NONE_BATCH, which ``prepare`` refuses)."""
        began = time.perf_counter() if self.times is not None else 0.0
        item = await anext(stream, _ENDED)
        self.upcoming = None if item is _ENDED else NONE_BATCH if item is None else item
        if self.times is not None:
            self.times.waited_for_data(began)

    async def _forward_backward(
        self, stream: AsyncIterator[Any], sync: GradientSync, exact_step: bool
    ) -> tuple[int, int, PendingSum | None]:
        """Up to k batches: the step's guess of its global count, its local count, the sum in flight
        (``exact_step``: the count waited for before the last backward, :meth:`_exact_first_step`)."""
        # Backprop loss / expected, expected being a guess of the step's global example
        # count that every rank makes alike (also a rank with no batch left): the previous
        # step's, 1 at a pass's first step.  reduce() corrects by expected / actual, exactly
        # 1 (no pass) when the guess holds; a sync that is not linear gets the actual count
        # before the last backward instead (_exact_divisor).
        expected = self.previous_global_count or 1
        self.step_first = len(self.losses)
        group_count = 0
        pending: PendingSum | None = None
        if self.pads and not self.any_more:
            return expected, group_count, pending  # no rank has a batch: the pass ends
        for position in range(self.k):
            if self.upcoming is None:
                if not self.pads:
                    break
                pending = self._stand_in(position, sync, group_count) or pending
                continue
            index = self.first_index + len(self.losses)
            batch = prepare(self.upcoming, self.device, self.epoch, index, self.rank)
            if self.pads and self.stand_in is None:
                self.stand_in = batch
            await self._next_batch(stream)
            loss_sum, n, values = self.forward(batch, self.epoch, index, self.rank)
            if self.metrics:
                self.metrics.add(values)
            if position == 0 and self.single:
                expected = self.k * n  # one rank knows its step's count up front
            elif position == 0 and exact_step:
                # This rank's estimate, for the batches before the step's count is known (they
                # are rescaled to it then): a guess of 1 would scale fp16's gradients up by the
                # step's count, into overflow.
                expected = self.k * n * self.channel.nranks
            self.losses.append(loss_sum.detach())
            group_count += n
            if not self.single and (position == self.k - 1 or (self.upcoming is None and not self.pads)):
                # Every rank starts the count (with its requests) before any gradient
                # bucket, so the collectives pair up in the same order on all ranks.
                pending = self._begin_step_sum(group_count)
                if self.exact_units or exact_step:
                    expected = self._exact_divisor(pending, guess=expected)
                sync.last_backward()
            if self.loss_scale is not None:
                seed = self.loss_scale.scale / expected
                loss_sum.backward(torch.full((), seed, dtype=loss_sum.dtype, device=loss_sum.device))
            elif expected == 1:
                loss_sum.backward()
            else:
                # Seeding backward with 1/expected gives the gradients of loss_sum / expected
                # bit for bit, without a division node in the graph.
                loss_sum.backward(self.scales.get(expected, loss_sum))
        return expected, group_count, pending

    def _every_rank_starts(self) -> bool:
        """Whether any rank has a batch; raises on every rank when some have and some cannot take part.

        A padding rank's stand-in is its own first batch of the pass (a resumed pass kept it
        while skipping the steps done): a rank with neither a batch nor a stand-in has nothing
        to run the forwards the others' collectives wait for.
        """
        has_batch = self.upcoming is not None
        sums = self.channel.all_reduce_sum([float(has_batch), float(has_batch or self.stand_in is not None)])
        having, able = int(sums[0]), int(sums[1])
        if having > 0 and able < self.channel.nranks:
            place = "" if self.epoch is None else f"epoch {self.epoch}: "
            msg = (
                f"{place}{self.channel.nranks - able} of {self.channel.nranks} ranks have no training "
                "batch to start the pass with; a sharded model (strategy 'fsdp') runs every forward on "
                "every rank, so each rank's stream needs at least one batch"
            )
            raise mark_detected_by_every_rank(BatchError(msg))
        return having > 0

    def _stand_in(self, position: int, sync: GradientSync, group_count: int) -> PendingSum | None:
        """A padding rank's micro-batch without a batch: its first batch, backward seeded with zero.

        It takes part in the forward's and backward's collectives and adds nothing: no
        example, no loss, no metric, a zero gradient.  At the step's last position it starts
        the step's sum, as a rank with a batch does there.
        """
        loss_sum, _, _ = self.forward(self.stand_in, self.epoch, self.first_index, self.rank)
        pending = None
        if position == self.k - 1:
            pending = self._begin_step_sum(group_count)
            sync.last_backward()
        loss_sum.backward(torch.zeros((), dtype=loss_sum.dtype, device=loss_sum.device))
        return pending
