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
- a stop requested during a validation pass ends the run at the first step boundary of the
  next epoch, after the epoch's checkpoint;
- a SIGTERM before the run handles signals (while ``fit`` restores the checkpoint it resumes
  from) ends the process as SIGTERM's default action does, nothing written.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from workers import rank as worker

from lamploop.checkpoint import load_checkpoint
from lamploop.forked_children import leave_stop_signals_to_the_run, signals_stay_with_this_process

WORKER = Path(__file__).parent / "workers" / "stop_dataloader.py"
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
    assert procs.wait("fit", EXITED_WITHIN_S) == status, procs.logs()
    log = procs.log("fit")
    assert "a checkpoint was written there" in log, log
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    saved = load_checkpoint(tmp_path / "checkpoints")
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
def test_a_stop_during_validation_ends_the_run_after_the_first_step_of_the_next_epoch(tmp_path: Path) -> None:
    with _run(tmp_path, "slow-validation") as procs:
        validating = procs.wait_for_file(tmp_path / "validating.json", 120, alive=["fit"])
        time.sleep(0.3)  # inside the validation pass (about 1.5 s of loading)
        procs.procs["fit"].send_signal(signal.SIGTERM)
        assert procs.wait("fit", EXITED_WITHIN_S) == 143, procs.logs()
    epoch = int(validating["epoch"])
    log = procs.log("fit")
    assert f"stopped by SIGTERM at epoch {epoch + 1} after step 1; a checkpoint was written there" in log, log
    saved = load_checkpoint(tmp_path / "checkpoints")
    assert saved.position is not None
    assert (saved.state.loop_state.epoch, saved.position.steps_done) == (epoch + 1, 1)
    # The epoch whose validation was interrupted finished it and wrote its own checkpoint first.
    assert (tmp_path / "checkpoints" / f"epoch-{epoch + 1:06d}").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sigterm_while_fit_restores_its_checkpoint_ends_the_process_and_writes_nothing(
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
    # No handler is in place yet: SIGTERM's default action (a shell shows 143), no traceback.
    assert status == -signal.SIGTERM, procs.logs()
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
    it = iter(DataLoader(data, batch_size=4, num_workers=1, worker_init_fn=init))
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
