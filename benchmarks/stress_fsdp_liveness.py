"""Stress: a rank frozen (SIGSTOP) or killed inside a sharded step; how soon every survivor ends.

Usage::

    python benchmarks/stress_fsdp_liveness.py [--repeat 5] [--spinners 0] [--json PATH]

Real processes (``tests/workers/fsdp_freeze.py``): ``strategy="fsdp"`` on Gloo, rank 0 on
``TcpControlRoot``, the others on ``TcpControlFollower``, the default heartbeat settings.  The
target rank (1) stops or kills itself inside the training step (see the worker), and every
survivor must end with ``PeerLostError`` naming it within :data:`END_WITHIN_S`.  Scenarios:

- ``backward-of-3``: SIGSTOP in the middle of a backward, 3 ranks: the survivors wait in one
  of FSDP2's all-gathers or reduce-scatters (lamploop's abortable ones, see
  :mod:`lamploop.sync.fsdp`);
- ``clip-of-2``: SIGSTOP just before ``clip_grad_norm_``, 2 ranks: the survivor waits in the
  ``DTensor`` all-reduce of the global norm, which nothing interrupts (its training thread is
  given up on, :data:`lamploop.sync.fsdp.GIVE_UP_AFTER_S` after the abort);
- ``kill-of-2``: SIGKILL in the middle of a backward, 2 ranks.

Printed per scenario: from the fault to each survivor's error and to its process's exit,
median [min-max], and the load average.  ``--spinners`` busy processes load the machine
meanwhile.  Exit status 1 when a survivor ended otherwise than expected.
``tests/sync/test_fsdp_liveness.py`` imports :func:`freeze_run` and runs each scenario once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
WORKER = HERE.parent.parent / "tests" / "workers" / "fsdp_freeze.py"
HEARTBEAT_TIMEOUT_S = 4.0  # lamploop.control.DEFAULT_HEARTBEAT_TIMEOUT_S (checked by the test)
END_WITHIN_S = HEARTBEAT_TIMEOUT_S + 1.0
"""The bound every strategy keeps (``benchmarks/stress_liveness.py``): the heartbeat timeout and a
second for the error to reach the survivor's caller."""
EXITED_WITHIN_S = 15.0
"""From the fault to a survivor's exit (its error, then its interpreter's shutdown)."""
SLOW_S = HEARTBEAT_TIMEOUT_S * 1.5
"""The long step: longer than the heartbeat timeout, which must not take the rank for lost."""
SCENARIOS: dict[str, dict[str, Any]] = {
    "backward-of-3": {"nranks": 3, "slow_s": 0.0},
    "clip-of-2": {"nranks": 2, "slow_s": 0.0, "freeze_in": "clip"},
    "kill-of-2": {"nranks": 2, "slow_s": 0.0, "kill": "SIGKILL"},
}


def freeze_run(
    workdir: Path,
    *,
    nranks: int = 3,
    target: int = 1,
    slow_s: float = SLOW_S,
    freeze_in: str = "backward",
    kill: str = "SIGSTOP",
) -> dict[str, Any]:
    """Run the worker; ``target`` is slow once (``slow_s``), then freezes itself; time the survivors."""
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):  # another run's markers would be taken for this one's
        msg = f"{workdir} is not empty"
        raise RuntimeError(msg)
    config = {
        "workdir": str(workdir),
        "nranks": nranks,
        "epochs": 1000,
        "batches": 8 * nranks,
        "target": target,
        "slow_at": 6 if slow_s else None,
        "slow_s": slow_s,
        "freeze_at": 12,
        "freeze_in": freeze_in,
        "signal": kill,
    }
    (workdir / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAMPLOOP_", "SLURM_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(WORKER.parents[2]))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for rank in range(nranks):
            with (workdir / f"log-{rank}.txt").open("wb") as log:
                procs[rank] = subprocess.Popen(
                    [sys.executable, str(WORKER), str(workdir / "config.json"), str(rank)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        frozen = _wait_for_freeze(workdir, procs, timeout=120)
        survivors = [r for r in range(nranks) if r != target]
        exited: dict[int, float] = {}
        deadline = time.monotonic() + EXITED_WITHIN_S + 20
        while time.monotonic() < deadline and len(exited) < len(survivors):
            for rank in survivors:
                if rank not in exited and procs[rank].poll() is not None:
                    exited[rank] = time.time() - frozen
            time.sleep(0.02)
        for rank in survivors:  # where a survivor that did not exit is stuck, into its log
            if procs[rank].poll() is None:
                procs[rank].send_signal(signal.SIGUSR1)
                time.sleep(1.0)
        result: dict[str, Any] = {"survivors": {}}
        for rank in survivors:
            path = workdir / f"rank{rank}.json"
            outcome = json.loads(path.read_text()) if path.exists() else {}
            error = outcome.get("error", {})
            result["survivors"][rank] = {
                "status": procs[rank].poll(),
                "error": error.get("type"),
                "named": error.get("rank"),
                "how": error.get("how"),
                "message": error.get("message"),
                "failed_after_s": outcome["failed_at"] - frozen if "failed_at" in outcome else None,
                "exited_after_s": exited.get(rank),
            }
        slow = workdir / "slow.json"
        if slow.exists():
            step = json.loads(slow.read_text())
            result["slow_step_s"] = step["ended"] - step["began"]
        result["load_average"] = os.getloadavg()
        return result
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def _wait_for_freeze(workdir: Path, procs: dict[int, subprocess.Popen[bytes]], timeout: float) -> float:
    """When the target stopped itself; fails with every log if a rank exits first (a false abort)."""
    deadline = time.monotonic() + timeout
    marker = workdir / "frozen.json"
    while not marker.exists():
        dead = {r: p.poll() for r, p in procs.items() if p.poll() is not None}
        if dead or time.monotonic() > deadline:
            msg = f"no freeze (exited: {dead}) within {timeout:g} s:\n{logs(workdir, list(procs))}"
            raise RuntimeError(msg)
        time.sleep(0.02)
    return float(json.loads(marker.read_text())["time"])


def logs(workdir: Path, ranks: list[int]) -> str:
    """The tail of every rank's log."""
    return "\n".join(
        f"--- rank {r} ---\n{(workdir / f'log-{r}.txt').read_text(errors='replace')[-6000:]}" for r in ranks
    )


def expected(result: dict[str, Any], how: tuple[str, ...]) -> bool:
    """Every survivor ended with ``PeerLostError`` naming rank 1, ``how``, within the bounds."""
    return all(
        s["error"] == "PeerLostError"
        and s["named"] == 1
        and s["how"] in how
        and s["status"] == 1
        and s["failed_after_s"] is not None
        and s["failed_after_s"] < END_WITHIN_S
        and s["exited_after_s"] is not None
        and s["exited_after_s"] < EXITED_WITHIN_S
        for s in result["survivors"].values()
    )


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):.2f} s [{min(values):.2f}-{max(values):.2f}] (n={len(values)})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--spinners", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/stress-fsdp-liveness"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
    workdir = args.workdir / time.strftime("%Y%m%d-%H%M%S")  # a fresh one: markers are files
    report: dict[str, Any] = {"load_average_at_start": os.getloadavg(), "runs": []}
    ok = True
    try:
        n = 0
        for _ in range(args.repeat):
            for name, scenario in SCENARIOS.items():
                n += 1
                result = freeze_run(workdir / f"{n}-{name}", **scenario)
                how = ("closed", "died") if scenario.get("kill") == "SIGKILL" else ("silent",)
                result["ok"] = expected(result, how)
                ok = ok and result["ok"]
                report["runs"].append({"scenario": name, **result})
                print(name, json.dumps(result, default=str), flush=True)
                if not result["ok"]:
                    print(logs(workdir / f"{n}-{name}", list(range(scenario["nranks"]))), flush=True)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait(timeout=30)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print("\nsummary (from the fault to each survivor's error / exit):")
    for name in SCENARIOS:
        survivors = [
            s for run in report["runs"] if run["scenario"] == name for s in run["survivors"].values()
        ]
        failed = [s["failed_after_s"] for s in survivors if s["failed_after_s"] is not None]
        exited = [s["exited_after_s"] for s in survivors if s["exited_after_s"] is not None]
        print(f"  {name}: error {_summary(failed)}; exit {_summary(exited)}")
    print(f"load average at start {report['load_average_at_start']}, at the end {os.getloadavg()}; ok: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
