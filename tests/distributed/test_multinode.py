"""Two "hosts" (network namespaces joined by a veth pair, 10.200.0.0/30): the drive/follow and
torchrun recipes of docs/distributed.md across them, and a partition that cuts both channels.

Rank 0 runs in namespace a (10.200.0.1), rank 1 in namespace b (10.200.0.2); the root's
control channel and store listen on 10.200.0.1, and Gloo binds to the interface that
reaches it, with no ``GLOO_SOCKET_IFNAME``.  Skipped, with the reason, where namespaces
cannot be made.  Every wait is bounded; the namespaces are removed whatever happens.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fit_reference import check_against_single_process, single_process_fit
from netns import ADDRESSES, two_hosts
from workers import rank as worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = {
    "members": [0, 1],
    "strategy": "all_reduce",
    "k": 1,
    "epochs": 3,
    "data": {"seed": 321, "batches": [9, 7]},
    "model": {"seed": 2},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"name": "decrement"},
}


def _start(procs: worker.Processes, name: str, argv_prefix: list[str], config: Path, process: int) -> Any:
    argv = [*argv_prefix, sys.executable, str(worker.WORKER_SCRIPT), "runs", str(config), str(process)]
    return procs.start(name, argv)


def test_two_hosts_train_exactly_like_one(tmp_path: Path) -> None:
    with two_hosts() as hosts, worker.Processes(tmp_path) as procs:
        across = tmp_path / "across"
        local = tmp_path / "local"
        for workdir, host in ((across, ADDRESSES["a"]), (local, "127.0.0.1")):
            workdir.mkdir()
            config = workdir / "runs.json"
            config.write_text(
                json.dumps({"workdir": str(workdir), "runs": [{**RUN, "name": "run", "host": host}]})
            )
        _start(procs, "a0", hosts.run("a", []), across / "runs.json", 0)
        _start(procs, "b1", hosts.run("b", []), across / "runs.json", 1)
        _start(procs, "l0", [], local / "runs.json", 0)
        _start(procs, "l1", [], local / "runs.json", 1)
        codes = procs.wait_all(180)
    assert codes == {"a0": 0, "b1": 0, "l0": 0, "l1": 0}, procs.logs()
    assert worker.outcome(across, "run", 0)["state"] == worker.outcome(local, "run", 0)["state"]
    for name in ("rank0", "rank1"):
        got, expected = worker.tensors(across, "run", name), worker.tensors(local, "run", name)
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{name} {key}"


def test_a_partition_ends_both_sides_naming_the_other(tmp_path: Path) -> None:
    run = {**RUN, "name": "run", "host": ADDRESSES["a"], "epochs": 500, "batch_busy": 0.01}
    config = tmp_path / "runs.json"
    config.write_text(json.dumps({"workdir": str(tmp_path), "runs": [run]}))
    with two_hosts() as hosts, worker.Processes(tmp_path) as procs:
        _start(procs, "a0", hosts.run("a", []), config, 0)
        _start(procs, "b1", hosts.run("b", []), config, 1)
        procs.wait_for_file(tmp_path / "run" / "progress.json", 120, alive=["a0", "b1"])
        time.sleep(0.3)  # inside a step of epoch 1
        cut = time.time()
        hosts.cut()
        codes = {name: procs.wait(name, 45) for name in ("a0", "b1")}
        logs = procs.logs()
        for name in ("a0", "b1"):
            if procs.procs[name].poll() is None:
                procs.procs[name].send_signal(signal.SIGKILL)
    assert codes == {"a0": 1, "b1": 1}, logs
    for rank, blamed in ((0, 1), (1, 0)):
        result = worker.outcome(tmp_path, "run", rank)
        error = result["error"]
        assert error["type"] == "PeerLostError", (result, logs)
        assert (error["rank"], error["how"]) == (blamed, "silent"), (result, logs)
        assert result["failed_at"] - cut < 15.0, (result, logs)


def test_the_torchrun_recipe_for_two_nodes(tmp_path: Path) -> None:
    """docs/distributed.md's "torchrun, several nodes": one torchrun per host, c10d rendezvous
    on host a, ``LAMPLOOP_TOKEN`` set on both; ``fit`` trains as one process on the union."""
    out = tmp_path / "out"
    out.mkdir()
    env = worker.worker_env(LAMPLOOP_TOKEN=secrets.token_hex(16))
    with two_hosts() as hosts, worker.Processes(tmp_path) as procs:
        for which in ("a", "b"):
            torchrun = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES['a']}:29400", "--rdzv-id", "recipe",
                # The namespaces share the machine's host name, which resolves to neither address:
                # say which host keeps the rendezvous store and what each host's address is.
                "--rdzv-conf", f"is_host={int(which == 'a')}", "--local-addr", ADDRESSES[which],
                str(worker.WORKER_SCRIPT), "fit", str(out), "torchrun",
            ]  # fmt: skip
            procs.start(which, hosts.run(which, torchrun), env=env)
        codes = procs.wait_all(200, grace=30)
        logs = procs.logs()
    assert codes == {"a": 0, "b": 0}, logs
    check_against_single_process(out, single_process_fit(), "torchrun")
