"""Helpers of tests/test_federated*.py: plans, node processes, an in-process aggregator."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from lamploop.federated import (
    AggregatorSettings,
    FederatedResult,
    ModelDescription,
    OptimizerConfig,
    TrainingPlan,
    approve_plan,
    mlp,
    run_aggregator,
)
from lamploop.modelspec import model_spec
from tests.support import free_port as free_port  # the one copy, for the federated tests

TOKEN = "federated-test-token"
ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = ROOT / "tests" / "workers" / "federated_node.py"
AGGREGATOR_SCRIPT = ROOT / "tests" / "workers" / "federated_aggregator.py"
MODEL_OPTIONS: dict[str, Any] = {"sizes": [5, 8, 3], "dtype": "float64", "seed": 3}


def make_plan(**changes: Any) -> TrainingPlan:
    """A float64 MLP plan on tests/workers/federated_node.py's data; ``changes`` override fields."""
    options = changes.pop("options", MODEL_OPTIONS)
    fields: dict[str, Any] = {
        "name": "test-plan",
        "model": ModelDescription("mlp", options, model_spec(mlp(options))),
        "optimizer": OptimizerConfig("sgd", learning_rate=0.5),
        "local_epochs": None,
        "local_steps": 1,
    }
    fields.update(changes)
    return TrainingPlan(**fields)


def environment() -> dict[str, str]:
    env = dict(os.environ, LAMPLOOP_FEDERATED_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_node(
    tmp: Path, plan: TrainingPlan | None, port: int, name: str, **config: Any
) -> subprocess.Popen[str]:
    """A node process; its allow-list approves ``plan`` (or nothing when ``None``)."""
    allow = tmp / f"{name}-allow.json"
    if plan is not None:
        approve_plan(plan, allow)
    settings = {"name": name, "port": port, "allow_list": str(allow), **config}
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 -- the process holds it
    with contextlib.closing(log):
        return subprocess.Popen(
            [sys.executable, str(NODE_SCRIPT), json.dumps(settings)],
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


@contextlib.contextmanager
def processes(procs: Sequence[subprocess.Popen[str]]) -> Iterator[None]:
    """Kill whatever is still running on the way out (a failed test leaves no process behind)."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def node_result(proc: subprocess.Popen[str], timeout: float = 20.0) -> dict[str, Any]:
    """The JSON summary a node prints when the aggregator finished the run."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"node exited with {proc.returncode}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def aggregate(plan: TrainingPlan, port: int, *, timeout: float = 120.0, **settings: Any) -> FederatedResult:
    """Run the aggregator in this process (bounded by ``timeout``).

    The default ``join_timeout`` counts from here, while the node processes just started are
    still importing torch and ``torch._dynamo`` (lamploop/federated/node.py does, before
    joining): about 2 s of CPU each, 12 to over 20 s of wall time on 2 cores at a load of 10 to
    16.  It is generous for that; a run whose nodes join sooner waits no longer.
    """
    initial = mlp(dict(plan.model.options))

    async def main() -> FederatedResult:
        with anyio.fail_after(timeout):
            return await run_aggregator(
                plan=plan,
                initial_model=initial,
                token=TOKEN,
                port=port,
                settings=AggregatorSettings(**{"join_timeout": 60.0, "round_timeout": 20.0, **settings}),
            )

    return anyio.run(main)


def start_aggregator(tmp: Path, **config: Any) -> subprocess.Popen[str]:
    """An aggregator process (tests/workers/federated_aggregator.py); its log is tmp/aggregator.log."""
    log = open(tmp / "aggregator.log", "a")  # noqa: SIM115 -- the process holds it
    with contextlib.closing(log):
        return subprocess.Popen(
            [sys.executable, str(AGGREGATOR_SCRIPT), json.dumps(config)],
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


def in_process_node(
    tmp: Path,
    plan: TrainingPlan | None,
    port: int,
    name: str,
    rows: tuple[int, int],
    batch_size: int,
    ssl_context: ssl.SSLContext | None = None,
) -> Any:
    """A coroutine function running the node of tests/workers/federated_node.py in this process."""
    from lamploop.batches import tensor_batches
    from lamploop.federated import NodeSettings, run_node
    from tests.workers.federated_node import dataset

    allow = tmp / f"{name}-inproc-allow.json"
    if plan is not None:
        approve_plan(plan, allow)
    x, y = dataset()
    start, stop = rows

    async def node() -> Any:
        return await run_node(
            name=name,
            host="127.0.0.1",
            port=port,
            token=TOKEN,
            allow_list=allow,
            train_batches=tensor_batches(x[start:stop], y[start:stop], batch_size=batch_size, shuffle=False),
            validation_batches=tensor_batches(x[start:stop], y[start:stop], batch_size=64, shuffle=False),
            settings=NodeSettings(connect_timeout=20.0, retry_interval=0.05),
            ssl_context=ssl_context,
        )

    return node
