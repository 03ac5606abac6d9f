"""Never hangs: every survivor of a lost rank ends quickly, naming the rank that failed.

DESIGN.md section 5: liveness never depends on compute; a dead, frozen or cut-off rank
ends every survivor within 15 s with default settings, naming the rank that failed (5 s
here: the default heartbeat timeout is 3 s).

Each scenario starts fresh worker processes (``tests/workers/rank.py``), 2 or 3 ranks on
Gloo with the TCP control channel and default heartbeat settings, training with a busy
CPU (every batch computes for a while on the training thread).  Once the first epoch is
done, the test waits a moment, so that the ranks are inside a step or a collective, and
then injects the fault on the root or a follower:

- ``kill``: SIGKILL;
- ``stop``: SIGSTOP, left stopped (a frozen process: its sockets stay open);
- ``close``: the follower's control connection is relayed by the test, which closes it;
- ``silent``: the relay stops forwarding but keeps the connection open.

Every survivor must end with ``PeerLostError`` naming the failed rank (``.rank``) and how
(``.how``), within 5 s of the fault, and its process must exit with status 1 (a failed
run) instead of hanging at exit on the collective that will never complete.  Scenarios
run a few at a time; every wait is bounded.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from workers import rank as worker
from workers.proxy import ControlRelay

from lamploop.control import DEFAULT_HEARTBEAT_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SURVIVORS_END_WITHIN_S = 5.0
AT_ONCE = 2

_RUN = {
    "strategy": "all_reduce",
    "k": 1,
    "epochs": 200,
    "data": {"seed": 700, "batches": [30, 30, 30]},
    "model": {"seed": 4, "hidden": 32},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "schedule": {"name": "noop"},
    "batch_busy": 0.02,
    "timeout": 300.0,
}

# (fault, nranks, target rank)
SCENARIOS = [
    (fault, nranks, target)
    for nranks in (2, 3)
    for fault, target in (
        ("kill", nranks - 1),
        ("kill", 0),
        ("stop", nranks - 1),
        ("stop", 0),
        ("close", nranks - 1),
        ("silent", nranks - 1),
    )
]


def _name(fault: str, nranks: int, target: int) -> str:
    return f"{fault}-{'root' if target == 0 else f'rank{target}'}-of-{nranks}"


def _blamed(fault: str, target: int, survivor: int) -> int:
    """Whom ``survivor`` must name: the target, except that a cut-off follower names the root."""
    if fault in ("close", "silent") and survivor == target:
        return 0
    return target


def _survivors(fault: str, nranks: int, target: int) -> list[int]:
    return [r for r in range(nranks) if r != target or fault in ("close", "silent")]


def _scenario(base: Path, fault: str, nranks: int, target: int) -> dict[str, Any]:
    name = _name(fault, nranks, target)
    workdir = base / name
    workdir.mkdir()
    run = {
        **_RUN,
        "name": "run",
        "members": list(range(nranks)),
        "data": {**_RUN["data"], "batches": _RUN["data"]["batches"][:nranks]},  # type: ignore[index]
        "via_proxy": [target] if fault in ("close", "silent") else [],
    }
    seen: dict[str, Any] = {"workdir": workdir}
    relay: ControlRelay | None = None
    with worker.Processes(workdir) as procs:
        procs.start_runs({"workdir": str(workdir), "runs": [run]}, workdir / "runs.json", range(nranks))
        everyone = [f"p{r}" for r in range(nranks)]
        ready = procs.wait_for_file(workdir / "run" / "ready.json", 120, alive=everyone)
        try:
            if run["via_proxy"]:
                relay = ControlRelay(ready["port"])
                worker.write_json(workdir / "run" / f"proxy{target}.json", {"port": relay.port})
            procs.wait_for_file(workdir / "run" / "progress.json", 120, alive=everyone)
            time.sleep(random.uniform(0.2, 0.8))  # inside a step or a collective of epoch 1
            faulted = time.time()
            if fault == "kill":
                procs.procs[f"p{target}"].send_signal(signal.SIGKILL)
            elif fault == "stop":
                procs.procs[f"p{target}"].send_signal(signal.SIGSTOP)
            elif fault == "close" and relay is not None:
                relay.close_all()
            elif relay is not None:
                relay.go_silent()
            survivors = _survivors(fault, nranks, target)
            seen["status"] = {r: procs.wait(f"p{r}", SURVIVORS_END_WITHIN_S + 30) for r in survivors}
            seen["outcome"] = {
                r: json.loads((workdir / "run" / f"rank{r}.json").read_text()) for r in survivors
            }
            seen["faulted"] = faulted
            seen["logs"] = procs.logs()
        finally:
            if relay is not None:
                relay.stop()
    return seen


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("reliability")
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Semaphore(AT_ONCE)

    def one(fault: str, nranks: int, target: int) -> None:
        with lock:
            try:
                results[_name(fault, nranks, target)] = _scenario(base, fault, nranks, target)
            except BaseException as exc:  # reported by the scenario's test
                results[_name(fault, nranks, target)] = {"crashed": repr(exc)}

    threads = [threading.Thread(target=one, args=s) for s in SCENARIOS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return results


@pytest.mark.parametrize(("fault", "nranks", "target"), SCENARIOS, ids=[_name(*s) for s in SCENARIOS])
def test_every_survivor_ends_quickly_naming_the_failed_rank(
    outcomes: dict[str, dict[str, Any]], fault: str, nranks: int, target: int
) -> None:
    seen = outcomes[_name(fault, nranks, target)]
    assert "crashed" not in seen, seen.get("crashed")
    for survivor, result in seen["outcome"].items():
        context = f"rank {survivor}: {result}\n{seen['logs']}"
        assert not result["ok"], context
        error = result["error"]
        assert error["type"] == "PeerLostError", context
        assert error["rank"] == _blamed(fault, target, survivor), context
        if fault in ("stop", "silent"):
            assert error["how"] == "silent", context
        else:
            assert error["how"] in ("died", "closed"), context
        took = result["failed_at"] - seen["faulted"]
        assert took < SURVIVORS_END_WITHIN_S, f"rank {survivor} took {took:.1f} s\n{context}"
        # A failed run exits with status 1, also with a collective that will never complete.
        assert seen["status"][survivor] == 1, context


SLOW_STEP_S = 3 * DEFAULT_HEARTBEAT_TIMEOUT_S  # well past being declared lost


@pytest.mark.timeout(SLOW_STEP_S + 150)
def test_a_rank_with_a_step_of_three_heartbeat_timeouts_is_slow_not_lost(tmp_path: Path) -> None:
    """Rank 1 blocks its training thread for 9 s inside a step (default heartbeat settings).

    The root waits in a collective meanwhile; heartbeats flow on both event loops, so the
    run finishes, equal to an undisturbed run of the same configuration run beside it.
    """
    short = {**_RUN, "epochs": 3, "batch_busy": 0.0, "data": {"seed": 710, "batches": [8, 8]}}
    runs = {
        "slow": {**short, "slow_batch": {"epoch": 1, "rank": 1, "batch": 3, "seconds": SLOW_STEP_S}},
        "steady": short,
    }
    with worker.Processes(tmp_path) as procs:
        for name, run in runs.items():
            workdir = tmp_path / name
            workdir.mkdir()
            config = {"workdir": str(workdir), "runs": [{**run, "name": "run", "members": [0, 1]}]}
            path = workdir / "runs.json"
            path.write_text(json.dumps(config))
            for r in (0, 1):
                procs.start(
                    f"{name}{r}",
                    [worker.sys.executable, str(worker.WORKER_SCRIPT), "runs", str(path), str(r)],
                )
        started = time.monotonic()
        codes = procs.wait_all(SLOW_STEP_S + 120)
    assert codes == {"slow0": 0, "slow1": 0, "steady0": 0, "steady1": 0}, procs.logs()
    assert time.monotonic() - started > SLOW_STEP_S  # the slow step did happen
    slow, steady = (worker.outcome(tmp_path / n, "run", 0) for n in ("slow", "steady"))
    assert slow["ok"], slow
    assert steady["ok"], steady
    assert slow["state"] == steady["state"]
    for name in ("rank0", "rank1", "live"):
        got, expected = (
            worker.tensors(tmp_path / "slow", "run", name),
            worker.tensors(tmp_path / "steady", "run", name),
        )
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{name} {key}"
