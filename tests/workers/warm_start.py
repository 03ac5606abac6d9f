"""Start the tests' Python worker processes forked from a warm server (tests/workers/warm_server.py).

:func:`popen` is ``subprocess.Popen`` for ``python SCRIPT ...`` or ``python -c CODE ...``: it
returns a :class:`WarmProcess`, forked from a server that has torch and lamploop imported (about
5 s of CPU less per worker on the 2-core CI machine), with what the tests use of a ``Popen``:
``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``,
``terminate`` and ``kill``. Output asked for with ``subprocess.PIPE`` is written to a file and
returned by ``communicate`` once the process ended (there is no ``stdout`` stream to read
while it runs). Any other command (torchrun, ``ip netns exec``, ``python -m``) gets a real
``subprocess.Popen``, as does every command with ``LAMPLOOP_TEST_COLD_START=1`` (to compare),
and every command whose environment lacks ``OMP_NUM_THREADS=1`` (without it ``import torch``
starts an OpenMP thread, and the server forks only while it has one thread).

A server runs per pytest process and per value of the variables Python, torch and OpenMP read
when they start (``PYTHON*``, ``LD_*``, OpenMP, CUDA and torch variables): a worker gets the
startup a cold start with its environment would have had. Servers start at their first request
and end with their pytest process (their stdin closes). Thread-safe.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["WarmProcess", "popen", "run"]

SERVER = Path(__file__).resolve().with_name("warm_server.py")
_STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "CUDA", "TORCH", "NCCL", "MALLOC")
"""Variables read when Python, torch or OpenMP start: each set of their values has its server."""
_REPLY_TIMEOUT = 120.0
"""Seconds a server may take to answer a request (the first waits for its imports)."""


def _startup_variables(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)))


class _Server:
    """One warm server, and what it said: exit codes by pid, answers to requests in order."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=SERVER.parent,
            start_new_session=True,  # a Ctrl-C of pytest's group is pytest's, not the server's
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.requests = self.proc.stdin
        self.replies = self.proc.stdout
        self.exits: dict[int, int] = {}
        self.answers: list[dict[str, Any]] = []
        self.gone = False
        self._pending = b""
        # Two locks, and neither held while waiting: a thread blocked in select while holding
        # the one that poll() takes would delay another thread's poll(), and so its
        # send_signal(), by up to that wait (test_reliability runs scenarios in threads and
        # times a fault from just before its send_signal).
        self._reading = threading.Lock()  # the reads of the replies and what they say
        self._requesting = threading.Lock()  # one request outstanding: its answer is the next
        os.set_blocking(self.replies.fileno(), False)
        atexit.register(self.close)

    def pump(self, timeout: float) -> None:
        """Read what the server said, waiting up to ``timeout`` seconds for it (0: not at all)."""
        fd = self.replies.fileno()
        if timeout > 0 and not self.gone:
            select.select([fd], [], [], timeout)  # another thread may read what this sees
        with self._reading:
            while not self.gone:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    return
                if not data:
                    self.gone = True
                    return
                self._pending += data
                while b"\n" in self._pending:
                    line, self._pending = self._pending.split(b"\n", 1)
                    message = json.loads(line)
                    if "exited" in message:
                        self.exits[message["exited"]] = message["code"]
                    else:
                        self.answers.append(message)

    def fork(self, request: dict[str, Any]) -> int | None:
        """The pid of a child forked for ``request``; ``None`` when the server cannot fork (it
        has more than one thread: torch starts an OpenMP thread at import unless
        ``OMP_NUM_THREADS=1``), and the command starts cold."""
        with self._requesting:
            self.requests.write((json.dumps(request) + "\n").encode())
            self.requests.flush()
            deadline = time.monotonic() + _REPLY_TIMEOUT
            while True:
                with self._reading:
                    answer = self.answers.pop(0) if self.answers else None
                if answer is not None:
                    break
                if self.gone or time.monotonic() > deadline:
                    msg = f"the warm server (pid {self.proc.pid}) did not answer within {_REPLY_TIMEOUT} s"
                    raise RuntimeError(msg)
                self.pump(min(deadline - time.monotonic(), 1.0))
        if "threads" in answer:
            return None
        return int(answer["started"])

    def close(self) -> None:
        """End the server (its stdin closes) and reap it; its children are the tests' to end."""
        with contextlib.suppress(OSError):
            self.requests.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.replies.close()


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}
_servers_pid = os.getpid()  # a forked test process starts servers of its own
_lock = threading.Lock()


def _server_for(env: dict[str, str]) -> _Server:
    global _servers_pid
    key = _startup_variables(env)
    with _lock:
        if _servers_pid != os.getpid():
            _servers.clear()
            _servers_pid = os.getpid()
        server = _servers.get(key)
        if server is None or server.gone:
            server = _servers[key] = _Server(env)
        return server


class WarmProcess:
    """A worker forked by a warm server: the part of ``subprocess.Popen`` the tests use."""

    def __init__(
        self, server: _Server, pid: int, args: list[str], outputs: tuple[Path | None, Path | None], text: bool
    ) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._outputs = outputs
        self._text = text

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0)
            self.returncode = self._server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if self._server.gone:
                msg = f"the warm server ended before worker {self.pid}'s exit status came"
                raise RuntimeError(msg)
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._server.pump(min(left, 1.0))
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout``); what it wrote
        to each ``subprocess.PIPE`` (``None`` for the others)."""
        self.wait(timeout)
        return self._read(self._outputs[0]), self._read(self._outputs[1])

    def _read(self, path: Path | None) -> Any:
        if path is None:
            return None
        data = path.read_bytes()
        return data.decode(errors="replace") if self._text else data

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _warm(argv: list[str]) -> bool:
    if os.environ.get("LAMPLOOP_TEST_COLD_START") == "1":
        return False
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-c":
        return len(argv) >= 3
    return not argv[1].startswith("-") and argv[1].endswith(".py")


@functools.cache
def _pipe_dir() -> str:
    """A folder for the files that stand in for pipes, removed at this process's exit."""
    path = tempfile.mkdtemp(prefix="lamploop-warm-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _output_path(where: Any, name: str) -> tuple[str | None, Path | None]:
    """Where the child writes a stream, as the server's request says it; the file ``communicate`` reads."""
    if where is None:
        return "inherit", None
    if where == subprocess.DEVNULL:
        return os.devnull, None
    if where == subprocess.PIPE:
        fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=_pipe_dir())
        os.close(fd)
        return path, Path(path)
    if isinstance(where, (str, Path)):
        return str(where), None
    return None, None  # an open file or a descriptor: not forwarded, a cold start


def popen(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    start_new_session: bool = True,
) -> Any:
    """``subprocess.Popen(argv, ...)``, forked from a warm server where it can be (see the module).

    ``stdout`` and ``stderr``: ``None`` (this process's), ``subprocess.PIPE``, ``DEVNULL``, a
    path (appended to) or an open file (a cold start); ``stderr`` may be ``STDOUT``. A warm
    worker always leads a session of its own (as with ``start_new_session=True``).
    """
    env = dict(os.environ) if env is None else env
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if _warm(argv):
        out, out_path = _output_path(stdout, "out")
        err, err_path = ("stdout", None) if stderr == subprocess.STDOUT else _output_path(stderr, "err")
        if out is not None and err is not None:
            request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": out, "stderr": err}
            server = _server_for(env)
            pid = server.fork(request)
            if pid is not None:
                return WarmProcess(server, pid, argv, (out_path, err_path), text)
    files = [open(where, "ab") if isinstance(where, (str, Path)) else where for where in (stdout, stderr)]  # noqa: SIM115
    try:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=files[0],
            stderr=files[1],
            text=text,
            start_new_session=start_new_session,
        )
    finally:
        for opened, where in zip(files, (stdout, stderr), strict=True):
            if opened is not where:
                opened.close()


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(argv, ...)`` through :func:`popen` (warm where it can be): on a timeout
    the worker's process group is killed and ``subprocess.TimeoutExpired`` raised."""
    pipe = subprocess.PIPE if capture_output else None
    proc = popen(argv, env=env, cwd=cwd, stdout=pipe, stderr=pipe, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise subprocess.TimeoutExpired(argv, timeout or 0.0, output=out, stderr=err) from None
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
