"""The suite's own bound: a test that hangs is ended at its timeout, whatever it waits on.

A streaming test whose assertion failed while its simulation's thread waited in
``BlockingProducer.send`` (the buffer unread: back-pressure) hung its xdist worker for good:
pytest-timeout's default ``signal`` method raised once in the main thread, and the event loop's
clean-up then waited for the thread forever.  The suite's configuration (pyproject.toml) uses
the ``thread`` method; this runs that shape of hang under it, in a pytest of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HANGING = textwrap.dedent(
    """
    import threading

    import anyio


    def test_fails_while_a_thread_waits_forever() -> None:
        async def main() -> None:
            never = threading.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, never.wait)
                await anyio.sleep(0.1)
                raise AssertionError("failed while the thread waits")

        anyio.run(main)
    """
)


@pytest.mark.timeout(120)
def test_a_test_that_hangs_on_a_thread_is_ended_at_its_timeout(tmp_path: Path) -> None:
    (tmp_path / "test_hanging.py").write_text(HANGING)
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "--timeout", "3"]
    plugins = ["-p", "no:cacheprovider", "-p", "no:xdist"]
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *config, *plugins, str(tmp_path / "test_hanging.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    took = time.monotonic() - began
    assert done.returncode != 0, done.stdout[-2000:]
    assert "Timeout" in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
    assert "test_fails_while_a_thread_waits_forever" in done.stdout + done.stderr
    assert took < 60, f"the hanging test ended only after {took:.0f} s"
