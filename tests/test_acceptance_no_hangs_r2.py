"""Acceptance, round 2: nothing hangs in federated rounds, pipelines, the CLI and the control port.

Round 1 (tests/test_acceptance_no_hangs.py) covered ``fit``, DataLoader workers and streaming.
This module covers what it did not, written from the documentation alone: docs/federated.md and
the docstrings of ``run_aggregator``, ``run_node``, ``AggregatorSettings`` and ``NodeSettings``;
docs/pipeline.md and the docstrings of ``open_pipeline_group`` and ``train_pipeline``;
docs/cli.md and docs/reliability.md ("Stopping on request"); docs/control-channel.md,
docs/transport.md and the docstring of ``TcpControlRoot``.

Each test starts real processes (tests/workers/no_hangs_r2_worker.py, forked warm by
tests/workers/warm_start.py; the ``lamploop`` command itself for the CLI), injects ONE fault
with a real signal (SIGKILL, SIGSTOP, SIGTERM, SIGINT) or a real exception inside a round, a
step or a handshake, on 127.0.0.1, and asserts:

- every process of the scenario ends within a bound taken from the docs (a timeout or a
  deadline the test sets, plus :data:`MARGIN` for a loaded 2-core machine); on a timeout the
  failure message holds the stacks of every living process (py-spy) and they are killed;
- its exit status and error class are the documented ones, and the error names the right
  party (node, stage, rank, peer).

Every process is SIGCONTed and SIGKILLed (with its session) in a ``finally``: a failed test
leaves nothing behind. The strict xfails say DEFECT in their reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from support import WORKERS, free_port
from workers import warm_start
from workers.records import load_record

WORKER = WORKERS / "no_hangs_r2_worker.py"
LAMPLOOP = Path(sys.executable).with_name("lamploop")
PY_SPY = Path(sys.executable).with_name("py-spy")
MARGIN = 15.0
"""Seconds a process may take beyond a documented bound: noticing, Python's exit, a loaded machine."""
START_S = 45.0
"""How long a worker may take to get going (a warm fork; a cold ``lamploop`` start is slower)."""
HANDSHAKE_S = 2.0
"""The ``handshake_timeout`` of the aggregator and the control root in these scenarios."""
WRONG_TOKEN = "not-the-token-0123456789abcdef0123"
WRONG_PLACE = {"connect_timeout": 3.0, "handshake_timeout": 2.0}
"""A client's timeouts where it reaches a server that will never welcome it."""

pytestmark = [pytest.mark.slow]


# --------------------------------------------------------------------------------------------
# Processes, bounded
# --------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    for name in ("LAMPLOOP_RANK", "PYTHONWARNINGS"):
        env.pop(name, None)
    return env


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    """Running or stopped, not ended (a zombie counts as ended)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _session(sid: int) -> set[int]:
    """The living processes of session ``sid`` (every worker leads its own)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == sid:
                found.add(int(entry.name))
    return found


def _stacks(pids: set[int]) -> str:
    parts = []
    for pid in sorted(pids):
        fields = _stat(pid)
        if fields is not None and fields[0] == "T":
            parts.append(f"--- pid {pid}: stopped (SIGSTOP), not dumped")
            continue
        try:
            done = subprocess.run(
                [str(PY_SPY), "dump", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=20,
                stdin=subprocess.DEVNULL,
                check=False,
            )
            parts.append(f"--- py-spy dump --pid {pid} ---\n{done.stdout}{done.stderr}")
        except (subprocess.TimeoutExpired, OSError) as exc:
            parts.append(f"--- py-spy dump --pid {pid}: {exc!r}")
    return "\n".join(parts)


class Proc:
    """One process of a scenario: a worker role (forked warm) or a command (cold)."""

    def __init__(self, out: Path, name: str, argv: list[str], *, cwd: Path | None = None) -> None:
        self.out = out
        self.name = name
        self.log = out / f"{name}.log"
        self.started = time.monotonic()
        self.proc: Any = warm_start.popen(
            argv, env=_env(), cwd=cwd or WORKERS.parent, stdout=str(self.log), stderr=subprocess.STDOUT
        )
        self.pid: int = self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def poll(self) -> int | None:
        status: int | None = self.proc.poll()
        return status

    def pids(self) -> set[int]:
        """This process and what it started (its session), while they live."""
        return ({self.pid} if self.poll() is None else set()) | _session(self.pid)

    def record(self) -> dict[str, Any]:
        path = self.out / self.name
        assert path.exists(), f"no record of {self.name}:\n{self.output()[-6000:]}"
        value: dict[str, Any] = load_record(path)
        return value

    def struck(self) -> float:
        """``time.monotonic()`` of the moment its fault struck (the worker wrote ``time.time()``)."""
        return time.monotonic() - (time.time() - float((self.out / f"struck-{self.name}").read_text()))

    def context(self) -> str:
        return f"{self.name} (pid {self.pid}), exit status {self.poll()}; output:\n{self.output()[-5000:]}"


class Scenario:
    """The processes of one test; :meth:`end` ends them all, whatever happened."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: dict[str, Proc] = {}

    def worker(self, role: str, name: str, **config: Any) -> Proc:
        argv = [sys.executable, str(WORKER), role, str(self.out), name, json.dumps(config)]
        proc = self.procs[name] = Proc(self.out, name, argv)
        return proc

    def command(self, name: str, *args: str) -> Proc:
        proc = self.procs[name] = Proc(self.out, name, [str(LAMPLOOP), *args], cwd=self.out)
        return proc

    def living(self) -> set[int]:
        pids: set[int] = set()
        for proc in self.procs.values():
            pids |= proc.pids()
        return pids

    def fail_hung(self, what: str) -> NoReturn:
        pids = self.living()
        stacks = _stacks(pids)
        self.end()
        logs = "\n".join(f"=== {proc.name}:\n{proc.output()[-3000:]}" for proc in self.procs.values())
        pytest.fail(f"HANG: {what}\n{stacks}\n{logs}", pytrace=False)
        raise AssertionError(what)  # not reached

    def wait(self, proc: Proc, bound: float, since: float | None = None, what: str = "") -> int:
        """``proc``'s exit status, once it ended within ``bound`` s of ``since`` (default: its
        start); a hang otherwise (stacks, then every process killed, then the test fails)."""
        start = proc.started if since is None else since
        status: int | None = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            status = proc.proc.wait(timeout=max(0.1, start + bound - time.monotonic()))
        if status is None:
            self.fail_hung(f"{proc.name} (pid {proc.pid}) did not exit within {bound:g} s {what}".rstrip())
        return int(status)

    def wait_for(self, condition: Callable[[], bool], bound: float, what: str) -> None:
        deadline = time.monotonic() + bound
        while not condition():
            if time.monotonic() > deadline:
                self.fail_hung(f"{what}: not within {bound:g} s")
            time.sleep(0.05)

    def wait_file(self, name: str, bound: float = START_S, proc: Proc | None = None) -> Path:
        path = self.out / name
        self.wait_for(
            lambda: path.exists() or (proc is not None and proc.poll() is not None), bound, f"{name} written"
        )
        assert path.exists(), proc.context() if proc is not None else name
        return path

    def all_ended(self, bound: float) -> None:
        """Every process of the scenario (and what each started) ended within ``bound`` s."""
        self.wait_for(lambda: not self.living(), bound, f"every process ended ({sorted(self.living())} live)")

    def end(self) -> None:
        for proc in self.procs.values():
            for pid in proc.pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.proc.wait(timeout=20)


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Scenario]:
    run = Scenario(tmp_path)
    try:
        yield run
    finally:
        run.end()


def _fault(where: str, who: str, when: str) -> str:
    """The message of the fault the worker raises (no_hangs_r2_worker.fault_message)."""
    return f"injected fault in {where} on {who} in {when}"


# --------------------------------------------------------------------------------------------
# Federated rounds (docs/federated.md, "Faults"; run_aggregator and run_node)
# --------------------------------------------------------------------------------------------

ROWS = {"node-0": [0, 40], "node-1": [40, 80], "node-2": [80, 120]}


def _federation(
    scenario: Scenario, nodes: dict[str, dict[str, Any]], **settings: Any
) -> tuple[Proc, int, dict[str, Proc]]:
    """An aggregator process (``settings``: AggregatorSettings and its fault) and node processes."""
    aggregator = scenario.worker("fed-aggregator", "aggregator", **settings)
    port = int(scenario.wait_file("port-aggregator", proc=aggregator).read_text())
    started = {
        name: scenario.worker("fed-node", name, port=port, rows=ROWS[name], **config)
        for name, config in nodes.items()
    }
    return aggregator, port, started


def _missing(record: dict[str, Any], round_: int) -> dict[str, str]:
    rounds = record["result"]["rounds"]
    return dict(rounds[round_]["missing"])


def _answered(record: dict[str, Any], round_: int) -> list[str]:
    answered: list[str] = record["result"]["rounds"][round_]["answered"]
    return answered


@pytest.mark.timeout(120)
def test_a_node_killed_mid_round_is_dropped_at_once_and_named(scenario: Scenario) -> None:
    """federated.md: "A node that dies in the middle of a round is dropped at once (its connection
    breaks) and named in the record; the round goes on with the others if at least `min_nodes`
    answered". node-2 SIGKILLs itself inside its local training of round 0 (round_timeout 30 s):
    the aggregator ends both rounds and exits 0 well before that deadline, round 0's record names
    node-2 as lost, and the other nodes end too."""
    aggregator, _, nodes = _federation(
        scenario,
        {"node-0": {}, "node-1": {}, "node-2": {"fault": "sigkill", "fault_round": 0}},
        rounds=2,
        min_nodes=2,
        expected_nodes=3,
        round_timeout=30.0,
    )
    scenario.wait_file("struck-node-2", proc=nodes["node-2"])
    struck = nodes["node-2"].struck()
    assert scenario.wait(nodes["node-2"], 10, since=struck) == -signal.SIGKILL
    assert scenario.wait(aggregator, 20, since=struck, what="after node-2 died") == 0, aggregator.context()
    scenario.all_ended(MARGIN)
    record = aggregator.record()
    assert list(_missing(record, 0)) == ["node-2"], record
    assert "lost" in _missing(record, 0)["node-2"], record
    assert _answered(record, 0) == ["node-0", "node-1"], record
    assert _answered(record, 1) == ["node-0", "node-1"], record
    for name in ("node-0", "node-1"):
        assert nodes[name].poll() == 0, nodes[name].context()
        assert nodes[name].record()["result"]["trained"] == [0, 1], nodes[name].record()


@pytest.mark.timeout(120)
def test_a_frozen_node_is_dropped_at_the_round_deadline(scenario: Scenario) -> None:
    """federated.md: "A frozen node is dropped at `round_timeout`". node-2 SIGSTOPs itself inside
    its local training of round 0, round_timeout 4 s: the aggregator ends the run within 4 s
    (plus a margin) of the freeze, naming node-2 missing; node-0 and node-1 end. Continued
    afterwards, node-2 finds its aggregator gone and ends too, within its `connect_timeout`."""
    aggregator, _, nodes = _federation(
        scenario,
        {
            "node-0": {},
            "node-1": {},
            "node-2": {
                "fault": "sigstop",
                "fault_round": 0,
                "connect_timeout": 3.0,
                "handshake_timeout": 2.0,
            },
        },
        rounds=1,
        min_nodes=2,
        expected_nodes=3,
        round_timeout=4.0,
    )
    scenario.wait_file("struck-node-2", proc=nodes["node-2"])
    struck = nodes["node-2"].struck()
    assert scenario.wait(aggregator, 4.0 + MARGIN, since=struck, what="after node-2 froze") == 0, (
        aggregator.context()
    )
    record = aggregator.record()
    assert list(_missing(record, 0)) == ["node-2"], record
    assert _missing(record, 0)["node-2"], record
    assert _answered(record, 0) == ["node-0", "node-1"], record
    for name in ("node-0", "node-1"):
        assert scenario.wait(nodes[name], MARGIN, since=time.monotonic()) == 0, nodes[name].context()
    continued = time.monotonic()
    os.kill(nodes["node-2"].pid, signal.SIGCONT)
    status = scenario.wait(
        nodes["node-2"], 3.0 + HANDSHAKE_S + MARGIN, since=continued, what="once continued"
    )
    if status != 0:
        assert status == 1, nodes["node-2"].context()
        assert nodes["node-2"].record()["error"] == "FederatedError", nodes["node-2"].record()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_a_node_whose_local_training_raises_ends_and_is_named(scenario: Scenario) -> None:
    """A node's own training stream raises in round 0 (the user's error, on that node only): the
    node's process ends with that error (status 1, the message in its output); federated.md: a
    node that dies in a round is "dropped at once (its connection breaks) and named in the
    record; the round goes on with the others if at least `min_nodes` answered" (here 1): the
    aggregator runs round 1 with node-0 and exits 0, and node-0 ends."""
    aggregator, _, nodes = _federation(
        scenario,
        {"node-0": {}, "node-1": {"fault": "raise", "fault_round": 0}},
        rounds=2,
        min_nodes=1,
        expected_nodes=2,
        round_timeout=30.0,
    )
    scenario.wait_file("struck-node-1", proc=nodes["node-1"])
    struck = nodes["node-1"].struck()
    assert scenario.wait(nodes["node-1"], MARGIN, since=struck) == 1, nodes["node-1"].context()
    assert _fault("local training", "node-1", "round 0") in nodes["node-1"].output(), nodes[
        "node-1"
    ].context()
    assert "InjectedFault" in nodes["node-1"].record()["traceback"], nodes["node-1"].record()
    assert scenario.wait(aggregator, 20, since=struck, what="after node-1 failed") == 0, aggregator.context()
    scenario.all_ended(MARGIN)
    record = aggregator.record()
    assert list(_missing(record, 0)) == ["node-1"], record
    assert _answered(record, 0) == ["node-0"], record
    assert _answered(record, 1) == ["node-0"], record
    assert nodes["node-0"].poll() == 0, nodes["node-0"].context()


@pytest.mark.timeout(120)
def test_a_slow_node_past_the_round_deadline_is_named_and_nothing_waits_for_it(scenario: Scenario) -> None:
    """`AggregatorSettings.round_timeout`: "the longest wait for a round's answers"; the record's
    `missing` names "the nodes sent the round that were not averaged, and why (lost, refused,
    too late)". node-1's data source stalls 10 s in round 0 (alive, not frozen), round_timeout
    3 s, one round: the aggregator exits 0 within 3 s (plus a margin) of the stall, naming
    node-1; node-1, its source back, finds the run over and ends within its connect_timeout."""
    aggregator, _, nodes = _federation(
        scenario,
        {
            "node-0": {},
            "node-1": {
                "fault": "slow",
                "slow_s": 10.0,
                "fault_round": 0,
                "connect_timeout": 3.0,
                "handshake_timeout": 2.0,
            },
        },
        rounds=1,
        min_nodes=1,
        expected_nodes=2,
        round_timeout=3.0,
    )
    scenario.wait_file("struck-node-1", proc=nodes["node-1"])
    struck = nodes["node-1"].struck()
    assert scenario.wait(aggregator, 3.0 + MARGIN, since=struck, what="after node-1 stalled") == 0, (
        aggregator.context()
    )
    record = aggregator.record()
    assert list(_missing(record, 0)) == ["node-1"], record
    assert _missing(record, 0)["node-1"], record
    assert _answered(record, 0) == ["node-0"], record
    assert scenario.wait(nodes["node-0"], MARGIN, since=time.monotonic()) == 0, nodes["node-0"].context()
    status = scenario.wait(nodes["node-1"], 10.0 + 3.0 + HANDSHAKE_S + MARGIN, since=struck)
    if status != 0:
        assert status == 1, nodes["node-1"].context()
        assert nodes["node-1"].record()["error"] == "FederatedError", nodes["node-1"].record()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_the_aggregator_killed_while_nodes_wait_ends_every_node(scenario: Scenario) -> None:
    """federated.md: "A node that loses the aggregator reconnects (for up to `connect_timeout`)";
    run_node raises "FederatedError: the aggregator could not be reached for `connect_timeout`
    seconds". The aggregator SIGKILLs itself in its `on_round` of round 0 (both nodes answered
    and wait for round 1); connect_timeout 3 s: each node exits 1 with a FederatedError within
    3 s (plus a margin)."""
    aggregator, port, nodes = _federation(
        scenario,
        {name: {"connect_timeout": 3.0, "handshake_timeout": 2.0} for name in ("node-0", "node-1")},
        rounds=3,
        min_nodes=2,
        expected_nodes=2,
        fault="sigkill",
        fault_round=0,
    )
    scenario.wait_file("struck-aggregator", proc=aggregator)
    struck = aggregator.struck()
    assert scenario.wait(aggregator, 10, since=struck) == -signal.SIGKILL
    for name, node in nodes.items():
        status = scenario.wait(
            node, 3.0 + HANDSHAKE_S + MARGIN, since=struck, what="after the aggregator died"
        )
        assert status == 1, node.context()
        record = node.record()
        assert record["error"] == "FederatedError", record
        assert str(port) in record["message"], record
        assert name in node.output(), node.context()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_the_aggregator_frozen_while_nodes_wait_ends_every_node(scenario: Scenario) -> None:
    """`NodeSettings.idle_timeout`: "once joined, the longest wait for the aggregator's next
    message"; run_node raises FederatedError when the aggregator "was silent for `idle_timeout`
    seconds" (or could not be reached for `connect_timeout`). The aggregator SIGSTOPs itself in
    its `on_round` of round 0; idle_timeout 3 s, connect_timeout 3 s, handshake_timeout 2 s:
    each node exits 1 with a FederatedError within those (plus a margin). Continued, the
    aggregator, its nodes gone, fails within its join_timeout and round_timeout."""
    node_settings = {"connect_timeout": 3.0, "handshake_timeout": 2.0, "idle_timeout": 3.0}
    aggregator, port, nodes = _federation(
        scenario,
        dict.fromkeys(("node-0", "node-1"), node_settings),
        rounds=3,
        min_nodes=2,
        expected_nodes=2,
        join_timeout=5.0,
        round_timeout=5.0,
        fault="sigstop",
        fault_round=0,
    )
    scenario.wait_file("struck-aggregator", proc=aggregator)
    struck = aggregator.struck()
    for node in nodes.values():
        status = scenario.wait(
            node, 3.0 + 3.0 + 2.0 + MARGIN, since=struck, what="after the aggregator froze"
        )
        assert status == 1, node.context()
        record = node.record()
        assert record["error"] == "FederatedError", record
        assert str(port) in record["message"] or "aggregator" in record["message"], record
    continued = time.monotonic()
    os.kill(aggregator.pid, signal.SIGCONT)
    status = scenario.wait(aggregator, 5.0 + 5.0 + MARGIN, since=continued, what="once continued")
    assert status == 1, aggregator.context()
    assert aggregator.record()["error"] == "FederatedError", aggregator.record()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_a_frozen_node_sent_the_round_again_fails_the_run_naming_it(scenario: Scenario) -> None:
    """federated.md, one round: "5. otherwise send the round again (`round_attempts` in all),
    then fail with a `FederatedError` that names the missing nodes". Two nodes, min_nodes 2,
    round_timeout 3 s, round_attempts 2; node-1 SIGSTOPs itself in its training of round 0: the
    aggregator exits 1 within 2 x 3 s (plus a margin) of the freeze with a FederatedError
    naming node-1; node-0 ends too (the run is over), and node-1, continued, ends as well."""
    aggregator, _, nodes = _federation(
        scenario,
        {
            "node-0": {},
            "node-1": {
                "fault": "sigstop",
                "fault_round": 0,
                "connect_timeout": 3.0,
                "handshake_timeout": 2.0,
            },
        },
        rounds=2,
        min_nodes=2,
        expected_nodes=2,
        round_timeout=3.0,
        round_attempts=2,
    )
    scenario.wait_file("struck-node-1", proc=nodes["node-1"])
    struck = nodes["node-1"].struck()
    status = scenario.wait(aggregator, 2 * 3.0 + MARGIN, since=struck, what="after node-1 froze")
    assert status == 1, aggregator.context()
    record = aggregator.record()
    assert record["error"] == "FederatedError", record
    assert "missing: node-1" in record["message"], record
    assert "node-0" not in record["message"].split("missing")[-1], record
    assert scenario.wait(nodes["node-0"], MARGIN, since=time.monotonic()) in (0, 1), nodes["node-0"].context()
    continued = time.monotonic()
    os.kill(nodes["node-1"].pid, signal.SIGCONT)
    assert scenario.wait(
        nodes["node-1"], 3.0 + HANDSHAKE_S + MARGIN, since=continued, what="once continued"
    ) in (
        0,
        1,
    ), nodes["node-1"].context()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_too_few_nodes_joining_ends_the_aggregator_and_the_nodes_that_came(scenario: Scenario) -> None:
    """`AggregatorSettings.join_timeout`: "the longest wait for those nodes before a round";
    run_aggregator raises "FederatedError: ... too few nodes joined in time". min_nodes and
    expected_nodes 3, join_timeout 4 s, two nodes come: the aggregator exits 1 within 4 s (plus
    a margin) of its start with a FederatedError, and the two nodes that joined end too
    (nothing waits for a run that failed)."""
    aggregator, _, nodes = _federation(
        scenario, {"node-0": {}, "node-1": {}}, rounds=1, min_nodes=3, expected_nodes=3, join_timeout=4.0
    )
    assert scenario.wait(aggregator, START_S + 4.0) == 1, aggregator.context()
    record = aggregator.record()
    assert record["error"] == "FederatedError", record
    failed = time.monotonic()
    for node in nodes.values():
        assert scenario.wait(node, MARGIN, since=failed, what="after the aggregator failed") in (0, 1), (
            node.context()
        )
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_strangers_connected_while_the_federated_run_ends_do_not_hold_the_aggregator(
    scenario: Scenario,
) -> None:
    """federated.md: strangers ("a connection that does not finish its handshake within
    `handshake_timeout`") are refused and "None of them changes a round"; "Every wait is
    bounded". A silent peer and a half-frame peer connect as the nodes start and stay
    connected; the one round ends: the aggregator exits 0 within a margin of its last round,
    however long the strangers stay, and the nodes end too."""
    aggregator = scenario.worker("fed-aggregator", "aggregator", rounds=1, min_nodes=2, expected_nodes=2)
    port = int(scenario.wait_file("port-aggregator", proc=aggregator).read_text())
    nodes = [scenario.worker("fed-node", name, port=port, rows=ROWS[name]) for name in ("node-0", "node-1")]
    strangers = [_stranger(port, "silent"), _stranger(port, "half")]
    try:
        scenario.wait_file("round-0-aggregator", bound=START_S + MARGIN, proc=aggregator)
        done = time.monotonic()
        assert scenario.wait(aggregator, MARGIN, since=done, what="with strangers connected") == 0, (
            aggregator.context()
        )
        for node in nodes:
            assert scenario.wait(node, MARGIN, since=done) == 0, node.context()
    finally:
        for sock in strangers:
            sock.close()
    scenario.all_ended(MARGIN)
    assert _answered(aggregator.record(), 0) == ["node-0", "node-1"], aggregator.record()


def _read_frame(sock: socket.socket, limit: float) -> bytes:
    """One frame (4-byte big-endian length, then the body) within ``limit`` s."""
    sock.settimeout(limit)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} bytes")
        data += chunk
    return data[4 : 4 + struct.unpack(">I", data[:4])[0]]


def _closed_within(
    socks: dict[str, socket.socket], since: float, limit: float
) -> dict[str, tuple[float, bytes]]:
    """For each socket: seconds from ``since`` until the server closed it (``inf`` if not within
    ``limit``), and what the server sent on it meanwhile."""
    got = dict.fromkeys(socks, b"")
    closed: dict[str, float] = {}
    for sock in socks.values():
        sock.setblocking(False)
    while len(closed) < len(socks) and time.monotonic() - since < limit:
        waiting = {sock: kind for kind, sock in socks.items() if kind not in closed}
        readable, _, _ = select.select(list(waiting), [], [], 0.1)
        for sock in readable:
            kind = waiting[sock]
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                got[kind] += chunk
            else:
                closed[kind] = time.monotonic() - since
    return {kind: (closed.get(kind, float("inf")), got[kind]) for kind in socks}


def _stranger(port: int, kind: str) -> socket.socket:
    """A peer that reads the server's challenge, then: ``silent`` says nothing; ``half`` sends a
    header announcing 200 bytes and 20 of them, then stalls; ``garbage`` sends a frame whose
    body is not JSON; ``oversized`` a header announcing 64 MiB (and 1 KiB of it). ``early``
    speaks garbage at once, before the challenge."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if kind == "early":
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        return sock
    assert b"challenge" in _read_frame(sock, 10)
    if kind == "oversized":
        sock.sendall(struct.pack(">I", 64 << 20) + b"x" * 1024)
        return sock
    if kind == "half":
        sock.sendall(struct.pack(">I", 200) + b'{"type": "hello", "pr')
    elif kind == "garbage":
        body = b"\xff\xfe not json at all \x00\x01\x02"
        sock.sendall(struct.pack(">I", len(body)) + body)
    else:
        assert kind == "silent", kind
    return sock


@pytest.mark.timeout(120)
def test_a_node_with_a_wrong_token_and_strangers_are_refused_and_the_run_goes_on(scenario: Scenario) -> None:
    """federated.md, "The security model": the aggregator refuses and logs "a wrong token,
    garbage, ... a connection that does not finish its handshake within `handshake_timeout`.
    None of them changes a round"; run_node raises "HandshakeError: the aggregator refused this
    node (wrong token)". A node started with a wrong token exits 1 with a HandshakeError; a
    silent peer and one that sends half a frame and stalls are closed within the aggregator's
    handshake_timeout (2 s) plus a margin; the right node then trains the one round, and every
    process ends, the aggregator with status 0."""
    aggregator, port, _ = _federation(scenario, {}, rounds=1, min_nodes=1, expected_nodes=1)
    since = time.monotonic()
    strangers = {kind: _stranger(port, kind) for kind in ("silent", "half", "garbage")}
    try:
        bad = scenario.worker("fed-node", "node-bad", port=port, rows=ROWS["node-1"], token=WRONG_TOKEN)
        closed = _closed_within(strangers, since, HANDSHAKE_S + MARGIN)
        for kind, (seconds, _) in closed.items():
            assert seconds <= HANDSHAKE_S + MARGIN, f"the {kind} stranger was not closed: {closed}"
    finally:
        for sock in strangers.values():
            sock.close()
    status = scenario.wait(bad, START_S, what="with a wrong token")
    assert status == 1, bad.context()
    assert bad.record()["error"] == "HandshakeError", bad.record()
    good = scenario.worker("fed-node", "node-0", port=port, rows=ROWS["node-0"])
    assert scenario.wait(aggregator, START_S + MARGIN, since=good.started) == 0, aggregator.context()
    assert scenario.wait(good, MARGIN, since=time.monotonic()) == 0, good.context()
    scenario.all_ended(MARGIN)
    record = aggregator.record()
    assert _answered(record, 0) == ["node-0"], record
    assert _missing(record, 0) == {}, record


# --------------------------------------------------------------------------------------------
# Pipeline stages (docs/pipeline.md, "Never a hang"; open_pipeline_group and train_pipeline)
# --------------------------------------------------------------------------------------------


def _pipeline(scenario: Scenario, timeout: float, **fault: Any) -> tuple[Proc, Proc]:
    port = free_port()
    stages = tuple(
        scenario.worker(
            "pipe-stage", f"stage-{rank}", rank=rank, port=port, timeout=timeout, epochs=3, **fault
        )
        for rank in (0, 1)
    )
    return stages[0], stages[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_stage_killed_inside_a_step_fails_its_neighbour_at_once(scenario: Scenario, killed: int) -> None:
    """pipeline.md: "A stage whose process dies closes its connections, and its neighbours fail at
    once with a `DistributedError` ("pipeline stage 0: epoch 3, batch 7: another stage died, or
    did not answer within the group's timeout: ..."; epochs and batches are counted from 0); the
    test SIGKILLs a stage mid-run and the other fails within 2 s while its timeout is 60 s". A
    stage SIGKILLs itself in a layer's forward, in the third step of epoch 1; the group's
    timeout is 60 s: the other stage exits 1 within 2 s (plus a margin), its error naming
    itself and the epoch."""
    stages = _pipeline(scenario, 60.0, fault="sigkill", fault_stage=killed)
    dead, survivor = stages[killed], stages[1 - killed]
    scenario.wait_file(f"struck-{dead.name}", proc=dead)
    struck = dead.struck()
    assert scenario.wait(dead, 10, since=struck) == -signal.SIGKILL
    status = scenario.wait(survivor, 2.0 + MARGIN, since=struck, what=f"after stage {killed} died")
    assert status == 1, survivor.context()
    scenario.all_ended(MARGIN)
    record = survivor.record()
    assert record["error"] == "DistributedError", record
    assert f"pipeline stage {1 - killed}: epoch 1" in record["message"], record
    assert "another stage died" in record["message"], record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", [1, 0])
def test_a_stage_frozen_inside_a_step_fails_its_neighbour_at_the_groups_timeout(
    scenario: Scenario, frozen: int
) -> None:
    """pipeline.md: "A stage that hangs (frozen, cut off) is found only by the timeout ... the
    test SIGSTOPs a stage and the other fails with Gloo's "Timed out" at the group's 5 s
    timeout". A stage (1, or 0, which also hosts the rendezvous store) SIGSTOPs itself in a
    layer's forward in epoch 1, timeout 5 s: the other exits 1 with a DistributedError naming
    itself and the epoch within 5 s (plus a margin). Continued, the frozen stage finds its
    neighbour gone and exits 1 too."""
    stages = _pipeline(scenario, 5.0, fault="sigstop", fault_stage=frozen)
    stopped, survivor = stages[frozen], stages[1 - frozen]
    scenario.wait_file(f"struck-{stopped.name}", proc=stopped)
    struck = stopped.struck()
    status = scenario.wait(survivor, 5.0 + MARGIN, since=struck, what=f"after stage {frozen} froze")
    assert status == 1, survivor.context()
    record = survivor.record()
    assert record["error"] == "DistributedError", record
    assert f"pipeline stage {1 - frozen}: epoch 1" in record["message"], record
    continued = time.monotonic()
    os.kill(stopped.pid, signal.SIGCONT)
    assert scenario.wait(stopped, 5.0 + MARGIN, since=continued, what="once continued") == 1, (
        stopped.context()
    )
    assert stopped.record()["error"] == "DistributedError", stopped.record()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing", [1, 0])
def test_a_stage_whose_forward_raises_ends_both_stages_at_once(scenario: Scenario, failing: int) -> None:
    """pipeline.md: a layer that fails on real data fails on one rank only; "Let that rank's
    process end, as an uncaught exception does: ... the other stages fail at once when it
    exits"; train_pipeline raises "BatchError: ... the stage or its loss failed on a batch". A
    layer of stage ``failing`` raises in the third step of epoch 1 (timeout 60 s): that stage
    exits 1 with a BatchError naming the stage, epoch and batch, the user's error in its chain
    of causes; the other exits 1 with a DistributedError within a margin of it, far before the
    timeout."""
    stages = _pipeline(scenario, 60.0, fault="raise", fault_stage=failing)
    broken, survivor = stages[failing], stages[1 - failing]
    scenario.wait_file(f"struck-{broken.name}", proc=broken)
    struck = broken.struck()
    assert scenario.wait(broken, MARGIN, since=struck) == 1, broken.context()
    record = broken.record()
    assert record["error"] == "BatchError", record
    assert f"pipeline stage {failing}: epoch 1, batch 2: the stage or its loss failed" in record["message"], (
        record
    )
    # The user's own error is in the chain of causes (torch's pipelining wraps it in a
    # RuntimeError of its own, which the BatchError's message quotes), on the process's stderr.
    assert (
        "InjectedFault: " + _fault("forward", f"stage {failing}", "epoch 1, batch 2") in record["traceback"]
    )
    assert "InjectedFault" in broken.output(), broken.context()
    gone = time.monotonic()
    status = scenario.wait(survivor, MARGIN, since=gone, what=f"after stage {failing} exited")
    assert status == 1, survivor.context()
    assert survivor.record()["error"] == "DistributedError", survivor.record()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_a_stage_killed_in_its_checkpoint_fails_the_other_at_once(scenario: Scenario) -> None:
    """pipeline.md: "After each epoch's checkpoints the ranks wait for each other"; "A stage whose
    process dies closes its connections, and its neighbours fail at once with a
    `DistributedError`"; train_pipeline raises "DistributedError: another stage died, or did not
    answer within the group's timeout". Stage 1 SIGKILLs itself inside its `checkpoint_state`
    of epoch 1 (timeout 60 s) while stage 0 waits for it: stage 0 exits 1 with a
    DistributedError within 2 s (plus a margin)."""
    stage0, stage1 = _pipeline(scenario, 60.0, fault="sigkill", fault_stage=1, where="checkpoint")
    scenario.wait_file("struck-stage-1", proc=stage1)
    struck = stage1.struck()
    assert scenario.wait(stage1, 10, since=struck) == -signal.SIGKILL
    assert scenario.wait(stage0, 2.0 + MARGIN, since=struck, what="after stage 1 died") == 1, stage0.context()
    scenario.all_ended(MARGIN)
    record = stage0.record()
    assert record["error"] == "DistributedError", record
    assert "pipeline stage 0" in record["message"], record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alone", [0, 1])
def test_a_stage_that_never_starts_fails_the_other_at_the_join_timeout(
    scenario: Scenario, alone: int
) -> None:
    """open_pipeline_group: "join_timeout: seconds to wait for every rank to join"; it raises
    "DistributedError: the store could not be opened or reached, or the other ranks did not join
    within `join_timeout`". Only one rank of two is started (join_timeout 3 s): it exits 1 with
    a DistributedError within 3 s (plus a margin) of its start."""
    stage = scenario.worker(
        "pipe-stage", f"stage-{alone}", rank=alone, port=free_port(), timeout=3.0, join_timeout=3.0
    )
    assert scenario.wait(stage, START_S + 3.0) == 1, stage.context()
    scenario.all_ended(MARGIN)
    record = stage.record()
    assert record["error"] == "DistributedError", record
    assert not (scenario.out / f"joined-stage-{alone}").exists()


# --------------------------------------------------------------------------------------------
# The control channel by hand (docs/control-channel.md, "Handshake"; docs/transport.md)
# --------------------------------------------------------------------------------------------


def _control_root(scenario: Scenario) -> tuple[Proc, int]:
    root = scenario.worker("control-root", "root", handshake_timeout=HANDSHAKE_S, join_timeout=40.0)
    host, port = json.loads(scenario.wait_file("address-root", proc=root).read_text())
    assert host == "127.0.0.1"
    return root, int(port)


def _refusal_of(refusals: list[str], sock_name: tuple[str, int]) -> str | None:
    peer = f"{sock_name[0]}:{sock_name[1]}"
    return next((line for line in refusals if line.startswith(peer)), None)


@pytest.mark.timeout(120)
def test_control_strangers_are_named_and_dropped_while_a_follower_joins(scenario: Scenario) -> None:
    """control-channel.md: a peer that did not prove the token ("bytes that are not a frame, ...
    a connection that sends nothing for `handshake_timeout`") "is only refused: the root logs a
    warning ..., keeps the last 16 in `root.recent_refusals` ... closes the connection and goes
    on"; "Only a peer that speaks the protocol (a well-formed hello with a wrong proof) or says
    nothing is told why with a `Refuse`; garbage gets no reply". A silent peer, a peer that
    sends half a frame and stalls and a garbage peer connect to a root (handshake_timeout
    2 s) before its follower: each is closed within 2 s (plus a margin), the garbage one with no
    reply, the silent one after a Refuse; each is named ("host:port: why") in
    `recent_refusals`; the follower joins meanwhile and the run ends, every process with 0."""
    root, port = _control_root(scenario)
    since = time.monotonic()
    strangers = {kind: _stranger(port, kind) for kind in ("silent", "half", "garbage", "oversized", "early")}
    names = {kind: sock.getsockname() for kind, sock in strangers.items()}
    try:
        follower = scenario.worker("control-follower", "follower", port=port)
        closed = _closed_within(strangers, since, HANDSHAKE_S + MARGIN)
    finally:
        for sock in strangers.values():
            sock.close()
    for kind, (seconds, _) in closed.items():
        assert seconds <= HANDSHAKE_S + MARGIN, f"the {kind} stranger was not closed: {closed}"
    assert closed["garbage"][1] == b"", closed
    assert closed["oversized"][1] == b"", closed
    assert b"refuse" in closed["silent"][1].lower(), closed
    scenario.wait_file("joined-follower", proc=follower)
    (scenario.out / "finish").write_text("1")
    finish = time.monotonic()
    assert scenario.wait(root, MARGIN, since=finish) == 0, root.context()
    assert scenario.wait(follower, MARGIN, since=finish) == 0, follower.context()
    scenario.all_ended(MARGIN)
    result = root.record()["result"]
    assert result["peers"] == [1], result
    for kind, name in names.items():
        assert _refusal_of(result["refusals"], name) is not None, (kind, name, result["refusals"])
    assert follower.record()["result"]["seen"] == ["Rendezvous", "Train", "Valid", "Stop"], follower.record()


@pytest.mark.timeout(120)
def test_a_follower_with_a_wrong_token_fails_and_the_root_serves_the_right_one(scenario: Scenario) -> None:
    """control-channel.md: a wrong proof is "refused" with a `Refuse(reason)` ("the proof of the
    shared token did not match (wrong token?)", transport.md), logged and remembered in
    `recent_refusals`; the root "goes on"; the follower raises `HandshakeError`. A follower
    with a wrong token exits 1 with a HandshakeError within its handshake (plus a margin); the
    root names it in `recent_refusals` and then serves the right follower to the end."""
    root, port = _control_root(scenario)
    bad = scenario.worker("control-follower", "follower-bad", port=port, token=WRONG_TOKEN)
    assert scenario.wait(bad, START_S, what="with a wrong token") == 1, bad.context()
    record = bad.record()
    assert record["error"] == "HandshakeError", record
    assert "token" in record["message"], record
    assert root.poll() is None, root.context()
    good = scenario.worker("control-follower", "follower", port=port)
    scenario.wait_file("joined-follower", proc=good)
    (scenario.out / "finish").write_text("1")
    finish = time.monotonic()
    assert scenario.wait(root, MARGIN, since=finish) == 0, root.context()
    assert scenario.wait(good, MARGIN, since=finish) == 0, good.context()
    scenario.all_ended(MARGIN)
    refusals = root.record()["result"]["refusals"]
    assert any("token" in line for line in refusals), refusals


@pytest.mark.timeout(120)
def test_control_strangers_during_the_run_do_not_hold_the_root(scenario: Scenario) -> None:
    """control-channel.md: strangers "cannot crash or stall the root, nor disturb the joined
    peers"; `handshake_timeout` bounds the handshake once connected. After the follower joined,
    a silent peer and a half-frame peer connect and stay; the root is told to finish at once:
    it sends `Stop`, leaves its block and exits 0 within its handshake_timeout (plus a margin),
    however long the strangers stay connected; the follower sees the whole run."""
    root, port = _control_root(scenario)
    follower = scenario.worker("control-follower", "follower", port=port)
    scenario.wait_file("joined-follower", proc=follower)
    strangers = [_stranger(port, "silent"), _stranger(port, "half")]
    try:
        (scenario.out / "finish").write_text("1")
        finish = time.monotonic()
        assert (
            scenario.wait(root, HANDSHAKE_S + MARGIN, since=finish, what="with strangers connected") == 0
        ), root.context()
        assert scenario.wait(follower, MARGIN, since=finish) == 0, follower.context()
    finally:
        for sock in strangers:
            sock.close()
    scenario.all_ended(MARGIN)
    assert follower.record()["result"]["seen"] == ["Rendezvous", "Train", "Valid", "Stop"], follower.record()


@pytest.mark.timeout(120)
def test_a_root_whose_follower_never_proves_the_token_fails_at_the_join_timeout_quoting_it(
    scenario: Scenario,
) -> None:
    """control-channel.md: "`join_timeout` (root) ... `on_rendezvous_ready` waits this long for
    every follower, then raises `HandshakeError` naming the missing ranks"; refused strangers are
    kept in `recent_refusals` and "the join-timeout error quotes them, which is what you need
    when a rank was started with the wrong token". Rank 1 is started with a wrong token only;
    join_timeout 3 s: the root exits 1 within 3 s (plus a margin) with a HandshakeError naming
    rank 1 and quoting the refusal; the follower exits 1 with a HandshakeError."""
    root = scenario.worker("control-root", "root", handshake_timeout=HANDSHAKE_S, join_timeout=3.0)
    port = int(json.loads(scenario.wait_file("address-root", proc=root).read_text())[1])
    listening = time.monotonic()
    bad = scenario.worker("control-follower", "follower-bad", port=port, token=WRONG_TOKEN)
    assert scenario.wait(root, 3.0 + MARGIN, since=listening, what="past its join_timeout") == 1, (
        root.context()
    )
    assert scenario.wait(bad, MARGIN, since=time.monotonic()) == 1, bad.context()
    scenario.all_ended(MARGIN)
    record = root.record()
    assert record["error"] == "HandshakeError", record
    assert "rank 1" in record["message"] or "ranks [1]" in record["message"] or "[1]" in record["message"], (
        record
    )
    assert "token" in record["message"], record
    assert bad.record()["error"] == "HandshakeError", bad.record()


@pytest.mark.timeout(120)
def test_more_silent_strangers_than_pending_handshakes_do_not_keep_the_follower_out(
    scenario: Scenario,
) -> None:
    """control-channel.md: "at most `max_pending_handshakes` (64) at once; one more drops the
    *oldest*, so 300 silent connections cannot keep a real follower, which answers the
    challenge at once, from joining (it joins in well under a second ...)". 100 silent
    connections are open when the follower starts: it joins within a margin, the run ends,
    every process with status 0."""
    root, port = _control_root(scenario)
    strangers = []
    try:
        for _ in range(100):
            strangers.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        follower = scenario.worker("control-follower", "follower", port=port)
        scenario.wait_file("joined-follower", bound=MARGIN + START_S, proc=follower)
        (scenario.out / "finish").write_text("1")
        finish = time.monotonic()
        assert scenario.wait(root, HANDSHAKE_S + MARGIN, since=finish) == 0, root.context()
        assert scenario.wait(follower, MARGIN, since=finish) == 0, follower.context()
    finally:
        for sock in strangers:
            sock.close()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_a_federated_node_at_a_control_root_gives_up_and_the_root_serves_on(scenario: Scenario) -> None:
    """transport.md: the three protocols share the handshake; a peer that does not prove the
    token in the server's protocol is a stranger, refused while the server "goes on"; run_node
    raises HandshakeError or FederatedError within its connect and handshake timeouts. A
    federated node is pointed at a control root (handshake_timeout 2 s, connect_timeout 3 s):
    it exits 1 within those (plus a margin), naming the address; the root then serves its real
    follower to the end."""
    root, port = _control_root(scenario)
    node = scenario.worker("fed-node", "node-lost", port=port, rows=ROWS["node-1"], **WRONG_PLACE)
    assert scenario.wait(node, START_S + 3.0 + 2.0) == 1, node.context()
    record = node.record()
    assert record["error"] in ("FederatedError", "HandshakeError"), record
    assert str(port) in record["message"], record
    assert root.poll() is None, root.context()
    follower = scenario.worker("control-follower", "follower", port=port)
    scenario.wait_file("joined-follower", proc=follower)
    (scenario.out / "finish").write_text("1")
    finish = time.monotonic()
    for proc in (root, follower):
        assert scenario.wait(proc, MARGIN, since=finish) == 0, proc.context()
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
def test_a_control_follower_at_an_aggregator_gives_up_naming_it(scenario: Scenario) -> None:
    """control-channel.md: "transport errors ... are wrapped with what happened and which peer";
    a follower's `connect_timeout` and `handshake_timeout` bound its tries. A control follower
    is pointed at a federated aggregator (handshake_timeout 2 s, connect_timeout 3 s): it exits 1
    with a TransportError naming the aggregator's address within those (plus a margin); the
    aggregator then serves its real node to the end."""
    aggregator = scenario.worker("fed-aggregator", "aggregator", rounds=1, min_nodes=1, expected_nodes=1)
    port = int(scenario.wait_file("port-aggregator", proc=aggregator).read_text())
    follower = scenario.worker("control-follower", "follower-lost", port=port, **WRONG_PLACE)
    assert scenario.wait(follower, START_S + 3.0 + 2.0) == 1, follower.context()
    assert aggregator.poll() is None, aggregator.context()
    node = scenario.worker("fed-node", "node-0", port=port, rows=ROWS["node-0"])
    for proc in (aggregator, node):
        assert scenario.wait(proc, START_S + MARGIN, since=node.started) == 0, proc.context()
    scenario.all_ended(MARGIN)
    assert _answered(aggregator.record(), 0) == ["node-0"], aggregator.record()
    record = follower.record()
    assert "TransportError" in record["classes"], record
    assert str(port) in record["message"], record


class FakeServer:
    """A TCP listener on 127.0.0.1 that accepts and then says nothing (``silent``) or sends half
    a frame, a header announcing 200 bytes and 10 of them (``half``), and holds the connections."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted.append(conn)
            if self.kind == "half":
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack(">I", 200) + b'{"type": "c')

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["silent", "half"])
def test_a_follower_at_a_root_that_never_finishes_the_challenge_gives_up(
    scenario: Scenario, kind: str
) -> None:
    """control-channel.md: `handshake_timeout` (follower 10 s) is the "bound on the handshake
    once connected", `connect_timeout` the time "to keep trying"; errors are `TransportError`s
    naming the peer. A follower (handshake_timeout 2 s, connect_timeout 3 s) reaches a listener
    that accepts and says nothing, or sends half a challenge and stalls: the follower exits 1
    with a TransportError naming that address within 3 + 2 s (plus a margin)."""
    server = FakeServer(kind)
    try:
        follower = scenario.worker(
            "control-follower", "follower", port=server.port, connect_timeout=3.0, handshake_timeout=2.0
        )
        assert scenario.wait(follower, START_S + 3.0 + 2.0) == 1, follower.context()
        assert server.accepted, "the follower never connected"
    finally:
        server.close()
    record = follower.record()
    assert "TransportError" in record["classes"], record
    assert str(server.port) in record["message"], record
    scenario.all_ended(MARGIN)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["silent", "half"])
def test_a_node_at_an_aggregator_that_never_finishes_the_challenge_gives_up(
    scenario: Scenario, kind: str
) -> None:
    """`NodeSettings`: `handshake_timeout`: "the TLS and token handshake must finish within
    this"; `connect_timeout`: "keep trying to reach the aggregator this long ... before giving
    up"; run_node raises FederatedError ("could not be reached for `connect_timeout` seconds")
    or HandshakeError ("did not prove the token"). A node (handshake_timeout 2 s,
    connect_timeout 3 s) reaches a listener that accepts and says nothing, or sends half a
    challenge and stalls: it exits 1 with one of those, naming the address, within 3 + 2 s
    (plus a margin)."""
    server = FakeServer(kind)
    try:
        node = scenario.worker(
            "fed-node",
            "node-0",
            port=server.port,
            rows=ROWS["node-0"],
            connect_timeout=3.0,
            handshake_timeout=2.0,
        )
        assert scenario.wait(node, START_S + 3.0 + 2.0) == 1, node.context()
        assert server.accepted, "the node never connected"
    finally:
        server.close()
    record = node.record()
    assert record["error"] in ("FederatedError", "HandshakeError"), record
    assert str(server.port) in record["message"], record
    scenario.all_ended(MARGIN)


# --------------------------------------------------------------------------------------------
# The lamploop command (docs/cli.md; docs/reliability.md, "Stopping on request")
# --------------------------------------------------------------------------------------------

STOPPED_LINE = re.compile(r"^lamploop: stopped (by|at once by a second) (SIGTERM|SIGINT)\b.*$", re.MULTILINE)


def _demo(scenario: Scenario) -> Proc:
    """`lamploop demo` on 2 ranks (its default), long enough to be stopped in an epoch of its
    training: once it printed the line of epoch 1."""
    demo = scenario.command("demo", "demo", "--out", "run", "--epochs", "1000")
    scenario.wait_for(
        lambda: "\nepoch 1:" in demo.output() or demo.poll() is not None, 60, "the demo's epoch 1 line"
    )
    assert demo.poll() is None, demo.context()
    return demo


def _follower_of(demo: Proc) -> int:
    """The pid of the demo's rank 1 (a child of the command: fit(world_size=2) starts it)."""
    children = [
        pid for pid in _session(demo.pid) if pid != demo.pid and int((_stat(pid) or ["", "0"])[1]) == demo.pid
    ]
    assert len(children) == 1, (children, demo.context())
    return children[0]


def _stderr_lines(demo: Proc) -> list[str]:
    return [line for line in demo.output().splitlines() if line.startswith("lamploop:")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("sig", "times", "status"),
    [
        (signal.SIGTERM, 1, 143),
        (signal.SIGTERM, 2, 143),
        (signal.SIGINT, 2, 130),
    ],
    ids=["sigterm-once", "sigterm-twice", "sigint-twice"],
)
def test_the_demo_stops_on_signals_and_every_rank_ends(
    scenario: Scenario, sig: signal.Signals, times: int, status: int
) -> None:
    """cli.md: "Ctrl-C (SIGINT) or SIGTERM stops every rank after the step in progress, writes a
    checkpoint there and says one line"; exit statuses 130 (SIGINT) and 143 (SIGTERM);
    reliability.md: "after a signal, one line, no traceback"; "A second signal stops at once";
    "a second signal kills them [the followers] at once". SIGTERM goes to the command alone (a
    scheduler's), once or twice 0.1 s apart; SIGINT to its process group (a terminal's Ctrl-C)
    twice (once: tests/test_acceptance_docs_cli.py): the command exits with its status within
    a margin, with one `lamploop: stopped ...` line and no traceback, and its rank 1 ends too."""
    demo = _demo(scenario)
    rank1 = _follower_of(demo)
    sent = time.monotonic()
    for _ in range(times):
        if sig == signal.SIGINT:
            os.killpg(demo.pid, sig)
        else:
            os.kill(demo.pid, sig)
        time.sleep(0.1)
    assert scenario.wait(demo, MARGIN, since=sent, what=f"after {times} {sig.name}") == status, demo.context()
    scenario.wait_for(lambda: not _alive(rank1), MARGIN, "rank 1 ended")
    scenario.all_ended(MARGIN)
    output = demo.output()
    assert "Traceback" not in output, demo.context()
    assert len(_stderr_lines(demo)) == 1, demo.context()
    assert STOPPED_LINE.search(output), demo.context()
    assert sig.name in _stderr_lines(demo)[0], demo.context()


@pytest.mark.timeout(150)
def test_the_demos_rank_1_killed_ends_the_command_naming_rank_1(scenario: Scenario) -> None:
    """cli.md: exit status "1 | training failed ...; one line on stderr says why"; reliability.md:
    SIGKILL of a follower: `PeerLostError(rank=that follower, how="closed" or "died")` in
    0.0-0.1 s, and "A failed run's process exits with status 1 at once". The demo's rank 1 is
    SIGKILLed mid-epoch: the command exits 1 within a margin, with one line naming rank 1 and
    no traceback."""
    demo = _demo(scenario)
    rank1 = _follower_of(demo)
    killed = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    assert scenario.wait(demo, MARGIN, since=killed, what="after its rank 1 was killed") == 1, demo.context()
    scenario.all_ended(MARGIN)
    lines = _stderr_lines(demo)
    assert len(lines) == 1, demo.context()
    assert "rank 1" in lines[0], demo.context()
    assert "Traceback" not in demo.output(), demo.context()


@pytest.mark.timeout(150)
def test_the_demos_rank_1_frozen_ends_the_command_naming_rank_1(scenario: Scenario) -> None:
    """reliability.md: "a rank that **freezes** (SIGSTOP ...) stops sending heartbeats: the others
    notice after the heartbeat timeout (4 s by default) ..., and every survivor's run ends
    within 5 s of the fault"; "`benchmarks/stress_liveness.py` does so; the test asserts the
    exit within 10 s of the fault" (the survivors "exited 0.6-0.9 s after their error" with
    `gc.freeze()`, which "the `lamploop` command calls ... as it ends"); cli.md: status 1, one
    line on stderr says why; distributed.md: `fit(world_size=n)` "supervises them: ... leaving
    kills them". The demo's rank 1 is SIGSTOPped mid-epoch: the command exits 1 within 10 s,
    its line naming rank 1, and the stopped rank 1 is killed as it leaves."""
    demo = _demo(scenario)
    rank1 = _follower_of(demo)
    frozen = time.monotonic()
    os.kill(rank1, signal.SIGSTOP)
    assert scenario.wait(demo, 10.0, since=frozen, what="after its rank 1 froze") == 1, demo.context()
    scenario.wait_for(lambda: not _alive(rank1), 5.0, "the stopped rank 1 killed")
    scenario.all_ended(MARGIN)
    lines = _stderr_lines(demo)
    assert len(lines) == 1, demo.context()
    assert "rank 1" in lines[0], demo.context()
    assert "Traceback" not in demo.output(), demo.context()


@pytest.mark.timeout(150)
def test_a_sigterm_to_the_demos_rank_1_alone_stops_every_rank(scenario: Scenario) -> None:
    """reliability.md: "`fit` (and so `lamploop demo`) handles SIGTERM and SIGINT on the main
    thread of any rank: every rank stops after the step in progress ..., the root writes a
    checkpoint at that step boundary ...; the command prints one line and exits with 143";
    control-channel.md: "A stop request on one rank (SIGTERM or SIGINT to it ...) must reach
    every rank". SIGTERM to the demo's rank 1 alone: the command exits 143 within a margin, one
    `lamploop: stopped by SIGTERM` line, no traceback, and rank 1 ends too."""
    demo = _demo(scenario)
    rank1 = _follower_of(demo)
    sent = time.monotonic()
    os.kill(rank1, signal.SIGTERM)
    assert scenario.wait(demo, MARGIN, since=sent, what="after a SIGTERM to its rank 1") == 143, (
        demo.context()
    )
    scenario.all_ended(MARGIN)
    lines = _stderr_lines(demo)
    assert len(lines) == 1, demo.context()
    assert lines[0].startswith("lamploop: stopped by SIGTERM"), demo.context()
    assert "Traceback" not in demo.output(), demo.context()


@pytest.mark.timeout(150)
def test_a_sigterm_to_the_demo_while_its_rank_1_is_frozen_ends_everything(scenario: Scenario) -> None:
    """reliability.md: a frozen rank is noticed "after the heartbeat timeout (4 s by default)",
    "every survivor's run ends within 5 s of the fault" (the test there asserts the exit within
    10 s); "A second signal stops at once". The demo's rank 1 is SIGSTOPped, then the command
    gets a SIGTERM (its graceful stop needs a step boundary that rank 1 will never reach): the
    command still exits non-zero within 10 s of the freeze, with one `lamploop:` line and no
    traceback, and the stopped rank 1 is killed."""
    demo = _demo(scenario)
    rank1 = _follower_of(demo)
    frozen = time.monotonic()
    os.kill(rank1, signal.SIGSTOP)
    time.sleep(0.2)
    os.kill(demo.pid, signal.SIGTERM)
    status = scenario.wait(demo, 10.0, since=frozen, what="after its rank 1 froze and it got a SIGTERM")
    assert status in (1, 143), demo.context()
    scenario.wait_for(lambda: not _alive(rank1), 5.0, "the stopped rank 1 killed")
    scenario.all_ended(MARGIN)
    assert len(_stderr_lines(demo)) == 1, demo.context()
    assert "Traceback" not in demo.output(), demo.context()


@pytest.mark.timeout(150)
def test_the_demo_killed_leaves_no_rank_behind(scenario: Scenario) -> None:
    """reliability.md's table: SIGKILL of the root gives `PeerLostError(rank=0)` on every follower
    in 0.0-0.1 s, "the follower's process then exits" (round 1: within 10 s). The `lamploop demo`
    command itself is SIGKILLed mid-epoch: its rank 1 exits within 10 s, its line naming the
    root (rank 0)."""
    demo = _demo(scenario)
    rank1 = _follower_of(demo)
    killed = time.monotonic()
    os.kill(demo.pid, signal.SIGKILL)
    assert scenario.wait(demo, 5, since=killed) == -signal.SIGKILL
    scenario.wait_for(lambda: not _alive(rank1), 10.0, "rank 1 ended after its root was killed")
    scenario.all_ended(MARGIN)
    lines = _stderr_lines(demo)  # rank 1 writes into the same log
    assert len(lines) == 1, demo.context()
    assert "rank 0" in lines[0] or "the root" in lines[0], demo.context()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("sig", "status"),
    [
        pytest.param(signal.SIGTERM, 143, id="sigterm"),
        pytest.param(signal.SIGINT, 130, id="sigint"),
    ],
)
def test_a_signal_while_the_demos_rank_1_starts_ends_everything(
    scenario: Scenario, sig: signal.Signals, status: int
) -> None:
    """reliability.md, "before training starts": "`fit` handles SIGTERM and SIGINT from its first
    line ... `TrainingInterrupted` (`stopped by SIGTERM before training started ...`; 143 / 130
    through the CLI), nothing written"; "after a signal, one line, no traceback". The signal
    comes as soon as the demo's rank 1 process exists (it is still starting: importing, joining):
    SIGTERM to the command alone, or SIGINT to its process group (Ctrl-C, which rank 1 gets
    too). The command exits with 143 / 130 within a margin, one `lamploop: stopped by` line, no
    traceback, and rank 1 ends too."""
    demo = scenario.command("demo", "demo", "--out", "run", "--epochs", "1000")
    found: list[int] = []

    def rank1_started() -> bool:
        children = [pid for pid in _session(demo.pid) if int((_stat(pid) or ["", "0"])[1]) == demo.pid]
        found[:] = children
        return bool(children) or demo.poll() is not None

    scenario.wait_for(rank1_started, 60, "the demo's rank 1 process")
    assert demo.poll() is None, demo.context()
    assert len(found) == 1, (found, demo.context())
    time.sleep(0.5)
    sent = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(demo.pid, sig)
    else:
        os.kill(demo.pid, sig)
    # SIGTERM to the command alone: the root stops every rank after the same step, so it waits
    # for rank 1, still importing torch, to join and take a step: 5.1-5.8 s after the signal on
    # a quiet machine (before and after 2026-11-29's changes alike), over 15 s once in CI run 24
    # (the soak phase, 3 workers on 2 cores). Twice the margin still tells it from the 60 s
    # join timeout a lost follower would take.
    bound = 2 * MARGIN if sig == signal.SIGTERM else MARGIN
    assert scenario.wait(demo, bound, since=sent, what=f"after a {sig.name} at its start") == status, (
        demo.context()
    )
    scenario.wait_for(lambda: not _alive(found[0]), MARGIN, "rank 1 ended")
    scenario.all_ended(MARGIN)
    lines = _stderr_lines(demo)
    assert len(lines) == 1, demo.context()
    assert lines[0].startswith(f"lamploop: stopped by {sig.name}"), demo.context()
    # A Ctrl-C that reaches rank 1 before it handles signals (Python still imports torch) ends
    # it with Python's own traceback (a KeyboardInterrupt, or the import it cut in half:
    # reliability.md says so), and the command's one line says so; none of lamploop's.
    tracebacks = demo.output().count("Traceback (most recent call last)")
    assert tracebacks <= (1 if sig == signal.SIGINT else 0), demo.context()
    if tracebacks:
        assert "rank 1 exited with" in lines[0], demo.context()
        assert "before it joined, as the stop came" in lines[0], demo.context()
    assert "lamploop: PeerLostError" not in demo.output(), demo.context()
