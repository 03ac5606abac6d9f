"""Processes forked during a run leave its stop signals to it, even when signalled at once."""

from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


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
