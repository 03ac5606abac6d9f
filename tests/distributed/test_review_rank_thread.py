"""Review of ``RankThread``: failures, cancellation before a job starts, the give-up path, and
the profiler a several-rank replica starts on it but closes elsewhere.

Real daemon threads and a real event loop (and a real two-rank ``fit`` in a subprocess); every
wait is bounded.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
from workers import warm_start

from lamploop.distributed.worker import open_rank_thread
from lamploop.errors import DistributedError
from lamploop.loop.profiler import Profile, StepProfiler, trace_file_pattern
from lamploop.sync.collectives import AbortSignal

pytestmark = pytest.mark.anyio


def _wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


async def test_a_failing_job_raises_on_the_owner_and_the_thread_runs_the_next_one_then_is_joined() -> None:
    abort = AbortSignal()
    names: list[str] = []

    def fail() -> None:
        names.append(threading.current_thread().name)
        raise ValueError("job failed")

    def ok() -> int:
        names.append(threading.current_thread().name)
        return 7

    with anyio.fail_after(10):
        async with open_rank_thread(abort) as thread:
            with pytest.raises(ValueError, match="job failed"):
                await thread.run(fail)
            assert await thread.run(ok) == 7
        assert not thread._thread.is_alive()  # joined on leaving
    assert names == ["lamploop rank worker"] * 2
    assert not abort.is_set()


async def test_a_job_whose_owner_was_cancelled_before_it_started_does_not_run() -> None:
    """Concern: ``run`` queues the job before its first checkpoint, so a job asked for by an
    owner already cancelled (a join after the control channel failed) still runs in full."""
    abort = AbortSignal()
    ran = threading.Event()
    with anyio.fail_after(10):
        async with open_rank_thread(abort) as thread:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await thread.run(ran.set)
    assert abort.is_set()
    assert not ran.is_set(), "the job ran although its owner was cancelled before it was queued"


async def test_a_given_up_thread_ends_once_its_blocked_job_returns() -> None:
    """Concern: after a give-up, leaving the block never tells the thread to stop, so once the
    blocked job returns the thread waits on its queue for ever (one leaked thread per run)."""
    abort = AbortSignal()
    abort.allow_giving_up(0.05)
    release = threading.Event()
    with anyio.fail_after(10):
        async with open_rank_thread(abort) as thread:
            with anyio.move_on_after(0.05):
                await thread.run(lambda: release.wait(5))
            assert thread.given_up
            with pytest.raises(DistributedError, match="given up on"):
                await thread.run(lambda: None)  # nothing more runs on it
    release.set()  # the blocked collective returns at last
    ended = await anyio.to_thread.run_sync(lambda: _wait_until(lambda: not thread._thread.is_alive(), 2.0))
    assert ended, "the given-up rank thread stays alive, blocked on its job queue, after its job returned"


async def test_a_job_that_ends_within_give_up_after_is_not_given_up_and_the_thread_goes_on() -> None:
    abort = AbortSignal()
    abort.allow_giving_up(5.0)
    release = threading.Event()
    with anyio.fail_after(10):
        async with open_rank_thread(abort) as thread:
            with anyio.move_on_after(0.05) as scope:
                await thread.run(lambda: release.wait(0.2))
            assert scope.cancelled_caught
            assert not thread.given_up
            assert await thread.run(lambda: 3) == 3  # abort is set; the thread still serves
        assert not thread._thread.is_alive()


def test_a_given_up_job_that_returns_after_the_owners_loop_ended_leaves_no_error_on_its_thread() -> None:
    abort = AbortSignal()
    abort.allow_giving_up(0.02)
    release, returned = threading.Event(), threading.Event()
    hooked: list[BaseException | None] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: hooked.append(args.exc_value)
    holder: list[object] = []

    def job() -> None:
        release.wait(5)
        returned.set()

    async def main() -> None:
        async with open_rank_thread(abort) as thread:
            holder.append(thread)
            with anyio.move_on_after(0.02):
                await thread.run(job)
            assert thread.given_up

    try:
        anyio.run(main)  # the loop ends, then the job returns and signals that ended loop
        release.set()
        assert returned.wait(5)
        time.sleep(0.1)  # the job's last step (signalling the ended loop) runs now
    finally:
        threading.excepthook = old_hook
    assert hooked == []


def _three_profiled_steps(profiler: StepProfiler) -> None:
    profiler.start()
    for _ in range(3):  # a warm-up step, then two of the window's five
        torch.ones(64).mul(2).sum()
        profiler.step()


async def test_a_profile_window_open_when_the_run_ends_is_written_when_closed_on_the_rank_thread(
    tmp_path: Path,
) -> None:
    profiler = StepProfiler(Profile(out_dir=tmp_path, wait=0, warmup=1, active=5), rank=0)
    with anyio.fail_after(60):
        async with open_rank_thread(AbortSignal()) as thread:
            await thread.run(lambda: _three_profiled_steps(profiler))
            await thread.run(profiler.close)
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= _recorded_steps(tmp_path)


def _recorded_steps(out_dir: Path) -> set[str]:
    traces = list(out_dir.glob(trace_file_pattern(0)))
    assert len(traces) == 1, f"{len(traces)} traces written in {out_dir}"
    events = json.loads(traces[0].read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}


FIT_TWO_RANKS = """
import sys
from pathlib import Path

import torch

import lamploop


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=2,
        device="cpu",
        world_size=2,
        reporters=[],
        profile=lamploop.Profile(out_dir=Path(sys.argv[1]), wait=1, warmup=1, active=20),
    )


if __name__ == "__main__":
    main()
"""


def test_a_two_rank_fit_that_ends_inside_a_profile_window_writes_each_ranks_trace(tmp_path: Path) -> None:
    """Concern: a several-rank replica's profiler starts and steps on its RankThread, but
    ``_ranks_replica`` closes it (``_close_profiler``, replica.py) on the event loop's thread,
    where torch finds no profiling session: the process crashed (SIGSEGV) writing the window
    that observability.md says a run ending inside it writes."""
    script = tmp_path / "fit_two_ranks.py"
    script.write_text(FIT_TWO_RANKS)
    out = tmp_path / "traces"
    done = warm_start.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, f"the run ended with {done.returncode}: {done.stderr[-400:]}"
    for rank in (0, 1):
        traces = list(out.glob(trace_file_pattern(rank)))
        assert len(traces) == 1, f"rank {rank}: {len(traces)} traces"
        events = json.loads(traces[0].read_text())["traceEvents"]
        assert any(e.get("name") == "ProfilerStep#2" for e in events), f"rank {rank}: step 2 not recorded"
