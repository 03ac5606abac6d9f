"""Small user programs with ONE fault injected, for tests/test_acceptance_no_hangs_r2.py.

    python tests/workers/no_hangs_r2_worker.py ROLE OUT_DIR NAME CONFIG_JSON

ROLE is one of:

- ``fed-aggregator``: :func:`lamploop.federated.run_aggregator` over :func:`plan`; listens on a
  free port and writes it to ``OUT_DIR/port-NAME``; CONFIG_JSON holds the
  ``AggregatorSettings`` fields, and ``fault`` (``"sigkill"`` or ``"sigstop"``: in its
  ``on_round`` of round ``fault_round``, i.e. while every node waits for the next round);
- ``fed-node``: :func:`lamploop.federated.run_node` on its rows of :func:`node_data`, with
  ``NodeSettings`` from CONFIG_JSON and a ``fault`` (``"sigkill"``, ``"sigstop"``, ``"raise"``
  or ``"slow"``) in its training stream, at the second batch of round ``fault_round``;
  ``token`` overrides the shared token (a node with a wrong one);
- ``pipe-stage``: one rank of a 2-stage :func:`lamploop.pipeline.train_pipeline`; the fault
  (``"sigkill"``, ``"sigstop"``, ``"raise"``) is in a layer's forward on stage ``fault_stage``,
  inside a training step of epoch 1 (or, with ``"where": "checkpoint"``, in its
  ``checkpoint_state`` after epoch 1);
- ``control-root`` and ``control-follower``: the TCP control channel by hand
  (``TcpControlRoot`` / ``TcpControlFollower``, docs/control-channel.md); the root writes its
  address to ``OUT_DIR/address-NAME``, sends ``Train(0)``, ``Valid(0)``, then waits for
  ``OUT_DIR/finish`` (at most 40 s) before ``Stop``.

Every process writes ``OUT_DIR/pid-NAME`` at start, ``OUT_DIR/struck-NAME`` (``time.time()``)
when its fault strikes, and a record ``OUT_DIR/NAME`` (tests/workers/records.py: JSON beside a
safetensors file) when it returns or raises: the error's type, classes, message and the
attributes lamploop's errors carry, or the result.  An exception is raised on, as a user's
script lets it out: Python prints its traceback and the process exits with status 1.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: ``workers.records`` from tests/
    sys.path.insert(0, str(HERE.parent))

from workers.records import save_record, write_whole  # noqa: E402

TOKEN = "no-hangs-r2-token-0123456789abcdef"
FEATURES = 5
CLASSES = 3
MODEL_OPTIONS: dict[str, Any] = {"sizes": [FEATURES, 8, CLASSES], "dtype": "float64", "seed": 3}


class InjectedFault(RuntimeError):
    """The fault a scenario injects (its name and message are what the tests look for)."""


def fault_message(where: str, who: str, when: str) -> str:
    return f"injected fault in {where} on {who} in {when}"


def strike(how: str, out: Path, name: str, message: str) -> None:
    """The fault itself: ``sigkill``, ``sigstop`` (returns once continued) or ``raise``."""
    at = time.time()
    write_whole((out / f"struck-{name}"), repr(at))
    print(f"[{name}] striking: {how} at {at:.3f}", file=sys.stderr, flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "raise":
        raise InjectedFault(message)
    else:
        raise AssertionError(how)


def error_record(exc: BaseException) -> dict[str, Any]:
    """What a test reads of an error; a group of one (anyio's task groups) is read as that one."""
    group = None
    inner = getattr(exc, "exceptions", None)
    while isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException):
        group = group or type(exc).__name__
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)

    def plain(value: Any) -> Any:
        return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)

    return {
        "error": type(exc).__name__,
        "classes": [cls.__name__ for cls in type(exc).__mro__],
        "message": str(exc),
        "rank_attr": plain(getattr(exc, "rank", None)),
        "how": plain(getattr(exc, "how", None)),
        "cause": None if exc.__cause__ is None else f"{type(exc.__cause__).__name__}: {exc.__cause__}",
        "group": group,
    }


# --- federated ------------------------------------------------------------------------------------


def plan() -> Any:
    from lamploop.federated import ModelDescription, OptimizerConfig, TrainingPlan, mlp
    from lamploop.modelspec import model_spec

    return TrainingPlan(
        name="no-hangs-r2",
        model=ModelDescription("mlp", MODEL_OPTIONS, model_spec(mlp(MODEL_OPTIONS))),
        optimizer=OptimizerConfig("sgd", learning_rate=0.1),
        local_epochs=1,
        optimizer_state="reset",
    )


def node_data(rows: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (rows,), generator=generator)


async def fed_aggregator(out: Path, name: str, config: dict[str, Any]) -> Any:
    from lamploop.federated import AggregatorSettings, mlp, run_aggregator

    fault = config.pop("fault", None)
    fault_round = config.pop("fault_round", 0)
    fields = {"join_timeout": 30.0, "round_timeout": 30.0, "handshake_timeout": 2.0, **config}

    def on_listening(port: int) -> None:
        tmp = out / f".port-{name}"
        tmp.write_text(str(port))
        os.replace(tmp, out / f"port-{name}")

    def on_round(record: Any) -> None:
        write_whole((out / f"round-{record.round}-{name}"), repr(time.time()))
        if fault is not None and record.round == fault_round:
            strike(fault, out, name, fault_message("on_round", name, f"round {record.round}"))

    result = await run_aggregator(
        plan=plan(),
        initial_model=mlp(MODEL_OPTIONS),
        token=TOKEN,
        settings=AggregatorSettings(**fields),
        on_listening=on_listening,
        on_round=on_round,
    )
    return {
        "rounds": [
            {
                "round": record.round,
                "answered": [report.node for report in record.answered],
                "missing": [[missing.node, missing.why] for missing in record.missing],
            }
            for record in result.rounds
        ]
    }


async def fed_node(out: Path, name: str, config: dict[str, Any]) -> Any:
    from lamploop.batches import BatchContext, tensor_batches
    from lamploop.federated import NodeSettings, approve_plan, run_node

    allow = out / f"allow-{name}.json"
    approve_plan(plan(), allow)
    x, y = node_data()
    start, stop = config.get("rows", [0, 40])
    inner = tensor_batches(x[start:stop], y[start:stop], batch_size=10, shuffle=False)
    fault = config.get("fault")
    fault_round = config.get("fault_round", 0)

    def train(context: BatchContext) -> Any:
        async def stream() -> AsyncIterator[Any]:
            made = 0
            async for batch in inner(context):
                struck = (out / f"struck-{name}").exists()  # once: a round sent again trains cleanly
                if fault is not None and made == 1 and context.epoch == fault_round and not struck:
                    message = fault_message("local training", name, f"round {context.epoch}")
                    if fault == "slow":  # a data source that stalls (a network read), then comes
                        write_whole((out / f"struck-{name}"), repr(time.time()))
                        await anyio.sleep(float(config["slow_s"]))
                    else:
                        strike(fault, out, name, message)
                made += 1
                yield batch
            write_whole((out / f"trained-{context.epoch}-{name}"), repr(time.time()))

        return stream()

    settings = NodeSettings(
        connect_timeout=float(config.get("connect_timeout", 30.0)),
        retry_interval=0.05,
        handshake_timeout=float(config.get("handshake_timeout", 5.0)),
        idle_timeout=float(config.get("idle_timeout", 3600.0)),
    )
    summary = await run_node(
        name=name,
        host="127.0.0.1",
        port=int(config["port"]),
        token=config.get("token", TOKEN),
        allow_list=allow,
        train_batches=train,
        validation_batches=tensor_batches(x[start:stop], y[start:stop], batch_size=40, shuffle=False),
        settings=settings,
    )
    return {
        "trained": list(summary.trained),
        "refused": list(summary.refused),
        "finish_reason": summary.finish_reason,
        "failed": summary.failed,
    }


# --- pipeline -------------------------------------------------------------------------------------


class Probe(nn.Module):
    """A layer that passes its input on, 10 ms per call, and strikes inside a training step of
    epoch 1 (its third batch) when its stage is the faulty one."""

    def __init__(self, stage: int, spec: dict[str, Any], rank: int, out: Path, name: str) -> None:
        super().__init__()
        self.stage = stage
        self.spec = spec
        self.rank = rank
        self.out = out
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta":
            return x
        time.sleep(0.01)
        due = self.training and self.stage == self.rank == self.spec.get("fault_stage")
        due = due and self.spec.get("where", "forward") == "forward"
        if due and POSITION == (1, 2) and not (self.out / f"struck-{self.name}").exists():
            message = fault_message("forward", f"stage {self.stage}", "epoch 1, batch 2")
            strike(self.spec["fault"], self.out, self.name, message)
        return x


POSITION: tuple[int, int] = (-1, -1)
"""(epoch, batch) of the training batch last drawn from the stream."""


def pipe_stage(out: Path, name: str, config: dict[str, Any]) -> Any:
    import lamploop
    from lamploop.pipeline import PipelineSpec, open_pipeline_group, train_pipeline

    rank = int(config["rank"])
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 16),
        nn.Tanh(),
        Probe(0, config, rank, out, name),
        nn.Linear(16, 16),
        nn.Tanh(),
        Probe(1, config, rank, out, name),
        nn.Linear(16, 3),
    )
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(160, 6, generator=generator), torch.randint(0, 3, (160,), generator=generator)
    inner = lamploop.tensor_batches(x, y, batch_size=16, seed=1)

    def train(context: Any) -> Any:
        async def stream() -> AsyncIterator[Any]:
            global POSITION
            index = 0
            async for batch in inner(context):
                POSITION = (context.epoch, index)
                index += 1
                yield batch

        return stream()

    checkpoints = 0

    async def checkpoint_state(state: Any, schedule_state: Any) -> None:
        """Stands in for a checkpoint's write (10 ms); the fault strikes in that of epoch 1."""
        nonlocal checkpoints
        del state, schedule_state
        checkpoints += 1
        await anyio.sleep(0.01)
        if config.get("where") == "checkpoint" and rank == config.get("fault_stage") and checkpoints == 2:
            strike(config["fault"], out, name, fault_message("checkpoint_state", f"stage {rank}", "epoch 1"))

    with open_pipeline_group(
        rank=rank,
        world_size=2,
        host="127.0.0.1",
        port=int(config["port"]),
        timeout=float(config["timeout"]),
        join_timeout=float(config.get("join_timeout", 60.0)),
    ):
        write_whole((out / f"joined-{name}"), repr(time.time()))
        state = anyio.run(
            partial(
                train_pipeline,
                model=model,
                spec=PipelineSpec(boundaries=(3,), n_microbatches=2),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=train,
                max_epochs=int(config.get("epochs", 3)),
                checkpoint_state=checkpoint_state,
            )
        )
    return {"epoch": state.epoch}


# --- the control channel by hand ------------------------------------------------------------------


def control_spec() -> Any:
    from lamploop.modelspec import ModelSpec, TensorSpec

    return ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))


async def control_root(out: Path, name: str, config: dict[str, Any]) -> Any:
    from lamploop.control import Rendezvous, Stop, TcpControlRoot, Train, Valid

    root = TcpControlRoot(
        nranks=2,
        token=TOKEN,
        model_spec=control_spec(),
        join_timeout=float(config.get("join_timeout", 40.0)),
        handshake_timeout=float(config.get("handshake_timeout", 2.0)),
    )
    async with root:
        tmp = out / f".address-{name}"
        tmp.write_text(json.dumps(list(root.address)))
        os.replace(tmp, out / f"address-{name}")
        await root.on_rendezvous_ready(Rendezvous(host="127.0.0.1", port=29999))
        write_whole((out / f"joined-{name}"), repr(time.time()))
        await root.broadcast(Train(epoch=0, lr_factor=1.0))
        await root.broadcast(Valid(epoch=0))
        with anyio.move_on_after(40):
            while not await anyio.Path(out / "finish").exists():  # noqa: ASYNC110 -- another process's file
                await anyio.sleep(0.05)
        refusals = list(root.recent_refusals)
        await root.broadcast(Stop(reason="done"))
        peers = list(root.peers())
    write_whole((out / f"left-{name}"), repr(time.time()))
    return {"peers": peers, "refusals": refusals}


async def control_follower(out: Path, name: str, config: dict[str, Any]) -> Any:
    from lamploop.control import TcpControlFollower

    follower = TcpControlFollower(
        host="127.0.0.1",
        port=int(config["port"]),
        rank=1,
        nranks=2,
        token=config.get("token", TOKEN),
        model_spec=control_spec(),
        connect_timeout=float(config.get("connect_timeout", 20.0)),
        handshake_timeout=float(config.get("handshake_timeout", 5.0)),
    )
    seen = []
    async with follower:
        rendezvous, commands = await follower.join()
        write_whole((out / f"joined-{name}"), repr(time.time()))
        seen.append(type(rendezvous).__name__)
        async for command in commands:
            seen.append(type(command).__name__)
    return {"seen": seen}


# --- main -----------------------------------------------------------------------------------------


def run(role: str, out: Path, name: str, config: dict[str, Any]) -> Any:
    if role == "fed-aggregator":
        return anyio.run(fed_aggregator, out, name, config)
    if role == "fed-node":
        return anyio.run(fed_node, out, name, config)
    if role == "pipe-stage":
        return pipe_stage(out, name, config)
    if role == "control-root":
        return anyio.run(control_root, out, name, config)
    if role == "control-follower":
        return anyio.run(control_follower, out, name, config)
    raise AssertionError(role)


def main() -> int:
    role, out, name, config = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    write_whole((out / f"pid-{name}"), str(os.getpid()))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{name}] %(name)s: %(message)s")
    try:
        result = run(role, out, name, config)
    except BaseException as exc:
        save_record({**error_record(exc), "traceback": traceback.format_exc(), "at": time.time()}, out / name)
        print(f"[{name}] ended by {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        gc.freeze()  # docs/reliability.md: a short shutdown for a script that ends after a failed run
        raise
    save_record({"error": None, "result": result, "at": time.time()}, out / name)
    print(f"[{name}] finished: {json.dumps(result)}", file=sys.stderr, flush=True)
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
