"""A process with torch and lamploop imported that forks the tests' worker processes on request.

Every Python process a test starts pays about 5 s of CPU before its first line of work on the
2-core CI machine: ``import torch`` (about 3 s), the first optimizer (torch imports
``torch._dynamo`` and sympy then, about 1.7 s) and lamploop (0.4 s). The suite starts well
over a hundred of them, side by side on three workers. This server pays that once per pytest
worker: it imports them, then forks a child for each request, which becomes what
``python SCRIPT ARGS...`` (or ``python -c CODE``) would have been: its own session and process
group, the request's working directory, environment, argv (``sys.argv`` and ``sys.orig_argv``)
and ``sys.path[0]``, stdin from
``/dev/null``, stdout and stderr where the request says, numpy's global generator seeded
afresh (Python's ``random`` reseeds itself after a fork; torch's default generator starts from
its fixed default seed either way). The child is a real process: signals, ``killpg``, exit
statuses and core behaviour are the kernel's, as for a process started with ``exec``.

The protocol (tests/warm_start.py is the other side), one JSON object per line:

- stdin, requests: ``{"argv": [...], "env": {...}, "cwd": "...", "stdout": ..., "stderr": ...}``,
  the streams each a path (appended to), ``"inherit"`` (the server's stderr: its stdout is the
  replies) or, for stderr, ``"stdout"``;
- stdout, replies: ``{"started": pid}`` (or ``{"threads": n}``: the server has more threads than
  one and does not fork) for each request, in order,
  and ``{"exited": pid, "code": code}`` whenever a child ends (``code`` as
  ``subprocess.Popen.returncode``: the negative signal number for a signal).

The server forks only while it has one thread (a fork copies only the forking thread, so a
lock held by another would stay held in the child); it ends when its stdin closes (its pytest
worker ended). Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys
import types
from typing import Any, NoReturn


def _warm_up() -> None:
    """Import what (nearly) every worker imports, and what torch imports lazily on first use."""
    import anyio  # noqa: F401
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch

    import lamploop  # noqa: F401

    # torch imports torch._dynamo (and sympy) when the first optimizer is built.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _reply(message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def _become(request: dict[str, Any], wakeup: tuple[int, int]) -> list[str]:
    """In the forked child: the process the request describes, short of running it; its argv."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wakeup:
        os.close(fd)
    os.setsid()
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, where in ((1, request["stdout"]), (2, request["stderr"])):
        if where == "stdout":
            os.dup2(1, fd)
        elif where == "inherit":  # the server's stdout is its replies: its stderr is what to inherit
            os.dup2(2, fd)
        else:
            opened = os.open(where, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    import numpy

    numpy.random.seed()  # from the OS's entropy, as a fresh process's numpy does
    return list(request["argv"])


def _run(argv: list[str]) -> NoReturn:
    """Run ``python`` ``argv[1:]`` in this (forked) process, as its main module."""
    sys.orig_argv = list(argv)  # what lamploop.fit runs again to start a rank itself
    if argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[2], "<string>", "exec"), main.__dict__)
    else:
        script = os.path.abspath(argv[1])
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve() -> None:
    _warm_up()
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # the wake-up byte is the point
    children: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([0, wakeup[0]], [], [])
        if wakeup[0] in ready:
            os.read(wakeup[0], 4096)
        _reap(children)
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return  # the pytest worker is gone; the children are the tests' to end
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if _threads() != 1:  # a fork copies only this thread: another's locks would stay held
                _reply({"threads": _threads()})
                continue
            pid = os.fork()
            if pid == 0:
                _run(_become(request, wakeup))  # never returns: SystemExit ends the child
            children.add(pid)
            _reply({"started": pid})


if __name__ == "__main__":
    serve()
