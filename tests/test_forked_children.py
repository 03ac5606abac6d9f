"""Processes forked during a run leave its stop signals to it, even when signalled at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from support import ROOT

from lamploop.forked_children import leave_stop_signals_to_the_run, workers_forked_here_wait_for_their_init


def test_a_child_signalled_before_its_fork_hooks_ran_does_not_signal_the_parent() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "fork_in_the_window.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["statuses"] == [0], outcome  # the child forked, took its signal and exited
    assert outcome["received"] == [], outcome  # nothing written into the parent's wake-up socket


def _status_of_a_child_signalled_before_its_init(wait_for_init: bool) -> int:
    """Fork as a DataLoader does; the child is sent SIGTERM at once, while SIGTERM still kills it
    (torch's worker handler before ``worker_init_fn``), then runs its init.  Its exit status."""
    window = workers_forked_here_wait_for_their_init() if wait_for_init else contextlib.nullcontext()
    with window:
        pid = os.fork()
    if pid == 0:  # the child: nothing of pytest's runs here, only os._exit
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as torch's handler: a stranger's SIGTERM kills
            os.kill(os.getpid(), signal.SIGTERM)  # the job's SIGTERM, before the worker's init
            leave_stop_signals_to_the_run(0)
            os._exit(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def test_a_worker_signalled_between_its_fork_and_its_init_is_not_killed() -> None:
    """A SIGTERM to the whole job as a DataLoader forks its workers killed one ("DataLoader worker
    ... exited unexpectedly": the run failed instead of stopping); forked in the window, the
    signal waits until the worker's init ignores it."""
    assert os.WIFSIGNALED(_status_of_a_child_signalled_before_its_init(wait_for_init=False))  # the hazard
    status = _status_of_a_child_signalled_before_its_init(wait_for_init=True)
    assert os.WIFEXITED(status), status
    assert os.WEXITSTATUS(status) == 0, status
    # The forking thread's own mask is as it was: the parent still takes its stop signals.
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM} == set()
