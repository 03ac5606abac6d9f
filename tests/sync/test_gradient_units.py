"""The units of the gradients a strategy is handed, checked against a float64 gradient written here.

The contract (``lamploop.sync.strategy``'s module doc): a sync that does not say
``reduces_linearly = True`` gets, before ``reduce``, gradients whose sum over ranks is the
gradient of the step's mean loss, with ``scale`` exactly 1.0: at every step, the first of
a pass included, with accumulated batches, uneven streams and a partial last batch.  A
sync that says it reduces linearly may get a guessed divisor, and ``.grad * scale`` must
then be that gradient.  A strategy that kept state in the guessed units (PowerSGD before
0.3) trained to 0.72 instead of 0.96 on digits.

The reference is ``torch.autograd.grad`` of the mean cross-entropy over the union of the
step's examples of both ranks, at the parameters the step started from, in float64,
computed here from the batches each rank's model was actually given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import attrs
import pytest
import torch

import lamploop
from lamploop.distributed.process_group import create_store, new_process_group
from lamploop.sync import Collectives, GradientSync
from lamploop.sync.strategy import reduces_linearly

pytestmark = pytest.mark.anyio

BATCH, ACCUMULATE, EPOCHS = 4, 3, 2
# 38 examples in batches of 4: ten batches, the last of 2; rank 0 gets five, rank 1 five
# (its last partial). Steps of 3 batches: counts 24 then 14 per pass, guesses 1 then 24.
EXAMPLES = 38


@attrs.define
class Recorded:
    """What one rank's sync was handed at one step."""

    scale: float
    grads: list[torch.Tensor]
    params: list[torch.Tensor]


class RecordingSync:
    """Sums gradients in float64 after backward (as the docs' example) and records its inputs."""

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        log: list[Recorded],
        *,
        linear: bool,
    ) -> None:
        self._collectives = collectives
        self._parameters = [p for p in parameters if p.requires_grad]
        self._log = log
        if linear:
            self.reduces_linearly = True

    def begin_pass(self) -> None:
        for p in self._parameters:
            p.grad = None

    def last_backward(self) -> None:
        """Nothing starts early."""

    def reduce(self, scale: float) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._parameters]
        self._log.append(
            Recorded(
                scale, [g.detach().clone() for g in grads], [p.detach().clone() for p in self._parameters]
            )
        )
        for p, grad in zip(self._parameters, grads, strict=True):
            wide = grad.to(torch.float64)
            self._collectives.wait(self._collectives.all_reduce([wide]), "gradient sum")
            p.grad = (wide * scale).to(p.dtype)

    def after_step(self) -> None:
        self.begin_pass()

    def end_pass(self) -> None:
        """Nothing in flight."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Stateless."""

    def close(self, *, abandon: bool) -> None:
        """No hooks."""


@attrs.frozen
class RecordingStrategy:
    name: str
    linear: bool
    logs: dict[int, list[Recorded]]
    steps_on_every_rank: bool = True

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        log = self.logs.setdefault(collectives.rank, [])
        return RecordingSync(collectives, parameters, log, linear=self.linear)


class SeenBatches(torch.nn.Module):
    """The model, remembering every training batch it was given (in order)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(x.detach().clone())
        out: torch.Tensor = self.net(x)
        return out


def _mean_loss_gradient(
    params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, template: torch.nn.Module
) -> list[torch.Tensor]:
    """float64 gradient of the mean cross-entropy over ``x, y`` at ``params``, by autograd."""
    leaves = [p.clone().requires_grad_(True) for p in params]
    names = [name for name, _ in template.named_parameters()]
    out = torch.func.functional_call(template, dict(zip(names, leaves, strict=True)), (x,))
    loss = torch.nn.functional.cross_entropy(out, y, reduction="mean")
    return list(torch.autograd.grad(loss, leaves))


async def _run(
    linear: bool,
) -> tuple[dict[int, list[Recorded]], list[SeenBatches], torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(EXAMPLES, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (EXAMPLES,), generator=generator)
    logs: dict[int, list[Recorded]] = {}
    name = f"recording_{'linear' if linear else 'exact'}"
    lamploop.register_strategy(RecordingStrategy(name, linear, logs), replace=True)
    modules = [SeenBatches() for _ in range(2)]
    train = lamploop.tensor_batches(x, y, batch_size=BATCH, shuffle=False)
    with anyio.fail_after(60):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m, lamploop.cross_entropy_loss), train, None) for m in modules],
            lambda params: torch.optim.SGD(params, lr=0.5),
            EPOCHS,
            accumulate_gradient_over_n_batches=ACCUMULATE,
            strategy=name,
        )
    return logs, modules, x, y


def _targets_of(batch: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows = [int(torch.nonzero((x == row).all(dim=1))[0]) for row in batch]
    return y[rows]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("linear", [False, True], ids=["exact-units", "reduces-linearly"])
async def test_every_step_hands_the_strategy_the_gradient_of_the_steps_mean_loss(linear: bool) -> None:
    logs, modules, x, y = await _run(linear)
    steps_per_pass = 2
    assert [len(logs[r]) for r in (0, 1)] == [EPOCHS * steps_per_pass] * 2
    template = SeenBatches().net
    first_scales = []
    for step in range(EPOCHS * steps_per_pass):
        examples_x, examples_y = [], []
        for rank in (0, 1):
            # this rank's batches of the step: the module saw them in order, ACCUMULATE per full step
            seen = modules[rank].seen
            per_pass = len(seen) // EPOCHS
            first = (step // steps_per_pass) * per_pass + (step % steps_per_pass) * ACCUMULATE
            last = min(first + ACCUMULATE, (step // steps_per_pass + 1) * per_pass)
            for batch in seen[first:last]:
                examples_x.append(batch)
                examples_y.append(_targets_of(batch, x, y))
        union_x, union_y = torch.cat(examples_x), torch.cat(examples_y)
        assert len(union_x) == (24 if step % steps_per_pass == 0 else 14)
        recorded = [logs[rank][step] for rank in (0, 1)]
        for a, b in zip(recorded[0].params, recorded[1].params, strict=True):
            assert torch.equal(a, b)
        want = _mean_loss_gradient(recorded[0].params, union_x, union_y, template)
        scales = [r.scale for r in recorded]
        assert scales[0] == scales[1]
        if not linear:
            assert scales == [1.0, 1.0], f"step {step}: a sync that is not linear was given scale {scales}"
        got = [(g0 + g1) * scales[0] for g0, g1 in zip(recorded[0].grads, recorded[1].grads, strict=True)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        if step % steps_per_pass == 0:
            first_scales.append(scales[0])
    if linear:
        # The linear path is the guess-and-correct one: a pass's first step is corrected by 1/24.
        assert first_scales == [1 / 24] * EPOCHS


def test_the_registered_strategies_say_which_reduce_linearly() -> None:
    """Only plain sums may be handed guessed units; the compressing and stateful ones get exact units."""
    store, _ = create_store("127.0.0.1", 1, 20.0)
    cpu = torch.device("cpu")
    group = new_process_group(store, rank=0, nranks=1, device=cpu, timeout=20.0, prefix="units")
    collectives = Collectives(group, rank=0, nranks=1, device=cpu, timeout=20.0)
    module = torch.nn.Linear(8, 8)
    got: dict[str, bool] = {}
    built_in = ("all_reduce", "all_reduce_bf16", "all_reduce_fp16", "diloco8", "local_sgd8")
    built_in += ("powersgd1", "powersgd4", "reduce_to_root")
    for name in built_in:  # other test modules register strategies of their own in this process
        strategy = lamploop.sync.strategy_named(name)
        sync = strategy.gradient_sync(collectives, list(module.parameters()), [module], bucket_cap_mb=1.0)
        got[name] = reduces_linearly(sync)
        sync.close(abandon=False)
    assert got == {
        "all_reduce": True,
        "all_reduce_bf16": True,
        "all_reduce_fp16": False,
        "diloco8": False,
        "local_sgd8": False,
        "powersgd1": False,
        "powersgd4": False,
        "reduce_to_root": True,
    }
