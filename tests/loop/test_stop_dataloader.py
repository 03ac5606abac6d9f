"""A stop request reaches a run that waits in a DataLoader, in validation, or before it trains.

``fit`` (one rank) over ``dataloader_batches`` with worker processes, a real signal, a real
checkpoint directory (``tests/workers/stop_dataloader.py``).  What docs/reliability.md
promises:

- SIGTERM or SIGINT to the *process group* (Ctrl-C in a terminal, Slurm's ``scancel``)
  reaches the DataLoader's workers too.  ``dataloader_batches`` gives its loaders' workers
  :func:`~lamploop.forked_children.leave_stop_signals_to_the_run`, so they leave the stop to
  the run: it stops at the step boundary with its checkpoint, exit status 143 / 130.  Without
  it a worker dies of SIGTERM (``DataLoader worker ... is killed by signal: Terminated``, the
  run fails with status 1) or, on SIGINT, writes it into the run's wake-up socket: two SIGINTs
  counted for one, a stop at once without a checkpoint (shown below in this process, with
  :func:`~lamploop.forked_children.signals_stay_with_this_process` preventing it);
- a stop requested during a validation pass ends the run at the epoch's end, after the
  validation pass and the epoch's checkpoint, with no step of the next epoch (exit 143); the
  next run resumes from that checkpoint to the uninterrupted run's result.  A validation
  stream that waits for samples that never come is ended by the request, and the validation
  cut short is discarded (the epoch is not finished, no checkpoint of its end);
- a SIGTERM before training starts (while ``fit`` restores the checkpoint it resumes from)
  stops the run once the checkpoint is restored: ``TrainingInterrupted`` (exit 143 through
  the script), nothing written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
import torch
from support import WORKERS
from torch.utils.data import DataLoader, TensorDataset
from workers import rank as worker

import lamploop
from lamploop.batches import BatchContext, BatchStream
from lamploop.checkpoint import load_checkpoint
from lamploop.forked_children import leave_stop_signals_to_the_run, signals_stay_with_this_process

WORKER = WORKERS / "stop_dataloader.py"
EXITED_WITHIN_S = 30.0


def _run(tmp_path: Path, mode: str) -> worker.Processes:
    procs = worker.Processes(tmp_path)
    procs.start("fit", [sys.executable, str(WORKER), str(tmp_path), mode])
    return procs


def _training(procs: worker.Processes, tmp_path: Path) -> None:
    """Wait until the first epoch's checkpoint is written: the run trains epoch 1 (its workers run)."""
    deadline = time.monotonic() + 120
    while not (tmp_path / "checkpoints" / "latest").exists():
        procs.check_alive(["fit"])
        assert time.monotonic() < deadline, procs.logs()
        time.sleep(0.05)
    time.sleep(0.3)


def _stopped_at_a_step_boundary(procs: worker.Processes, tmp_path: Path, status: int) -> None:
    """Stopped with a checkpoint of where it stopped: a step boundary, or an epoch's end when the
    signal came during the epoch's validation pass."""
    assert procs.wait("fit", EXITED_WITHIN_S) == status, procs.logs()
    log = procs.log("fit")
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    saved = load_checkpoint(tmp_path / "checkpoints")
    if "at the epoch's end; the epoch's checkpoint was written" in log:
        assert saved.position is None, latest
        assert latest == f"epoch-{saved.state.loop_state.epoch:06d}"
        return
    assert "a checkpoint was written there" in log, log
    assert saved.position is not None, latest  # a step boundary inside an epoch, not an epoch's end
    assert latest.endswith(f"-step-{saved.position.steps_done:06d}")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"]
)
def test_a_signal_to_the_process_group_stops_at_the_boundary_when_the_workers_leave_it_to_the_run(
    tmp_path: Path, signum: int, status: int
) -> None:
    with _run(tmp_path, "ignoring") as procs:
        _training(procs, tmp_path)
        os.killpg(procs.procs["fit"].pid, signum)
        _stopped_at_a_step_boundary(procs, tmp_path, status)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sigterm_to_the_process_group_stops_at_the_boundary_with_plain_workers(tmp_path: Path) -> None:
    with _run(tmp_path, "plain") as procs:
        _training(procs, tmp_path)
        os.killpg(procs.procs["fit"].pid, signal.SIGTERM)
        _stopped_at_a_step_boundary(procs, tmp_path, 143)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: the run's DataLoader workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_whose_dataloader_worker_is_killed_fails_and_its_process_exits(tmp_path: Path) -> None:
    """A worker killed (the OOM killer, a SIGKILL) fails the run, and the process then exits.

    It hung forever at its exit instead: Python joined the other worker, which ignores the
    SIGTERM that comes first (it leaves the stop signals to the run) and waited for work.
    """
    with _run(tmp_path, "plain") as procs:
        _training(procs, tmp_path)
        fit = procs.procs["fit"]
        deadline = time.monotonic() + EXITED_WITHIN_S
        # One worker, again only while the run has not failed (a worker ending with its epoch
        # can be missed); never the other: the test must not end it in its parent's stead.
        while not _names_a_dead_worker(procs.log("fit")) and fit.poll() is None:
            assert time.monotonic() < deadline, procs.logs()
            with contextlib.suppress(ProcessLookupError, IndexError):
                os.kill(_children(fit.pid)[0], signal.SIGKILL)
            time.sleep(1.0)
        assert procs.wait("fit", EXITED_WITHIN_S) == 1, procs.logs()
    assert _names_a_dead_worker(procs.log("fit")), procs.logs()


def _names_a_dead_worker(log: str) -> bool:
    """Whether ``log`` holds torch's error for a worker that died.

    torch words it two ways: "exited unexpectedly" when the iterator's status check finds the
    worker gone, "is killed by signal: Killed" when its SIGCHLD handler does first (in CI, once,
    while the failed epoch was shutting its workers down).
    """
    return "DataLoader worker" in log and ("exited unexpectedly" in log or "is killed by signal" in log)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_whose_loader_keeps_its_workers_exits_when_it_is_done(tmp_path: Path) -> None:
    """``persistent_workers=True``: the workers outlive each epoch, not the process.  A finished
    run's process hung at its exit, joining workers that ignore the exit's SIGTERM."""
    with _run(tmp_path, "persistent") as procs:
        assert procs.wait("fit", 120) == 0, procs.logs()
    assert not _children(procs.procs["fit"].pid)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sigterm_to_the_run_alone_while_it_waits_in_a_dataloader_stops_at_the_boundary(
    tmp_path: Path,
) -> None:
    with _run(tmp_path, "plain") as procs:
        _training(procs, tmp_path)
        procs.procs["fit"].send_signal(signal.SIGTERM)
        _stopped_at_a_step_boundary(procs, tmp_path, 143)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stop_during_validation_on_two_ranks_ends_the_run_at_the_epochs_end_after_its_checkpoint(
    tmp_path: Path,
) -> None:
    # The SIGTERM reaches the root alone; the ranks agree in the validation's sum.  One rank
    # (and the resumed run's result): test_a_stop_during_validation_in_process_... below.
    with _run(tmp_path, "slow-validation-2") as procs:
        validating = procs.wait_for_file(tmp_path / "validating.json", 120, alive=["fit"])
        time.sleep(0.3)  # inside the validation pass (about 1.5 s of loading)
        procs.procs["fit"].send_signal(signal.SIGTERM)
        assert procs.wait("fit", EXITED_WITHIN_S) == 143, procs.logs()
    epoch = int(validating["epoch"])
    log = procs.log("fit")
    assert (
        f"stopped by SIGTERM during the validation of epoch {epoch}, at the epoch's end; the epoch's " in log
    )
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"epoch-{epoch + 1:06d}", log
    saved = load_checkpoint(checkpoints)
    assert saved.position is None  # the epoch's end: no step of the next epoch was taken
    assert saved.state.loop_state.epoch == epoch + 1
    assert saved.state.loop_state.learning_curve[-1].validation_loss is not None  # the whole validation
    assert not list(checkpoints.glob("*-step-*")), sorted(p.name for p in checkpoints.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sigterm_while_fit_restores_its_checkpoint_stops_the_run_once_restored_and_writes_nothing(
    tmp_path: Path,
) -> None:
    with _run(tmp_path, "first-of-two") as procs:
        assert procs.wait("fit", 120) == 0, procs.logs()
    checkpoints = tmp_path / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    latest = (checkpoints / "latest").read_text()
    with worker.Processes(tmp_path) as procs:
        resumed = procs.start("resume", [sys.executable, str(WORKER), str(tmp_path), "slow-resume"])
        procs.wait_for_file(tmp_path / "restoring.json", 120, alive=["resume"])
        resumed.send_signal(signal.SIGTERM)
        status = procs.wait("resume", EXITED_WITHIN_S)
    # fit's handler is in place from its first line: a stop on request, not SIGTERM's default action.
    assert status == 143, procs.logs()
    assert "stopped by SIGTERM before training started" in procs.log("resume"), procs.logs()
    assert sorted(p.name for p in checkpoints.iterdir()) == before
    assert (checkpoints / "latest").read_text() == latest


# --- the parts, in this process ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_process_forked_during_the_block_does_not_signal_this_event_loop() -> None:
    """A child that gets SIGINT (as a DataLoader worker does on Ctrl-C) wrote it into this
    process's wake-up socket: this process counted a SIGINT it never got."""

    async def heard_from_a_forked_child(guarded: bool) -> list[int]:
        heard: list[int] = []
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            if guarded:
                with signals_stay_with_this_process():
                    pid = os.fork()
            else:
                pid = os.fork()
            if pid == 0:  # the child: its own SIGINT, then gone
                os.kill(os.getpid(), signal.SIGINT)
                os._exit(0)
            os.waitpid(pid, 0)  # noqa: ASYNC222  (a child that exits at once)
            with anyio.move_on_after(0.5):
                async for signum in signals:
                    heard.append(signum)
        return heard

    assert anyio.run(heard_from_a_forked_child, False) == [signal.SIGINT]  # what went wrong
    assert anyio.run(heard_from_a_forked_child, True) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignoring", [False, True], ids=["plain", "ignoring"])
def test_a_dataloader_worker_that_leaves_signals_to_the_run_outlives_a_sigterm_from_elsewhere(
    ignoring: bool,
) -> None:
    data = TensorDataset(torch.arange(64.0))
    init = leave_stop_signals_to_the_run if ignoring else None
    # A spawned worker: a forked one inherits whatever threads earlier tests left in this
    # process (a fresh-clone run once saw it abort before its first batch).
    loader = DataLoader(
        data, batch_size=4, num_workers=1, worker_init_fn=init, multiprocessing_context="spawn"
    )
    it = iter(loader)
    first = next(it)
    pid = it._workers[0].pid  # type: ignore[attr-defined]
    # From another process (as a group signal comes): torch's worker exits only on its parent's.
    if ignoring:
        os.spawnvp(os.P_WAIT, "kill", ["kill", "-TERM", str(pid)])
        time.sleep(0.3)
        assert sum(len(batch[0]) for batch in it) + len(first[0]) == 64
    else:
        # torch's SIGCHLD handler raises in this thread as soon as the worker is gone.
        with pytest.raises(RuntimeError, match=r"DataLoader worker .*(killed by signal: Terminated|exited)"):  # noqa: PT012
            os.spawnvp(os.P_WAIT, "kill", ["kill", "-TERM", str(pid)])
            time.sleep(0.3)
            list(it)


# --- a stop during validation, in this process (one rank, ``fit`` on the main thread) -------------

_X = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
_Y = (_X.sum(dim=1) > 0).long()
_VALIDATION = [(_X[i : i + 8], _Y[i : i + 8]) for i in range(0, 48, 8)]


def _signal_during(epoch: int | None, context: BatchContext) -> bool:
    return epoch is not None and context.epoch == epoch


def _whole_validation(signalled_epoch: int | None) -> Callable[[BatchContext], BatchStream]:
    """Validation batches; the stream draws from torch's RNG as a DataLoader does (its base seed),
    and in ``signalled_epoch`` SIGTERMs this process after its first batch and goes on."""

    def factory(context: BatchContext) -> BatchStream:
        torch.randint(0, 2**31, ())  # what a DataLoader's iterator draws: the checkpoint must see it

        async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            for index, batch in enumerate(_VALIDATION):
                yield batch
                if index == 0 and _signal_during(signalled_epoch, context):
                    os.kill(os.getpid(), signal.SIGTERM)
                    await anyio.sleep(0.2)  # the handler has set the request: the pass goes on

        return batches()

    return factory


class _SamplesThatNeverCome:
    """A stream of samples (an ``EndingBatchStream``) whose second batch never comes; its first
    SIGTERMs this process."""

    def __init__(self) -> None:
        self.waited = False

    @property
    def source_ended(self) -> bool:
        return False

    async def __aiter__(self) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        yield _VALIDATION[0]
        os.kill(os.getpid(), signal.SIGTERM)
        self.waited = True
        await anyio.sleep_forever()
        yield _VALIDATION[1]  # never reached


def _fit(
    out: Path, validation: Callable[[BatchContext], BatchStream]
) -> tuple[lamploop.LoopState, torch.nn.Module]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(_X, _Y, batch_size=8),
        validation_batches=validation,
        max_epochs=3,
        checkpoint_dir=out,
        reporters=[],
    )
    return state, module


@pytest.mark.timeout(120)
def test_a_stop_during_validation_in_process_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    expected, expected_module = _fit(tmp_path / "whole", _whole_validation(None))
    with pytest.raises(
        lamploop.errors.TrainingInterrupted, match="during the validation of epoch 1, at the"
    ) as info:
        _fit(tmp_path / "stopped", _whole_validation(1))
    assert (info.value.reason, info.value.epoch, info.value.steps_done) == ("SIGTERM", 2, 0)
    assert (tmp_path / "stopped" / "latest").read_text().strip() == "epoch-000002"
    state, module = _fit(tmp_path / "stopped", _whole_validation(None))  # resumed there
    assert state.learning_curve == expected.learning_curve
    for name, value in expected_module.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


@pytest.mark.timeout(60)
def test_a_validation_stream_that_waits_for_samples_is_ended_by_the_request_and_discarded(
    tmp_path: Path,
) -> None:
    stream = _SamplesThatNeverCome()

    def validation(context: BatchContext) -> BatchStream:
        return stream if context.epoch == 1 else _whole_validation(None)(context)

    began = time.monotonic()
    with pytest.raises(
        lamploop.errors.TrainingInterrupted, match="validation of epoch 1, which was cut short"
    ) as info:
        _fit(tmp_path, validation)
    assert stream.waited
    assert time.monotonic() - began < 20
    assert info.value.reason == "SIGTERM"
    # The epoch is not finished: the checkpoint of epoch 0's end is the last one.
    assert (tmp_path / "latest").read_text().strip() == "epoch-000001"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("epoch-")) == ["epoch-000001"]
