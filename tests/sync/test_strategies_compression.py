"""Compressed all-reduce (bf16, fp16) and PowerSGD against the uncompressed sum, per step.

Each test runs its ranks as threads of this process (through ``anyio.to_thread``), every
rank with its own real Gloo process group over one in-process store, and drives the
strategies' :class:`~lamploop.sync.GradientSync` objects as ``one_epoch`` does:
``begin_pass``, the backward passes of ``loss_sum / expected``, ``last_backward`` before the
last, ``reduce(expected / global count)``, an optimizer step, ``after_step``.  The
reference is :class:`~lamploop.sync.all_reduce.AllReduceSync` on a second copy of the same
model fed the same batches.  Batches are uneven: rank 1 has fewer examples and nothing at
all in the last step (the uneven-stream rule: it takes part with zero examples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import lamploop
from lamploop.distributed.process_group import new_process_group
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.sync import AbortSignal, Collectives, CompressedAllReduce, GradientSync, PowerSGD
from lamploop.sync.all_reduce import AllReduceSync
from lamploop.sync.compressed_all_reduce import CompressedAllReduceSync
from lamploop.sync.powersgd import PowerSGDSync

pytestmark = pytest.mark.anyio

T = TypeVar("T")
RANKS_TIMEOUT_S = 60.0
COLLECTIVE_TIMEOUT_S = 20.0
BF16_UNIT = 2.0**-8  # bf16 keeps 8 significant bits: a rounding errs by at most this, relatively
FP16_UNIT = 2.0**-11


async def run_ranks(nranks: int, body: Callable[[int, Collectives], T]) -> list[T]:
    """``body(rank, collectives)`` on ``nranks`` threads, each rank with a real Gloo group.

    The first rank to fail aborts the others' waits (they would wait for it until the
    collective timeout); every wait is bounded by :data:`RANKS_TIMEOUT_S`.
    """
    store = dist.HashStore()
    abort = AbortSignal()
    results: list[Any] = [None] * nranks
    prefix = f"test-{id(store)}"

    def rank_main(rank: int) -> None:
        torch.set_num_threads(1)  # on this thread: OpenMP's thread count is per thread (see below)
        try:
            group = new_process_group(
                store,
                rank=rank,
                nranks=nranks,
                device=torch.device("cpu"),
                timeout=COLLECTIVE_TIMEOUT_S,
                prefix=prefix,
            )
            collectives = Collectives(
                group,
                rank=rank,
                nranks=nranks,
                device=torch.device("cpu"),
                timeout=COLLECTIVE_TIMEOUT_S,
                abort=abort,
            )
            results[rank] = body(rank, collectives)
        except BaseException as exc:
            abort.set(f"rank {rank} failed: {exc!r}")
            raise

    # One intra-op thread per rank, as fit gives each rank of a 2-core machine, set on each
    # rank's own thread (OpenMP keeps the thread count per thread): ranks that are threads of
    # one process otherwise run OpenMP teams side by side whose split of a reduction, and so
    # the order of float sums, differs from run to run (two identical runs differed).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with anyio.fail_after(RANKS_TIMEOUT_S):
            async with anyio.create_task_group() as tasks:
                for rank in range(nranks):
                    tasks.start_soon(anyio.to_thread.run_sync, rank_main, rank)
    finally:
        torch.set_num_threads(threads)
    return results


def small_model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Two weight matrices, one taller than wide and one wider than tall, and their biases.

    Drawn from a generator of its own: the ranks are threads, and the global generator
    would interleave their draws.
    """
    module = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 6)).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.3)
    return module


Step = list[tuple[torch.Tensor, torch.Tensor]]


def rank_steps(rank: int, steps: int, dtype: torch.dtype, *, seed: int = 5) -> list[Step]:
    """Rank ``rank``'s batches, two per step; rank 1 has smaller ones and none in the last step."""
    generator = torch.Generator().manual_seed(seed + 101 * rank)
    out: list[Step] = []
    for s in range(steps):
        if rank == 1 and s == steps - 1:
            out.append([])
            continue
        sizes = (5, 3) if rank == 1 else (7, 6)
        out.append(
            [
                (
                    torch.randn(n, 24, generator=generator, dtype=torch.float64).to(dtype),
                    torch.randint(0, 6, (n,), generator=generator),
                )
                for n in sizes
            ]
        )
    return out


def global_counts(nranks: int, steps: int) -> list[int]:
    """Every step's example count over all ranks (what the loop's step sum gives)."""
    per_rank = [rank_steps(r, steps, torch.float64) for r in range(nranks)]
    return [sum(len(y) for r in range(nranks) for _, y in per_rank[r][s]) for s in range(steps)]


def backward_step(
    module: nn.Module, sync: GradientSync, batches: Step, expected: int, *, loss_factor: float = 1.0
) -> int:
    """The backward passes of one step as ``one_epoch`` runs them; this rank's example count."""
    count = 0
    for i, (x, y) in enumerate(batches):
        if i == len(batches) - 1:
            sync.last_backward()
        loss_sum = nn.functional.cross_entropy(module(x), y, reduction="sum") * loss_factor
        (loss_sum / expected).backward()
        count += len(y)
    if not batches:
        sync.last_backward()
    return count


def grads_of(module: nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()
    ]


def compare_syncs(
    rank: int,
    collectives: Collectives,
    make_sync: Callable[[Collectives, nn.Module], GradientSync],
    *,
    dtype: torch.dtype,
    steps: int,
    loss_factor: float = 1.0,
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per step: (the reference's reduced gradients, the strategy's), both models stepping alike.

    Both models step with SGD on their own reduced gradients, so a strategy that is off
    shows in later steps too.
    """
    reference, candidate = small_model(dtype), small_model(dtype)
    ref_sync = AllReduceSync(collectives, list(reference.parameters()), bucket_cap_mb=25.0)
    cand_sync = make_sync(collectives, candidate)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    cand_opt = torch.optim.SGD(candidate.parameters(), lr=0.5)
    counts = global_counts(collectives.nranks, steps)
    out = []
    ref_sync.begin_pass()
    cand_sync.begin_pass()
    previous = 0
    for batches, total in zip(rank_steps(rank, steps, dtype), counts, strict=True):
        expected = previous or 1
        for module, sync in ((reference, ref_sync), (candidate, cand_sync)):
            backward_step(module, sync, batches, expected, loss_factor=loss_factor)
            sync.reduce(expected / total)
        out.append((grads_of(reference), grads_of(candidate)))
        for sync, opt in ((ref_sync, ref_opt), (cand_sync, cand_opt)):
            opt.step()
            sync.after_step()
        previous = total
    for sync in (ref_sync, cand_sync):
        sync.end_pass()
        sync.close(abandon=False)
    return out


def assert_within_rounding(
    results: Sequence[list[tuple[list[torch.Tensor], list[torch.Tensor]]]], unit: float, ranks: int
) -> None:
    """Each reduced gradient within ``(ranks + 1) * unit`` of the reference, relative to its size.

    Each rank's gradient is rounded once when cast and every partial sum once more: at
    most ``ranks + 1`` roundings, each within ``unit`` of the magnitude (the largest
    element of the step's gradient, since a partial sum can cancel to near zero).
    """
    for rank_results in results:
        for step, (reference, candidate) in enumerate(rank_results):
            for i, (r, c) in enumerate(zip(reference, candidate, strict=True)):
                bound = (ranks + 1) * unit * float(r.abs().max()) + 1e-30
                error = float((c - r).abs().max())
                assert error <= bound, f"step {step}, parameter {i}: error {error:.3g} > {bound:.3g}"
                assert error > 0 or float(r.abs().max()) == 0  # it did round: not the fp32 path


async def test_bf16_is_within_rounding_of_fp32_every_step() -> None:
    def body(rank: int, collectives: Collectives) -> Any:
        return compare_syncs(
            rank,
            collectives,
            lambda c, m: CompressedAllReduce(wire="bf16").gradient_sync(
                c, list(m.parameters()), [], bucket_cap_mb=25.0
            ),
            dtype=torch.float32,
            steps=4,
        )

    results = await run_ranks(2, body)
    assert_within_rounding(results, BF16_UNIT, ranks=2)
    # Every rank holds the same reduced gradients (they step alike).
    for (_, a), (_, b) in zip(results[0], results[1], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


async def test_fp16_is_within_rounding_of_fp32_and_falls_back_on_overflow() -> None:
    syncs: list[CompressedAllReduceSync] = []

    def make(c: Collectives, m: nn.Module) -> GradientSync:
        sync = CompressedAllReduce(wire="fp16").gradient_sync(c, list(m.parameters()), [], bucket_cap_mb=25.0)
        assert isinstance(sync, CompressedAllReduceSync)
        syncs.append(sync)
        return sync

    def body(rank: int, collectives: Collectives) -> Any:
        return compare_syncs(rank, collectives, make, dtype=torch.float32, steps=4)

    results = await run_ranks(2, body)
    assert syncs[0].fallbacks == syncs[1].fallbacks
    assert syncs[0].scale == syncs[1].scale
    for rank_results in results:
        for step, (reference, candidate) in enumerate(rank_results):
            for r, c in zip(reference, candidate, strict=True):
                bound = 3 * FP16_UNIT * float(r.abs().max()) + 1e-30
                assert float((c - r).abs().max()) <= bound, f"step {step}"

    # Gradients of 1e5 and more overflow fp16 at any factor >= 1: every bucket falls back,
    # and the result is the full-width all-reduce's, bit for bit.
    syncs.clear()

    def huge(rank: int, collectives: Collectives) -> Any:
        return compare_syncs(rank, collectives, make, dtype=torch.float32, steps=2, loss_factor=1e7)

    for rank_results in await run_ranks(2, huge):
        for reference, candidate in rank_results:
            assert max(float(r.abs().max()) for r in reference) > 65504
            for r, c in zip(reference, candidate, strict=True):
                assert torch.equal(r, c)
    assert syncs[0].fallbacks >= 2


async def test_powersgd_at_full_rank_equals_the_uncompressed_sum() -> None:
    """float64, every matrix compressed at rank min(n, m): equal within 1e-10 every step."""

    def make(c: Collectives, m: nn.Module) -> GradientSync:
        strategy = PowerSGD(rank=40, min_compression_ratio=0.0)
        sync = strategy.gradient_sync(c, list(m.parameters()), [], bucket_cap_mb=25.0)
        assert isinstance(sync, PowerSGDSync)
        assert sync.compressed() == [(40, 24, 24), (6, 40, 6)]
        return sync

    def body(rank: int, collectives: Collectives) -> Any:
        return compare_syncs(rank, collectives, make, dtype=torch.float64, steps=5)

    for rank_results in await run_ranks(2, body):
        for step, (reference, candidate) in enumerate(rank_results):
            for r, c in zip(reference, candidate, strict=True):
                torch.testing.assert_close(c, r, atol=1e-10, rtol=0, msg=f"step {step}")


async def test_powersgd_error_feedback_loses_nothing() -> None:
    """Rank 1, fixed gradients: what was applied plus what the ranks still owe is every gradient sent.

    Sum over steps of the reduced (unscaled) gradients plus the sum over ranks of the
    error feedback left equals the sum over steps and ranks of the raw gradients (float64).
    Biases (1-D) are never compressed and arrive whole.
    """
    steps = 6

    def body(rank: int, collectives: Collectives) -> Any:
        module = small_model(torch.float64)
        sync = PowerSGD(rank=1).gradient_sync(collectives, list(module.parameters()), [], bucket_cap_mb=25.0)
        assert isinstance(sync, PowerSGDSync)
        assert sync.compressed() == [(40, 24, 1), (6, 40, 1)]
        applied = [torch.zeros_like(p) for p in module.parameters()]
        raw = [torch.zeros_like(p) for p in module.parameters()]
        sync.begin_pass()
        for batches in rank_steps(rank, steps, torch.float64)[: steps - 1]:
            backward_step(module, sync, batches, 1)
            for total, p in zip(raw, module.parameters(), strict=True):
                assert p.grad is not None
                total += p.grad
            sync.reduce(1.0)
            for total, g in zip(applied, grads_of(module), strict=True):
                total += g
            sync.after_step()
        return applied, raw, sync.state_dict()

    results = await run_ranks(2, body)
    (applied, _, state0), (_, _, state1) = results[0], results[1]
    sent = [a + b for a, b in zip(results[0][1], results[1][1], strict=True)]
    for i in (0, 2):
        owed = (state0[f"error.{i}"] + state1[f"error.{i}"]).view_as(applied[i])
        torch.testing.assert_close(applied[i] + owed, sent[i], atol=1e-10, rtol=0)
        assert float(owed.abs().max()) > 1e-3  # rank 1 does approximate
    for i in (1, 3):
        torch.testing.assert_close(applied[i], sent[i], atol=1e-12, rtol=0)


async def test_compressor_state_round_trips_through_a_checkpoint_file(tmp_path: Path) -> None:
    """PowerSGD (Q, error feedback) and fp16 (its factor): resumed from files equals uninterrupted."""
    steps, cut = 6, 3
    counts = global_counts(2, steps)
    strategies = {"powersgd": PowerSGD(rank=2), "fp16": CompressedAllReduce(wire="fp16", growth_interval=2)}

    def train(
        rank: int, collectives: Collectives, name: str, span: range, resume_from: Path | None
    ) -> list[list[torch.Tensor]]:
        module = small_model(torch.float32)
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        if resume_from is not None:
            module.load_state_dict(load_file(resume_from / f"model-{rank}.safetensors"))
        sync = strategies[name].gradient_sync(collectives, list(module.parameters()), [], bucket_cap_mb=25.0)
        if resume_from is not None:
            sync.load_state_dict(load_file(resume_from / f"sync-{rank}.safetensors"))
        sync.begin_pass()
        grads = []
        batches = rank_steps(rank, steps, torch.float32)
        for s in span:
            expected = counts[s - 1] if s else 1
            backward_step(module, sync, batches[s], expected)
            sync.reduce(expected / counts[s])
            grads.append(grads_of(module))
            opt.step()
            sync.after_step()
        sync.end_pass()
        if resume_from is None and span.stop == cut:
            save_file(sync.state_dict(), tmp_path / name / f"sync-{rank}.safetensors")
            save_file(
                {k: v.contiguous() for k, v in module.state_dict().items()},
                tmp_path / name / f"model-{rank}.safetensors",
            )
        sync.close(abandon=False)
        return grads

    for name in strategies:
        (tmp_path / name).mkdir()

        def whole(rank: int, c: Collectives, name: str = name) -> Any:
            return train(rank, c, name, range(steps), None)

        def first(rank: int, c: Collectives, name: str = name) -> Any:
            return train(rank, c, name, range(cut), None)

        def rest(rank: int, c: Collectives, name: str = name) -> Any:
            return train(rank, c, name, range(cut, steps), tmp_path / name)

        uninterrupted = await run_ranks(2, whole)
        await run_ranks(2, first)
        resumed = await run_ranks(2, rest)
        for rank in range(2):
            for step, (a, b) in enumerate(zip(uninterrupted[rank][cut:], resumed[rank], strict=True)):
                for x, y in zip(a, b, strict=True):
                    assert torch.equal(x, y), f"{name}, rank {rank}, step {cut + step}"


async def test_a_state_of_another_model_is_refused() -> None:
    def body(rank: int, collectives: Collectives) -> None:
        sync = PowerSGD(rank=2).gradient_sync(
            collectives, list(small_model(torch.float32).parameters()), [], bucket_cap_mb=25.0
        )
        state = sync.state_dict()
        with pytest.raises(CheckpointError, match=r"missing keys \['q.0'\]"):
            sync.load_state_dict({k: v for k, v in state.items() if k != "q.0"})
        state["error.0"] = torch.zeros(3, 3)
        with pytest.raises(CheckpointError, match=r"'error.0': shape \(3, 3\), expected \(40, 24\)"):
            sync.load_state_dict(state)
        fp16 = CompressedAllReduce(wire="fp16").gradient_sync(collectives, [], [], bucket_cap_mb=25.0)
        with pytest.raises(ConfigurationError, match="expected the keys"):
            fp16.load_state_dict({})

    await run_ranks(1, body)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PowerSGD(rank=0), r"rank must be an int >= 1, got 0"),
        (lambda: PowerSGD(rank=2.5), r"rank must be an int >= 1, got 2.5"),
        (lambda: PowerSGD(min_compression_ratio=-1), r"min_compression_ratio must be a finite number >= 0"),
        (lambda: PowerSGD(seed=-3), r"seed must be an int >= 0"),
        # each step's generator is seeded with seed + 1_000_003 * step + index: 64 bits at most
        (lambda: PowerSGD(seed=2**63), r"seed must be below 2\*\*63"),
        (lambda: CompressedAllReduce(wire="int8"), r"wire must be one of \['bf16', 'fp16'\], got 'int8'"),
        (lambda: CompressedAllReduce(wire="fp16", growth_interval=0), r"growth_interval must be an int >= 1"),
        (lambda: lamploop.TrainingSettings(strategy="powersgd3"), r"one of .*powersgd4.*got 'powersgd3'"),
    ],
)
def test_bad_configuration_is_refused_before_training(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_the_registered_defaults() -> None:
    names = lamploop.strategy_names()
    for name in ("all_reduce_bf16", "all_reduce_fp16", "powersgd1", "powersgd4"):
        assert name in names
    strategy = lamploop.sync.strategy_named("powersgd4")
    assert isinstance(strategy, PowerSGD)
    assert (strategy.rank, strategy.warm_start, strategy.steps_on_every_rank) == (4, True, True)
