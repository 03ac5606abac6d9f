"""One rank of a sharded run that one rank freezes inside a step (benchmarks/stress_fsdp_liveness.py).

    python tests/workers/fsdp_freeze.py CONFIG_JSON_PATH RANK

``CONFIG_JSON_PATH`` holds ``{"workdir", "nranks", "epochs", "batches", "target", "freeze_at",
"freeze_in", "signal", "slow_at" (or null), "slow_s"}``.  Rank 0 drives on ``TcpControlRoot``
(writing ``workdir/ready.json`` with its port), the others follow on ``TcpControlFollower``; every rank
trains ``strategy="fsdp"`` with the default heartbeat settings.  The model is an MLP of three
FSDP units with a parameterless layer in the middle whose backward, on rank ``target``:

- at its ``slow_at``-th call computes for ``slow_s`` seconds (a long step: the rank is slow
  but alive, its event loop keeps heartbeating) and writes ``workdir/slow.json``;
- at its ``freeze_at``-th call writes ``workdir/frozen.json`` (the time) and stops its own
  process with SIGSTOP: frozen in the middle of a backward, so every other rank is left
  waiting in one of FSDP2's all-gathers or reduce-scatters.

With ``"freeze_in": "clip"`` the run clips gradients (``max_gradient_norm``) and the target
freezes instead at its ``freeze_at``-th call of ``torch.nn.utils.clip_grad_norm_``, before it:
the other ranks are left waiting in the all-reduce of the global norm, a ``DTensor``
collective lamploop does not issue.  ``"signal": "SIGKILL"``: the target kills itself instead.

Every rank writes ``workdir/rank<r>.json``: ``{"ok": true}`` or the error it ended with (its
type, the rank it names, how, the time).  SIGUSR1 dumps every thread's stack into the log.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

TOKEN = "fsdp-freeze-token"
FEATURES, HIDDEN, CLASSES, BATCH = 16, 64, 4, 8


def _write(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _busy(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    a = torch.randn(64, 64)
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


class _Fault:
    """What the middle layer's backward does on the target rank, counted over every backward."""

    def __init__(self, config: dict[str, Any], rank: int) -> None:
        self.workdir = Path(config["workdir"])
        self.armed = rank == config["target"]
        self.freeze_at = int(config["freeze_at"])
        self.slow_at = config.get("slow_at")
        self.slow_s = float(config.get("slow_s", 0.0))
        self.in_clip = config.get("freeze_in", "backward") == "clip"
        self.signal = signal.Signals[config.get("signal", "SIGSTOP")]
        self.calls = 0
        self.clips = 0

    def before_clip(self) -> None:
        self.clips += 1
        if self.armed and self.in_clip and self.clips == self.freeze_at:
            _write(self.workdir / "frozen.json", {"time": time.time(), "pid": os.getpid()})
            os.kill(os.getpid(), self.signal)

    def in_backward(self) -> None:
        self.calls += 1
        if not self.armed:
            return
        if self.in_clip:
            return
        if self.slow_at is not None and self.calls == int(self.slow_at):
            began = time.time()
            _busy(self.slow_s)
            _write(self.workdir / "slow.json", {"began": began, "ended": time.time()})
        if self.calls == self.freeze_at:
            _write(self.workdir / "frozen.json", {"time": time.time(), "pid": os.getpid()})
            os.kill(os.getpid(), self.signal)


FAULT: _Fault | None = None
_clip = torch.nn.utils.clip_grad_norm_


def _clip_after_fault(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``clip_grad_norm_`` after :meth:`_Fault.before_clip` (the loop calls it via ``torch.nn.utils``)."""
    if FAULT is not None:
        FAULT.before_clip()
    return _clip(*args, **kwargs)


class _Hook(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if FAULT is not None:
            FAULT.in_backward()
        return grad


class FaultInBackward(torch.nn.Module):
    """Identity; its backward runs :data:`FAULT` (a parameterless layer: no FSDP unit of its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hook.apply(x)  # type: ignore[no-untyped-call,no-any-return]


def module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        FaultInBackward(),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


async def _wait_for(path: Path, within: float) -> Any:
    with anyio.fail_after(within):
        while not await anyio.Path(path).exists():  # noqa: ASYNC110  (another process writes it)
            await anyio.sleep(0.02)
    return json.loads(await anyio.Path(path).read_text())


async def _rank(config: dict[str, Any], rank: int) -> None:
    import lamploop
    from lamploop.control import TcpControlFollower, TcpControlRoot
    from lamploop.modelspec import model_spec

    workdir, nranks = Path(config["workdir"]), int(config["nranks"])
    net = module()
    generator = torch.Generator().manual_seed(100 + rank)
    n = int(config["batches"]) * BATCH
    x = torch.randn(n, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    common: dict[str, Any] = {
        "device": "cpu",
        "model": lamploop.SupervisedModel(net),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.05),
        "train_batches": lamploop.tensor_batches(x, y, batch_size=BATCH),
        "validation_batches": None,
        "strategy": "fsdp",
    }
    if config.get("freeze_in") == "clip":
        common["max_gradient_norm"] = 0.5
    spec = model_spec(net)
    with anyio.fail_after(float(config.get("timeout", 300))):
        if rank == 0:
            async with TcpControlRoot(
                host="127.0.0.1", port=0, nranks=nranks, token=TOKEN, model_spec=spec
            ) as root:
                _write(workdir / "ready.json", {"port": root.address[1]})
                await lamploop.drive_distributed_training(
                    nranks=nranks,
                    control=root,
                    host="127.0.0.1",
                    max_epochs=int(config["epochs"]),
                    **common,
                )
        else:
            ready = await _wait_for(workdir / "ready.json", 120)
            async with TcpControlFollower(
                host="127.0.0.1", port=ready["port"], rank=rank, nranks=nranks, token=TOKEN, model_spec=spec
            ) as follower:
                await lamploop.follow_distributed_training(
                    rank=rank, nranks=nranks, control=follower, **common
                )


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        return [leaf for e in inner for leaf in _leaves(e)]
    return [exc]


async def _main(config: dict[str, Any], rank: int) -> int:
    global FAULT
    torch.set_num_threads(1)
    FAULT = _Fault(config, rank)
    torch.nn.utils.clip_grad_norm_ = _clip_after_fault
    workdir = Path(config["workdir"])
    try:
        await _rank(config, rank)
    except Exception as exc:
        first = _leaves(exc)[0]
        error = {
            "type": type(first).__name__,
            "rank": getattr(first, "rank", None),
            "how": getattr(first, "how", None),
            "message": str(first),
        }
        _write(workdir / f"rank{rank}.json", {"ok": False, "error": error, "failed_at": time.time()})
        return 1
    _write(workdir / f"rank{rank}.json", {"ok": True, "ended": time.time()})
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = anyio.run(_main, json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))
    import gc

    # Python's final collection of torch's heap can take seconds on a loaded machine; the
    # test times the exit, not the collector (benchmarks/stress_liveness.py does the same).
    gc.freeze()
    sys.exit(code)
