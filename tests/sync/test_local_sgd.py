"""Local SGD and DiLoCo: H=1 equals all-reduce, the average is example-weighted, state survives files.

The equivalence runs train through :func:`lamploop.local_data_parallel_training_loop` (one
thread per rank, real Gloo groups, the in-process control channel), in float64 with plain
SGD, on uneven streams: with ``H = 1`` and plain averaging the average of the ranks'
parameters after their own steps is the parameters of one step on the example-weighted
gradient, which is what ``all_reduce`` computes, up to rounding.  The other tests drive
:class:`~lamploop.sync.local_sgd.LocalSGDSync` directly on threads (see
tests/sync/test_strategies_compression.py's ``run_ranks``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_distributed import EPOCHS, uneven_run
from test_strategies_compression import run_ranks
from torch import nn
from workers import rank as worker

import lamploop
from lamploop.errors import CheckpointError, ConfigurationError, DistributedError
from lamploop.sync import Collectives, LocalSGD, OuterNesterov
from lamploop.sync.local_sgd import LocalSGDSync

pytestmark = pytest.mark.anyio

EXACT_ATOL = 1e-12  # float64: the two sums differ in rounding only


async def train(
    run: dict[str, Any], strategy: str
) -> tuple[lamploop.LoopState, list[dict[str, torch.Tensor]]]:
    """Every rank's final parameters after the run, and the root's state."""
    nranks, data = len(run["members"]), run["data"]
    modules = [worker.make_module(run["model"], rank) for rank in range(nranks)]
    train_batches = worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r))
    valid_batches = worker.stream_factory(lambda e, r: worker.valid_batches_of(data, e, r))
    with anyio.fail_after(60):
        state = await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train_batches, valid_batches) for m in modules],
            worker.optimizer_factory({"name": "sgd", "lr": 0.3, "momentum": 0.0}),
            EPOCHS,
            accumulate_gradient_over_n_batches=run["k"],
            strategy=strategy,
        )
    return state, [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]


@pytest.mark.parametrize(
    ("train_batches", "k"),
    [
        ([7, 4], 1),  # rank 1 runs dry 3 steps before rank 0
        ([4, 0, 3], 2),  # rank 1 never has a batch; rank 2 ends in the middle of a group
    ],
)
async def test_local_sgd_with_h_1_equals_all_reduce_for_sgd(train_batches: list[int], k: int) -> None:
    lamploop.register_strategy(LocalSGD(every_n_steps=1, name="test_local_sgd1"), replace=True)
    run = uneven_run(train_batches, [2] * len(train_batches), k, "all_reduce")
    expected_state, expected = await train(run, "all_reduce")
    state, actual = await train(run, "test_local_sgd1")
    curve = [(e.epoch, e.training_loss, e.validation_loss) for e in state.learning_curve]
    expected_curve = [(e.epoch, e.training_loss, e.validation_loss) for e in expected_state.learning_curve]
    assert len(curve) == len(expected_curve) == EPOCHS
    for (epoch, loss, valid), (_, e_loss, e_valid) in zip(curve, expected_curve, strict=True):
        assert loss == pytest.approx(e_loss, abs=EXACT_ATOL, rel=0), f"epoch {epoch}"
        assert valid == pytest.approx(e_valid, abs=EXACT_ATOL, rel=0), f"epoch {epoch}"
    for rank, (params, reference) in enumerate(zip(actual, expected, strict=True)):
        for name in reference:
            torch.testing.assert_close(
                params[name], reference[name], atol=EXACT_ATOL, rtol=0, msg=f"rank {rank}, {name}"
            )


async def test_local_sgd_8_trains_and_ends_every_epoch_alike_on_every_rank() -> None:
    run = uneven_run([7, 4], [2, 2], 1, "all_reduce")
    state, params = await train(run, "local_sgd8")
    assert len(state.learning_curve) == EPOCHS
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), name  # averaged at the end of the pass
    _, synchronous = await train(run, "all_reduce")
    gap = max(float((params[0][n] - synchronous[0][n]).abs().max()) for n in params[0])
    assert gap > 1e-4  # it did approximate: the ranks drifted apart between averages


def weighted_average(rank: int, collectives: Collectives, strategy: LocalSGD, local: list[int]) -> Any:
    """Rank ``r``'s parameter starts at ``r + 1``; it trains on ``local[r]`` examples; one average."""
    module = nn.Linear(3, 2, dtype=torch.float64)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(0.0)
    sync = strategy.gradient_sync(collectives, list(module.parameters()), [module], bucket_cap_mb=25.0)
    assert isinstance(sync, LocalSGDSync)
    sync.begin_pass()
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(rank + 1.0)  # as if this rank had stepped there
    module(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    sync.step_examples(expected=10, local=local[rank], total=sum(local))
    sync.reduce(10 / sum(local))
    dry_grads = [p.grad for p in module.parameters()]
    sync.after_step()
    return [p.detach().clone() for p in module.parameters()], dry_grads, sync.averages


async def test_the_average_is_weighted_by_examples_and_a_dry_rank_does_not_step() -> None:
    local = [6, 0, 2]
    results = await run_ranks(3, lambda r, c: weighted_average(r, c, LocalSGD(every_n_steps=1), local))
    expected = (6 * 1.0 + 0 * 2.0 + 2 * 3.0) / 8
    for params, _, averages in results:
        assert averages == 1
        for p in params:
            assert torch.equal(p, torch.full_like(p, expected))
    assert all(g is None for g in results[1][1])  # no example: the optimizer would skip it
    assert all(g is not None for g in results[0][1])


async def test_diloco_steps_nesterov_momentum_on_the_averaged_change() -> None:
    local = [3, 1]
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    results = await run_ranks(
        2, lambda r, c: weighted_average(r, c, LocalSGD(every_n_steps=1, outer=outer), local)
    )
    average = (3 * 1.0 + 1 * 2.0) / 4
    outer_gradient = 0.0 - average  # start (0) minus the average
    velocity = outer_gradient  # 0.9 * 0 + g
    update = outer_gradient + 0.9 * velocity
    expected = 0.0 - 0.7 * update
    for params, _, _ in results:
        for p in params:
            torch.testing.assert_close(p, torch.full_like(p, expected), atol=1e-15, rtol=0)
    plain = await run_ranks(
        2,
        lambda r, c: weighted_average(
            r, c, LocalSGD(every_n_steps=1, outer=OuterNesterov(lr=1.0, momentum=0.0)), local
        ),
    )
    for p in plain[0][0]:
        torch.testing.assert_close(p, torch.full_like(p, average), atol=1e-15, rtol=0)


async def test_diloco_state_round_trips_through_a_checkpoint_file(tmp_path: Path) -> None:
    """Three averaging rounds, or one, files, then two: the same parameters, bit for bit."""
    strategy = LocalSGD(every_n_steps=2, outer=OuterNesterov())

    def rounds(rank: int, collectives: Collectives, span: range, resume: bool) -> list[torch.Tensor]:
        module = nn.Linear(4, 3, dtype=torch.float64)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
        if resume:
            module.load_state_dict(load_file(tmp_path / f"model-{rank}.safetensors"))
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        sync = strategy.gradient_sync(collectives, list(module.parameters()), [module], bucket_cap_mb=25.0)
        if resume:
            sync.load_state_dict(load_file(tmp_path / f"sync-{rank}.safetensors"))
        sync.begin_pass()
        data = torch.Generator().manual_seed(1 + rank)
        for s in range(2 * span.stop):
            x = torch.randn(3 + rank, 4, generator=data, dtype=torch.float64)
            if s < 2 * span.start:
                continue
            module(x).pow(2).sum().backward()
            sync.step_examples(expected=1, local=len(x), total=7)
            sync.reduce(1 / 7)
            opt.step()
            sync.after_step()
        sync.end_pass()
        if not resume and span.stop == 1:
            save_file(sync.state_dict(), tmp_path / f"sync-{rank}.safetensors")
            save_file(
                {k: v.contiguous() for k, v in module.state_dict().items()},
                tmp_path / f"model-{rank}.safetensors",
            )
        return [p.detach().clone() for p in module.parameters()]

    uninterrupted = await run_ranks(2, lambda r, c: rounds(r, c, range(3), False))
    await run_ranks(2, lambda r, c: rounds(r, c, range(1), False))
    resumed = await run_ranks(2, lambda r, c: rounds(r, c, range(1, 3), True))
    for a, b in zip(uninterrupted[0], resumed[0], strict=True):
        assert torch.equal(a, b)
    state = load_file(tmp_path / "sync-0.safetensors")
    assert float(state["momentum.0"].abs().max()) > 0  # there was momentum to carry


async def test_a_bad_state_or_a_loop_that_does_not_count_is_refused() -> None:
    def body(rank: int, collectives: Collectives) -> None:
        module = nn.Linear(2, 2)
        sync = LocalSGD(outer=OuterNesterov()).gradient_sync(
            collectives, list(module.parameters()), [module], bucket_cap_mb=25.0
        )
        with pytest.raises(CheckpointError, match=r"missing keys \['anchor.0', 'anchor.1', 'momentum.0'"):
            sync.load_state_dict(
                {"steps_in_window": torch.tensor(0), "window_examples": torch.tensor([0, 0])}
            )
        with pytest.raises(DistributedError, match="without step_examples"):
            sync.reduce(1.0)

    await run_ranks(1, body)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LocalSGD(every_n_steps=0), r"every_n_steps must be an int >= 1, got 0"),
        (lambda: LocalSGD(outer=0.7), r"outer must be an OuterNesterov or None, got 0.7"),
        (lambda: OuterNesterov(lr=0), r"lr must be a finite number > 0, got 0"),
        (lambda: OuterNesterov(momentum=1.0), r"momentum must be a number in \[0, 1\), got 1.0"),
        (lambda: lamploop.TrainingSettings(strategy="local_sgd"), r"one of .*local_sgd8.*got 'local_sgd'"),
    ],
)
def test_bad_configuration_is_refused_before_training(make: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_the_registered_defaults() -> None:
    local = lamploop.sync.strategy_named("local_sgd8")
    diloco = lamploop.sync.strategy_named("diloco8")
    assert isinstance(local, LocalSGD)
    assert isinstance(diloco, LocalSGD)
    assert (local.every_n_steps, local.outer) == (8, None)
    assert (diloco.every_n_steps, diloco.outer) == (8, OuterNesterov(lr=0.7, momentum=0.5))
