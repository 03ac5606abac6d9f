"""Acceptance: a run that ends, normally or by failure, leaves nothing behind in its process.

"Nothing is lost, nothing hangs": structured concurrency everywhere. Measured for real, from
the docs' own recipes: tests/workers/leaks_worker.py runs each scenario of a group twice in a
fresh ``python -X dev -W error::ResourceWarning`` process (a warm-up for torch's and gloo's
own pools, then the measured run) and records, before and after the measured run, the
process's file descriptors (``/proc/self/fd``), Python threads, native threads
(``/proc/self/task``), child processes (``/proc/*/stat`` ppid), listening TCP ports
(``/proc/net/tcp*`` by socket inode), its SIGTERM/SIGINT handlers, the temporary files of its
checkpoint directory, and whether a port it served can be listened on again at once. Each
test here reads one scenario and asserts that every count is back where it was and that the
scenario's part of stderr holds no ResourceWarning, "Task was destroyed but it is pending",
"Exception ignored" or "never awaited". ``lamploop demo`` runs as the ``lamploop`` command,
with ``PYTHONDEVMODE=1``; every process it starts carries a tag in its environment, by which
the test finds any that outlives it.

The groups run at most two at a time (the machine has two cores); a group is started only
when a selected test needs it. Slow ones (``soak``): the 2-rank ``fit`` group (three 2-rank
runs, each starting a rank), the checkpoint group (a SIGKILLed run first) and the two demo runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, WORKERS

WORKER = WORKERS / "leaks_worker.py"
GROUP_TIMEOUT_S = 150.0
"""The most a group's process may run (each of its waits is bounded far below this)."""

WARNINGS_ON_STDERR = re.compile(
    r"ResourceWarning|unclosed|Task was destroyed but it is pending|Exception ignored"
    r"|was never awaited|Task exception was never retrieved"
)
TEMPORARY_MARKS = (".lamploop-tmp", ".tmp", ".part", "tmp-", "~")

FIT_SCENARIOS = [
    "fit_normal",
    "fit_no_checkpoints",
    "fit_batch_stream_fails",
    "fit_early_stopping",
    "fit_sigterm",
    "fit_reporter_logging",
    "fit_reporter_csv",
    "fit_reporter_jsonl",
    "fit_reporter_progress",
    "fit_reporter_progress_live",
    "fit_reporter_prometheus",
    "fit_reporters_batch_stream_fails",
    "fit_reporters_sigterm",
]
"""One rank; the reporters the docs list that need no network (the CSV reporter is
``MetricsFileReporter`` with a ``.csv`` path: there is no ``CsvReporter``)."""

EXPECTED_OUTCOME = {
    "fit_batch_stream_fails": r"RuntimeError: leaks: the batch stream failed",
    "fit_reporters_batch_stream_fails": r"RuntimeError: leaks: the batch stream failed",
    "fit_sigterm": r"TrainingInterrupted: stopped by SIGTERM",
    "fit_reporters_sigterm": r"TrainingInterrupted: stopped by SIGTERM",
    "control_follower_fails": r"ExceptionGroup",
    "world2_rank1_fails": r"PeerLostError: rank 1 .*leaks: the batch stream failed",
    "world2_rank0_fails": r"RuntimeError: leaks: the batch stream failed",
    "checkpoint_state_dict_fails": r"RuntimeError: leaks: state_dict failed mid-save",
}
"""How a scenario that ends by a failure ends; every other scenario returns."""

NET_SCENARIOS = [
    "control_normal",
    "control_follower_fails",
    *(
        f"stream_{kind}_{how}{suffix}"
        for suffix in ("", "_own_thread")
        for kind in ("async", "blocking")
        for how in ("normal", "producer_gone", "receiver_gone")
    ),
    "federated_normal",
    "federated_node_gone",
]


# --------------------------------------------------------------------------- the group processes


class Groups:
    """The worker processes of the groups the selected tests need, at most two at a time."""

    def __init__(self, base: Path, needed: list[str]) -> None:
        self.base = base
        self.needed = needed
        self.running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
        self.done: dict[str, tuple[dict[str, Any], str]] = {}

    def result(self, group: str) -> tuple[dict[str, Any], str]:
        if group not in self.needed:
            self.needed.append(group)
        while group not in self.done:
            if group not in self.running:
                self._free_a_slot()
                self._start(group)
            self._fill()
            self._reap(block_on=group)
        return self.done[group]

    def close(self) -> None:
        for process, _ in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        self.running.clear()

    def _free_a_slot(self) -> None:
        while len(self.running) >= 2:
            self._reap(block_on=next(iter(self.running)))

    def _fill(self) -> None:
        for group in self.needed:
            if len(self.running) >= 2:
                return
            if group not in self.running and group not in self.done:
                self._start(group)

    def _start(self, group: str) -> None:
        out = self.base / group
        out.mkdir(parents=True, exist_ok=True)
        extra: list[str] = []
        if group == "checkpoints":
            extra = [str(killed_run(self.base / "victim"))]
        command = [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", str(WORKER), group, str(out)]
        stderr = (out / "stderr.txt").open("wb")
        with stderr:
            process = subprocess.Popen(
                [*command, *extra],
                cwd=ROOT,
                env=environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # its ranks with it: killpg ends them all
            )
        self.running[group] = (process, time.monotonic())

    def _reap(self, *, block_on: str) -> None:
        process, started = self.running[block_on]
        try:
            process.wait(max(1.0, GROUP_TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        del self.running[block_on]
        out = self.base / block_on
        record_path = out / f"{block_on}.json"
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        stderr = (out / "stderr.txt").read_text(errors="replace")
        record["__returncode__"] = process.returncode
        self.done[block_on] = (record, stderr)
        # a group's process must take its own ranks with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def environment(**more: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **more)
    env.pop("LAMPLOOP_RANK", None)
    return env


def killed_run(directory: Path) -> Path:
    """A checkpoint directory whose run was SIGKILLed while it trained and checkpointed every step."""
    checkpoints = directory / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    victim = subprocess.Popen(
        [sys.executable, str(WORKER), "victim", str(checkpoints)],
        cwd=ROOT,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (
            len(list(checkpoints.glob("epoch-*"))) < 2
            and time.monotonic() < deadline
            and victim.poll() is None
        ):
            time.sleep(0.05)
        time.sleep(0.37)  # somewhere in a step or a save
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
    return checkpoints


@pytest.fixture(scope="module")
def groups(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    wanted = {
        "fit_group": "fit",
        "net_group": "net",
        "world2_group": "world2",
        "checkpoint_group": "checkpoints",
    }
    needed: list[str] = []
    for item in request.session.items:
        for fixture, group in wanted.items():
            if fixture in getattr(item, "fixturenames", ()) and group not in needed:
                needed.append(group)
    running = Groups(tmp_path_factory.mktemp("leaks"), needed)
    yield running
    running.close()


@pytest.fixture
def fit_group(groups: Groups) -> tuple[dict[str, Any], str]:
    return groups.result("fit")


@pytest.fixture
def net_group(groups: Groups) -> tuple[dict[str, Any], str]:
    return groups.result("net")


@pytest.fixture
def world2_group(groups: Groups) -> tuple[dict[str, Any], str]:
    return groups.result("world2")


@pytest.fixture
def checkpoint_group(groups: Groups) -> tuple[dict[str, Any], str]:
    return groups.result("checkpoints")


# --------------------------------------------------------------------------- the checks


def stderr_of(stderr: str, scenario: str) -> str:
    match = re.search(
        rf"^@@@ begin {re.escape(scenario)} .*?$(.*?)^@@@ end {re.escape(scenario)} ", stderr, re.S | re.M
    )
    assert match is not None, (
        f"{scenario}: its part of stderr is missing (the worker died?):\n{stderr[-3000:]}"
    )
    return match.group(1)


def leftovers(result: dict[str, Any]) -> dict[str, Any]:
    """What the measured run left that was not there before it: empty when it left nothing."""
    before, after = result["before"], result["after"]
    found: dict[str, Any] = {}
    fds = sorted(set(after["fds"].items()) - set(before["fds"].items()))
    if fds:
        found["fds"] = fds
    threads = sorted(set(after["threads"]) - set(before["threads"]))
    if threads or len(after["threads"]) > len(before["threads"]):
        found["threads"] = threads
    if after["native_threads"] > before["native_threads"]:
        names = list(after["native_thread_names"])
        for name in before["native_thread_names"]:
            with contextlib.suppress(ValueError):
                names.remove(name)
        found["native_threads"] = f"{before['native_threads']} -> {after['native_threads']}: {names}"
    children = sorted(set(after["children"]) - set(before["children"]))
    if children:
        found["children"] = children
    ports = sorted(set(after["listening"]) - set(before["listening"]))
    if ports:
        found["listening_ports"] = ports
    for handler in ("sigterm", "sigint"):
        if after[handler] != before[handler]:
            found[f"{handler}_handler"] = f"{before[handler]} -> {after[handler]}"
    if result.get("temporaries"):
        found["temporaries"] = result["temporaries"]
    if result.get("port_bindable") is False or result.get("prometheus_port_bindable") is False:
        found["port_not_bindable"] = result.get("port") or result.get("prometheus_port")
    return found


def assert_left_nothing(group: tuple[dict[str, Any], str], scenario: str) -> dict[str, Any]:
    record, stderr = group
    assert scenario in record, (
        f"{scenario}: not recorded (worker exit status {record.get('__returncode__')}):\n{stderr[-3000:]}"
    )
    result = record[scenario]
    assert "worker_error" not in result, result["worker_error"]
    expected = EXPECTED_OUTCOME.get(scenario, "returned")
    assert re.match(expected, result["outcome"]), f"{scenario} ended {result['outcome']!r}, not {expected!r}"
    found = leftovers(result)
    assert not found, f"{scenario} left behind: {json.dumps(found, indent=1)}"
    warnings = [line for line in stderr_of(stderr, scenario).splitlines() if WARNINGS_ON_STDERR.search(line)]
    assert not warnings, f"{scenario} printed on stderr:\n" + "\n".join(warnings[:20])
    return result


# --------------------------------------------------------------------------- fit, one rank


@pytest.mark.parametrize("scenario", FIT_SCENARIOS)
def test_fit_on_one_rank_leaves_nothing(fit_group: tuple[dict[str, Any], str], scenario: str) -> None:
    result = assert_left_nothing(fit_group, scenario)
    if scenario == "fit_early_stopping":
        assert result["epoch"] < 20, "early stopping never stopped: the scenario tested nothing"
    if "prometheus" in scenario or scenario.startswith("fit_reporters_"):
        assert result["prometheus_port"], "the Prometheus reporter never served"
        assert result["prometheus_port_bindable"] is True


# --------------------------------------------------------------------------- fit(world_size=2)


@pytest.mark.soak
@pytest.mark.parametrize(
    "scenario",
    [
        "world2_normal",
        "world2_rank1_fails",
        "world2_rank0_fails",
    ],
)
def test_fit_on_two_ranks_leaves_nothing(world2_group: tuple[dict[str, Any], str], scenario: str) -> None:
    assert_left_nothing(world2_group, scenario)


# --------------------------------------------------------------------------- control, streaming, federated


@pytest.mark.parametrize("scenario", NET_SCENARIOS)
def test_network_pieces_leave_nothing(net_group: tuple[dict[str, Any], str], scenario: str) -> None:
    result = assert_left_nothing(net_group, scenario)
    assert result["port"], f"{scenario}: never listened"
    assert result["port_bindable"] is True, f"{scenario}: port {result['port']} cannot be listened on again"
    if scenario.startswith("stream_"):
        producer = result["producer"]
        if "receiver_gone" in scenario:  # the producer must fail, within its reconnect_timeout
            assert producer.startswith("StreamingError"), producer
        elif "producer_gone" in scenario:
            assert producer.startswith("RuntimeError: leaks"), producer
            assert result["received"] > 0, "the producer died before it sent anything: not mid-stream"
        else:
            assert producer == "returned", result
            assert result["received"] == 200, result
    if scenario.startswith("federated_"):
        assert result["aggregator"] == "returned 3 rounds", result


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.soak
@pytest.mark.parametrize(
    "scenario", ["checkpoint_keep_last", "checkpoint_state_dict_fails", "checkpoint_resume_after_sigkill"]
)
def test_checkpoints_leave_nothing(checkpoint_group: tuple[dict[str, Any], str], scenario: str) -> None:
    result = assert_left_nothing(checkpoint_group, scenario)
    if scenario == "checkpoint_keep_last":
        assert result["kept"] == [
            "checkpointer/epoch-000004",
            "checkpointer/epoch-000005",
            "direct/epoch-000004",
            "direct/epoch-000005",
        ]
    if scenario == "checkpoint_resume_after_sigkill":
        assert result["epoch"] is not None
        assert result["epoch"] >= 2


# --------------------------------------------------------------------------- lamploop demo


def tagged_processes(tag: str) -> list[str]:
    """The processes alive whose environment carries ``tag``."""
    needle = f"LEAKS_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes():
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{entry}: {cmdline!r}")
        except OSError:
            continue
    return found


def temporaries(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if any(mark in path.name for mark in TEMPORARY_MARKS)
    )


def run_demo(tmp_path: Path, *, interrupt: bool) -> tuple[int, str, str, Path]:
    tag = uuid.uuid4().hex
    out = tmp_path / "demo"
    command = [str(Path(sys.executable).with_name("lamploop")), "demo", "--out", str(out)]
    command += ["--epochs", "40" if interrupt else "1", "--world-size", "2"]
    env = environment(LEAKS_TAG=tag, PYTHONDEVMODE="1", PYTHONWARNINGS="error::ResourceWarning")
    with (tmp_path / "stderr.txt").open("wb") as stderr_file:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            start_new_session=True,
        )
    lines: list[str] = []
    watchdog = threading.Timer(90, lambda: os.killpg(process.pid, signal.SIGKILL))  # bounds the read below
    watchdog.start()
    try:
        assert process.stdout is not None
        if interrupt:
            for raw in process.stdout:  # bounded by the watchdog
                lines.append(raw.decode(errors="replace"))
                if lines[-1].startswith("epoch 0:"):
                    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C on its terminal: every rank
                    break
        rest, _ = process.communicate(timeout=90)  # closes its stdout
        lines.append(rest.decode(errors="replace"))
    finally:
        watchdog.cancel()
        watchdog.join()
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    deadline = time.monotonic() + 3
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = tagged_processes(tag)
    for survivor in survivors:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(survivor.split(":")[0]), signal.SIGKILL)
    assert not survivors, f"processes of the demo outlived it: {survivors}"
    stderr = (tmp_path / "stderr.txt").read_text(errors="replace")
    return process.returncode, "".join(lines), stderr, out


@pytest.mark.soak
@pytest.mark.parametrize("interrupt", [False, True], ids=["normal", "sigint"])
def test_demo_leaves_nothing(tmp_path: Path, interrupt: bool) -> None:
    returncode, stdout, stderr, out = run_demo(tmp_path, interrupt=interrupt)
    if interrupt:
        assert returncode == 130, f"status {returncode}\n{stdout}\n{stderr[-3000:]}"
        assert re.search(r"stopped by SIGINT", stdout + stderr), stdout + stderr[-3000:]
    else:
        assert returncode == 0, f"status {returncode}\n{stdout}\n{stderr[-3000:]}"
    assert list(out.glob("epoch-*")), "the demo wrote no checkpoint"
    assert temporaries(out) == []
    warnings = [line for line in stderr.splitlines() if WARNINGS_ON_STDERR.search(line)]
    assert not warnings, "\n".join(warnings[:20])
