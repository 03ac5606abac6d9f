"""Acceptance: nothing hangs. Whatever goes wrong in a user's run, every process ends within a
bound, with a clear error naming what went wrong.

Written from the documentation alone (README.md, docs/reliability.md, docs/distributed.md,
docs/loop.md, docs/streaming.md, docs/how-to/custom-reporters.md, DESIGN.md section 8 "Nothing
waits forever", and the docstrings of ``fit``, ``local_data_parallel_training_loop``,
``BlockingProducer`` and ``lamploop.errors``). Each test starts a real process running a small
user script (tests/workers/no_hangs_worker.py) with ONE fault injected, and asserts:

- the process exits within a bound (:data:`EXIT_S`); on a timeout the stacks of every process
  of the run (py-spy) are in the failure message, and the processes are killed;
- every other process of the run (rank 1 started by ``fit(world_size=2)``, DataLoader workers)
  has ended too, within :data:`REST_S` of it;
- its exit status is the one the docs promise (non-zero for a failure);
- its output names the fault: the exception's type and message, the rank, the epoch, where
  the docs promise that.

Docs quoted: "a failed run's process exits at once with its status" (distributed.md, Failure
behaviour); "An error that one rank finds alone (a malformed batch in its stream) is still
raised on the others at once as `PeerLostError(rank=that rank, how="aborted")`, with its message"
(reliability.md); "Every survivor raises `lamploop.errors.PeerLostError`, whose `rank` names the
rank that failed" (reliability.md, table: SIGKILL of a follower gives `how="closed" or "died"`);
"`fit(world_size=2)` ... supervises them: a rank that fails fails the run, and leaving kills
them" (distributed.md).

Notes on what was found (the strict xfails say DEFECT):

- a rank SIGKILLed while its DataLoader workers live is not found "at once": the orphaned
  workers hold its sockets, so a follower of a killed root waits for the heartbeat timeout
  (``how="silent"``); the root finds a killed follower through its exit status instead;
- a follower blocked in a plain batch iterable outlives its SIGKILLed root as long as the
  iterable blocks, and prints nothing;
- ``fit(world_size=2)`` ends its root about 10 s after it lost a follower that does not answer
  (SIGSTOPped, or blocked in its data source), beyond the heartbeat timeout;
- a follower's message in the root's ``PeerLostError(how="aborted")`` was cut at about 1000
  characters: after torch's traceback of a DataLoader worker, the user's own message was lost
  there (a long message now keeps its start and its end).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import attrs
import pytest
from support import WORKERS, wait_until
from workers import warm_start
from workers.records import load_record

WORKER = WORKERS / "no_hangs_worker.py"
PY_SPY = Path(sys.executable).with_name("py-spy")
EXIT_S = 45.0
"""How long the process of a failed run may take to exit (a run here takes a few seconds)."""
REST_S = 15.0
"""How long the other processes of the run (rank 1, DataLoader workers) may outlive it."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


# --------------------------------------------------------------------------------------------
# Running a scenario, bounded
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Outcome:
    status: int
    output: str
    records: dict[str, Any]
    seconds: float

    def record(self, role: str) -> dict[str, Any]:
        assert role in self.records, f"no record of {role}:\n{self.output[-6000:]}"
        value: dict[str, Any] = self.records[role]
        return value

    def context(self) -> str:
        return f"exit status {self.status} after {self.seconds:.1f} s; output:\n{self.output[-8000:]}"


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("LAMPLOOP_RANK", None)
    return env


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    """Running, not ended (a zombie whose parent has not reaped it counts as ended)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _session(sid: int) -> list[int]:
    """The living processes of the session ``sid`` (a warm worker leads its own; its rank 1 and
    DataLoader workers are in it unless they start a session of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == sid:
            found.append(int(entry.name))
    return sorted(found)


def _run_pids(out: Path, pattern: str) -> set[int]:
    """The living processes that wrote a pid file matching ``pattern`` into ``out``."""
    pids = set()
    for path in out.glob(pattern):
        with contextlib.suppress(ValueError, OSError):
            pids.add(int(path.read_text()))
    return {pid for pid in pids if _alive(pid)}


def _stacks(pids: set[int] | list[int]) -> str:
    """Where each process is (py-spy dump), for the failure message."""
    parts = []
    for pid in sorted(pids):
        fields = _stat(pid)
        if fields is not None and fields[0] == "T":  # py-spy would wait on a stopped process
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


def _kill(pids: set[int] | list[int], sid: int | None) -> None:
    if sid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class Run:
    """One worker process of a scenario (its whole run: rank 1 and DataLoader workers too)."""

    def __init__(
        self, out: Path, scenario: str, *args: str, log: str = "output.log", role: str = "rank"
    ) -> None:
        self.out = out
        self.pid_files = f"pid-{role}*"
        self.log = out / log
        self.started = time.monotonic()
        self.proc = warm_start.popen(
            [sys.executable, str(WORKER), scenario, str(out), *args],
            env=_env(),
            cwd=WORKERS.parent,
            stdout=str(self.log),
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def others(self) -> set[int]:
        return (set(_session(self.proc.pid)) | _run_pids(self.out, self.pid_files)) - {self.proc.pid}

    def fail_hung(self, what: str) -> NoReturn:
        pids = self.others() | ({self.proc.pid} if self.proc.poll() is None else set())
        stacks = _stacks(pids)
        _kill(pids, self.proc.pid)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=20)
        pytest.fail(f"HANG: {what}\n{stacks}\noutput:\n{self.output()[-6000:]}", pytrace=False)
        raise AssertionError(what)  # not reached: pytest.fail raises

    def wait(self, bound: float = EXIT_S, since: float | None = None, rest: float = REST_S) -> int:
        """The exit status, once the process ended within ``bound`` s (from ``since``, default
        its start) and every other process of its run ended within ``rest`` s after it."""
        start = self.started if since is None else since
        status: int | None = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            status = self.proc.wait(timeout=max(0.1, start + bound - time.monotonic()))
        if status is None:
            self.fail_hung(f"the run's process {self.proc.pid} did not exit within {bound:g} s")
        deadline = time.monotonic() + rest
        while self.others():
            if time.monotonic() > deadline:
                self.fail_hung(f"processes {sorted(self.others())} outlived the run's process by {rest:g} s")
            time.sleep(0.1)
        return int(status)

    def outcome(self, bound: float = EXIT_S, rest: float = REST_S) -> Outcome:
        status = self.wait(bound, rest=rest)
        records = {}
        for path in self.out.glob("*.safetensors"):
            name = path.name.removesuffix(".safetensors")
            with contextlib.suppress(Exception):
                records[name] = load_record(self.out / name)
        return Outcome(status, self.output(), records, time.monotonic() - self.started)


def scenario(tmp_path: Path, name: str, bound: float = EXIT_S, rest: float = REST_S) -> Outcome:
    return Run(tmp_path, name).outcome(bound, rest)


def struck_at(out: Path, rank: int) -> float:
    """When the fault struck on ``rank`` (``time.time()``, written by the worker)."""
    return float((out / f"struck-rank{rank}").read_text())


def _fault(where: str, rank: int, epoch: int | None) -> str:
    """The message of the fault the worker injects (see no_hangs_worker.fault_message)."""
    return f"injected fault in {where} on rank {rank} in epoch {epoch}"


def _names(record: dict[str, Any], text: str) -> bool:
    return text in record["message"] or text in (record["cause"] or "") or text in record.get("traceback", "")


# --------------------------------------------------------------------------------------------
# A Dataset's __getitem__ raises under dataloader_batches
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "epoch"),
    [("getitem-w0-e0", 0), ("getitem-w2-e1", 1), ("getitem-w2p-e0", 0), ("getitem-w2p-e1", 1)],
)
def test_an_exception_in_a_datasets_getitem_ends_the_run_and_its_workers(
    tmp_path: Path, name: str, epoch: int
) -> None:
    """reliability.md: "`dataloader_batches` shuts an epoch's workers down as its iteration ends,
    however it ends (persistent workers when it fails or is abandoned), and what is left at the
    process's exit". One rank, 0 workers, 2 workers, 2 persistent workers; the fault in epoch 0
    or 1: the user's exception ends the run (status 1, its type and message on stderr) and no
    worker process is left."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 1, outcome.context()
    assert "InjectedFault" in outcome.output, outcome.context()
    assert _fault("__getitem__", 0, epoch) in outcome.output, outcome.context()
    assert _names(outcome.record("rank0"), _fault("__getitem__", 0, epoch)), outcome.records


def test_an_exception_in_a_loader_workers_init_ends_the_run(tmp_path: Path) -> None:
    """A DataLoader's `worker_init_fn` that raises (dataloader_batches chains its own init
    before it): the run ends, status 1, naming the error."""
    outcome = scenario(tmp_path, "worker-init-w2")
    assert outcome.status == 1, outcome.context()
    assert _fault("worker_init_fn", 0, 0) in outcome.output, outcome.context()


@pytest.mark.parametrize("failing", [1, 0], ids=["rank1-fails", "rank0-fails"])
def test_a_getitem_exception_on_one_of_two_ranks_with_persistent_workers_ends_everything(
    tmp_path: Path, failing: int
) -> None:
    """fit(world_size=2), each rank over persistent DataLoader workers; one rank's Dataset raises
    in epoch 1. reliability.md: the other rank raises `PeerLostError(rank=that rank,
    how="aborted")` with its message; every process (both ranks, every loader worker) ends."""
    outcome = scenario(tmp_path, f"getitem-w2p-rank{failing}")
    assert outcome.status == 1, outcome.context()
    assert _fault("__getitem__", failing, 1) in outcome.output, outcome.context()
    assert _names(outcome.record(f"rank{failing}"), _fault("__getitem__", failing, 1)), outcome.records
    other = outcome.records.get(f"rank{1 - failing}")
    if failing == 1 or other is not None:  # the root may kill its follower before it writes
        assert other is not None, outcome.context()
        assert (other["error"], other["rank_attr"], other["how"]) == ("PeerLostError", failing, "aborted"), (
            other
        )
        # A long message keeps its start and its end: the type, and the user's own message
        # after torch's traceback of the worker.
        assert "InjectedFault" in other["message"], other
        assert _fault("__getitem__", failing, 1) in other["message"], other


# --------------------------------------------------------------------------------------------
# A fault in the user's code on one rank of fit(world_size=2)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "where", "epoch"),
    [
        ("forward-rank1", "forward", 1),
        ("loss-rank1", "loss", 0),
        ("extra-rank1", "extra", 0),
        ("stream-raises-rank1", "train_stream", 1),
    ],
)
def test_a_follower_that_fails_ends_every_rank_naming_it(
    tmp_path: Path, name: str, where: str, epoch: int
) -> None:
    """reliability.md: "An error that one rank finds alone ... is still raised on the others at
    once as `PeerLostError(rank=that rank, how="aborted")`, with its message"; the follower
    raises its own error. Rank 1's forward, loss, checkpoint extra's `state_dict` (sent to the
    root after every training pass) or batch stream raises; both processes end, the root's
    with status 1."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 1, outcome.context()
    root = outcome.record("rank0")
    assert (root["error"], root["rank_attr"], root["how"]) == ("PeerLostError", 1, "aborted"), root
    assert _fault(where, 1, epoch) in root["message"], root
    assert _names(outcome.record("rank1"), _fault(where, 1, epoch)), outcome.records
    assert "InjectedFault" in outcome.output, outcome.context()


def test_an_optimizer_factory_that_fails_on_rank_1_ends_every_rank(tmp_path: Path) -> None:
    """The optimizer factory raises on rank 1: every rank ends; the root's error names rank 1
    ("a rank that fails fails the run"), rank 1's traceback names the error."""
    outcome = scenario(tmp_path, "optimizer-rank1")
    assert outcome.status == 1, outcome.context()
    root = outcome.record("rank0")
    assert (root["error"], root["rank_attr"]) == ("PeerLostError", 1), root
    assert _names(outcome.record("rank1"), _fault("optimizer", 1, None)), outcome.records
    assert _fault("optimizer", 1, None) in outcome.output, outcome.context()


@pytest.mark.parametrize(
    ("name", "where", "epoch"), [("forward-rank0", "forward", 1), ("extra-rank0", "extra", 0)]
)
def test_a_root_that_fails_ends_every_rank_with_its_error(
    tmp_path: Path, name: str, where: str, epoch: int
) -> None:
    """The root's forward, or its checkpoint extra's `state_dict` (the checkpoint write), raises:
    the root raises that error (status 1); its follower ends too ("The root, leaving its control
    channel without `Stop`, tells every follower why"; "leaving kills them")."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 1, outcome.context()
    assert _names(outcome.record("rank0"), _fault(where, 0, epoch)), outcome.records
    assert "InjectedFault" in outcome.output, outcome.context()
    follower = outcome.records.get("rank1")
    if follower is not None:  # it may have been killed before it wrote its record
        assert (follower["error"], follower["rank_attr"]) == ("PeerLostError", 0), follower


def test_a_reporter_that_raises_in_report_does_not_fail_the_run(tmp_path: Path) -> None:
    """custom-reporters.md: "A reporter that raises in `report` is logged on the `lamploop`
    logger and never fails the run." (two ranks: the root reports)."""
    outcome = scenario(tmp_path, "reporter-report")
    assert outcome.status == 0, outcome.context()
    assert outcome.record("rank0") == {"error": None, "result": 2}, outcome.records
    assert _fault("report", 0, 0) in outcome.output, outcome.context()


def test_a_reporter_whose_start_fails_stops_the_run_before_it_begins(tmp_path: Path) -> None:
    """custom-reporters.md: "A `start()` that fails stops the run before it begins, with that
    error" (two ranks: rank 1, started or not, ends too)."""
    outcome = scenario(tmp_path, "reporter-start")
    assert outcome.status == 1, outcome.context()
    root = outcome.record("rank0")
    assert (root["error"], root["message"]) == ("InjectedFault", _fault("start", 0, None)), root


# --------------------------------------------------------------------------------------------
# sys.exit, os._exit, KeyboardInterrupt inside a forward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["exit-rank1", "os-exit-rank1", "keyboard-rank1"])
def test_a_follower_that_exits_or_is_interrupted_in_a_forward_ends_every_rank(
    tmp_path: Path, name: str
) -> None:
    """`sys.exit(3)`, `os._exit(3)` or `KeyboardInterrupt` in rank 1's forward. The docs promise
    that nothing hangs and that a lost rank is named (`PeerLostError`, whose `rank` names the rank
    that failed): every process ends, the root's with status 1, naming rank 1."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 1, outcome.context()
    root = outcome.record("rank0")
    assert (root["error"], root["rank_attr"]) == ("PeerLostError", 1), root
    if name == "exit-rank1":
        assert "SystemExit" in root["message"], root
    if name == "keyboard-rank1":
        assert "KeyboardInterrupt" in root["message"], root


@pytest.mark.parametrize(
    ("name", "error"), [("exit-single", "SystemExit"), ("keyboard-single-w2p", "KeyboardInterrupt")]
)
def test_leaving_from_inside_a_forward_on_one_rank_ends_the_process(
    tmp_path: Path, name: str, error: str
) -> None:
    """One rank: `sys.exit(3)` in a forward; `KeyboardInterrupt` in a forward while persistent
    DataLoader workers are alive. The process ends (non-zero), its workers too, and the output
    names what ended it."""
    outcome = scenario(tmp_path, name)
    assert outcome.status != 0, outcome.context()
    assert outcome.record("rank0")["error"] == error, outcome.records
    assert error in outcome.output, outcome.context()


# --------------------------------------------------------------------------------------------
# Batch streams: a wrong type, uneven streams
# --------------------------------------------------------------------------------------------


def test_a_stream_that_yields_a_wrong_type_on_rank_1_ends_every_rank_with_a_batch_error(
    tmp_path: Path,
) -> None:
    """loop.md: "Bad input fails with a `lamploop.errors.BatchError` naming the epoch, batch and
    rank: ... an item that is not a pair"; reliability.md: the others raise
    `PeerLostError(rank=that rank, how="aborted")` with its message."""
    outcome = scenario(tmp_path, "stream-wrong-type-rank1")
    assert outcome.status == 1, outcome.context()
    follower = outcome.record("rank1")
    assert "BatchError" in follower["classes"], follower
    assert all(part in follower["message"] for part in ("epoch 1", "batch 1", "rank 1")), follower
    root = outcome.record("rank0")
    assert (root["error"], root["rank_attr"], root["how"]) == ("PeerLostError", 1, "aborted"), root
    assert follower["message"] in root["message"], (root, follower)


def test_uneven_streams_on_two_ranks_finish(tmp_path: Path) -> None:
    """distributed.md: "uneven streams neither hang (lamp's behaviour) nor drop examples": rank 1
    has 1 batch in epoch 0, rank 0 has 4; the run finishes both epochs, status 0."""
    outcome = scenario(tmp_path, "stream-uneven")
    assert outcome.status == 0, outcome.context()
    assert outcome.record("rank0") == {"error": None, "result": 2}, outcome.records
    assert outcome.record("rank1") == {"error": None, "result": None}, outcome.records


# --------------------------------------------------------------------------------------------
# A rank killed or frozen
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["sigkill-rank1-validation", "sigkill-rank1-checkpoint", "sigkill-rank1-w2p"]
)
def test_a_follower_killed_ends_the_root_naming_it(tmp_path: Path, name: str) -> None:
    """reliability.md's table: SIGKILL of a follower: every survivor raises
    `PeerLostError(rank=that follower, how="closed" or "died")`. Rank 1 kills itself in its
    validation pass, or the root kills it while the root writes a checkpoint (a slow extra), or
    rank 1 kills itself in a forward while its persistent DataLoader workers are alive (they
    must end too)."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 1, outcome.context()
    root = outcome.record("rank0")
    assert (root["error"], root["rank_attr"]) == ("PeerLostError", 1), root
    assert root["how"] in ("closed", "died"), root


def test_a_follower_killed_before_it_joins_fails_the_run(tmp_path: Path) -> None:
    """distributed.md: `fit(world_size=n)` "supervises them: a rank that fails fails the run":
    rank 1 SIGKILLed before it calls `fit` ends the root with an error naming rank 1."""
    outcome = scenario(tmp_path, "sigkill-rank1-before-join")
    assert outcome.status == 1, outcome.context()
    root = outcome.record("rank0")
    assert (root["error"], root["rank_attr"]) == ("PeerLostError", 1), root


@pytest.mark.parametrize("name", ["sigkill-rank0-forward", "sigkill-rank0-rank1-waits-for-samples"])
def test_the_root_killed_ends_its_follower_naming_rank_0(tmp_path: Path, name: str) -> None:
    """reliability.md's table: SIGKILL of the root: `PeerLostError(rank=0)` on every follower, in
    0.0-0.1 s; the follower's process then exits. The follower is in a step, or (streaming.md,
    several ranks over `buffer_batches`) waits for samples that never come."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == -signal.SIGKILL, outcome.context()
    follower = outcome.record("rank1")
    assert (follower["error"], follower["rank_attr"]) == ("PeerLostError", 0), follower
    assert follower["how"] in ("closed", "died"), follower


def test_the_root_killed_with_its_loader_workers_alive_is_found_at_once(tmp_path: Path) -> None:
    """reliability.md: "a rank that **dies** closes its connections: the others notice at once";
    its table: SIGKILL of the root gives `PeerLostError(rank=0)` on every follower in 0.0-0.1 s
    (`how` "closed" or "died"; "silent" is the frozen rank's, after the heartbeat timeout).
    Here both ranks train over persistent DataLoader workers when the root is SIGKILLed."""
    outcome = scenario(tmp_path, "sigkill-rank0-w2p")
    assert outcome.status == -signal.SIGKILL, outcome.context()
    follower = outcome.record("rank1")
    assert (follower["error"], follower["rank_attr"]) == ("PeerLostError", 0), follower
    assert follower["how"] in ("closed", "died"), follower
    assert follower["at"] - struck_at(tmp_path, 0) < 2.0, follower


def test_the_root_killed_while_its_follower_waits_in_a_slow_source_ends_the_follower(tmp_path: Path) -> None:
    """reliability.md: SIGKILL of the root: `PeerLostError(rank=0)` on every follower in
    0.0-0.1 s, and "A failed run's process exits with status 1 at once"; "every survivor's run
    ends within 5 s of the fault". Rank 1's batch stream (`iterable_batches` over a generator
    whose source stalls for 300 s, a network read say) waits for its first batch of epoch 1
    when the root is SIGKILLed: rank 1 must end within 10 s of the root."""
    outcome = scenario(tmp_path, "sigkill-rank0-rank1-in-slow-source", rest=10.0)
    assert outcome.status == -signal.SIGKILL, outcome.context()
    follower = outcome.record("rank1")
    assert (follower["error"], follower["rank_attr"]) == ("PeerLostError", 0), follower


def test_a_frozen_follower_ends_the_root_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    """reliability.md: "a rank that **freezes** (SIGSTOP ...) stops sending heartbeats: the others
    notice after the heartbeat timeout ... and every survivor's run ends within 5 s of the fault"
    (4 s timeout); control-channel.md: a peer silent for `heartbeat_timeout` "is lost". With
    `heartbeat_timeout=1` the root must raise `PeerLostError(rank=1, how="silent")` and exit
    within 1 + 4 s of the SIGSTOP; the stopped rank 1 is killed as the root leaves."""
    run = Run(tmp_path, "sigstop-rank1")
    wait_until(
        lambda: (tmp_path / "struck-rank1").exists() or run.proc.poll() is not None,
        timeout=EXIT_S,
        what="rank 1 stopping itself",
    )
    since = time.monotonic() - (time.time() - struck_at(tmp_path, 1))
    outcome = Outcome(run.wait(1.0 + 4.0, since=since), run.output(), {}, 0.0)
    assert outcome.status == 1, outcome.context()
    root = load_record(tmp_path / "rank0")
    assert (root["error"], root["rank_attr"], root["how"]) == ("PeerLostError", 1, "silent"), root


# --------------------------------------------------------------------------------------------
# fit twice in one process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["twice-2ranks", "twice-dataloader"])
def test_fit_again_after_a_failed_fit_in_the_same_process_works(tmp_path: Path, name: str) -> None:
    """The same process calls `fit` again after its first call failed (two ranks whose rank 1
    raised; or one rank over persistent DataLoader workers whose Dataset raised): the second run
    trains to the end, and the process exits 0 (what the first left behind does not hang it)."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 0, outcome.context()
    first = outcome.record("first-run")
    if name == "twice-2ranks":
        assert (first["error"], first["rank_attr"]) == ("PeerLostError", 1), first
    else:
        assert _names(first, _fault("__getitem__", 0, 0)), first
    assert outcome.record("rank0") == {"error": None, "result": 2}, outcome.records


# --------------------------------------------------------------------------------------------
# local_data_parallel_training_loop
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "where", "rank", "epoch"),
    [("local-forward-replica1", "forward", 1, 1), ("local-checkpoint-state", "checkpoint_state", 0, 0)],
)
def test_local_data_parallel_ends_on_an_error_in_one_replica(
    tmp_path: Path, name: str, where: str, rank: int, epoch: int
) -> None:
    """`local_data_parallel_training_loop` on two CPU replicas: "LamploopError: the first error of
    any replica (the others are ended within seconds)"; reliability.md: "an error in any replica
    ... ends every replica with that error in under a second". Replica 1's forward raises, or
    the `checkpoint_state` callback does: the process exits 1, naming the error."""
    outcome = scenario(tmp_path, name)
    assert outcome.status == 1, outcome.context()
    assert _names(outcome.record("rank0"), _fault(where, rank, epoch)), outcome.records
    assert "InjectedFault" in outcome.output, outcome.context()


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


def _producer_killed_mid_stream(tmp_path: Path) -> Run:
    """A trainer (fit_async over buffer_batches, its receiver in the process) and a
    BlockingProducer process that SIGKILLs itself once 40 samples were acknowledged, before its
    `done()`."""
    trainer = Run(tmp_path, "stream-trainer")
    wait_until(lambda: (tmp_path / "address.json").exists(), timeout=60, what="the trainer's receiver")
    producer = Run(tmp_path, "stream-producer", "kill-self", "40", log="producer.log", role="producer")
    assert producer.wait(60) == -signal.SIGKILL, producer.output()
    assert (tmp_path / "producer-acknowledged.json").exists(), producer.output()
    assert trainer.proc.poll() is None, trainer.output()
    return trainer


def test_a_killed_producer_then_a_closed_buffer_ends_the_run(tmp_path: Path) -> None:
    """streaming.md: "once the producers are done (`buffer.close()`) and the buffer is drained
    ... The first training epoch in which no rank draws a batch then ends the run ... `epochs`
    returns the state of the epochs before it". The producer died mid-stream; the trainer closes
    its buffer: the 40 acknowledged samples make 5 epochs of 2 batches of 4, the run returns,
    the receiver's block is left, and the process exits 0."""
    trainer = _producer_killed_mid_stream(tmp_path)
    since = time.monotonic()
    (tmp_path / "close-buffer").write_text("1")
    assert trainer.wait(30, since=since) == 0, trainer.output()
    outcome = trainer.outcome()
    assert outcome.record("rank0")["result"]["epoch"] == 5, outcome.records


def test_a_trainer_waiting_for_a_killed_producer_stops_on_sigterm(tmp_path: Path) -> None:
    """streaming.md, "When no sample comes": a rank waits as long as it takes; "On SIGTERM ...
    the stream ends at once ... `fit` writes its checkpoint and raises `TrainingInterrupted`".
    The producer died mid-stream and the buffer is never closed: a SIGTERM ends the trainer
    (its script lets the error out: status 1)."""
    trainer = _producer_killed_mid_stream(tmp_path)
    time.sleep(0.5)
    since = time.monotonic()
    trainer.proc.send_signal(signal.SIGTERM)
    assert trainer.wait(20, since=since) == 1, trainer.output()
    outcome = trainer.outcome()
    record = outcome.record("rank0")
    assert record["error"] == "TrainingInterrupted", record
    assert "SIGTERM" in record["message"], record


def test_a_blocking_producer_whose_trainer_is_gone_fails_within_reconnect_timeout(tmp_path: Path) -> None:
    """streaming.md, "Nothing waits forever": "A producer whose receiver is gone keeps trying for
    `reconnect_timeout` seconds, then fails: the `send` or `done` that waits raises, and so does
    leaving the block, a `BlockingProducer` whose samples wait for room in the window included".
    The trainer (its receiver) is SIGKILLed while the producer sends; with
    `reconnect_timeout=3` the producer's process ends with a `StreamingError` soon after."""
    receiver = Run(tmp_path, "stream-receiver", log="receiver.log")
    wait_until(lambda: (tmp_path / "address.json").exists(), timeout=60, what="the receiver")
    producer = Run(tmp_path, "stream-producer", "keep-sending", "3", log="producer.log", role="producer")
    wait_until(
        lambda: (tmp_path / "producer-sending.json").exists() or producer.proc.poll() is not None,
        timeout=60,
        what="the producer's first samples",
    )
    receiver.proc.kill()
    assert receiver.wait(20) == -signal.SIGKILL
    since = time.monotonic()
    assert producer.wait(3 + 20, since=since) == 1, producer.output()
    record = load_record(tmp_path / "producer")
    assert record["error"] == "StreamingError", record
    assert "could not reach the receiver" in record["message"], record


def test_a_trainer_that_fails_while_a_producer_sends_exits_and_so_does_the_producer(tmp_path: Path) -> None:
    """The trainer's receiver serves on its own thread (`own_thread=True`: "started by `async
    with`, joined on leaving it") and its model fails in epoch 3 while a `BlockingProducer`
    process still sends: the trainer's process exits (status 1, the error named), and the
    producer, whose receiver is now gone, fails within its `reconnect_timeout` (3 s) and exits."""
    trainer = Run(tmp_path, "stream-trainer", "own-thread", "fail")
    wait_until(lambda: (tmp_path / "address.json").exists(), timeout=60, what="the trainer's receiver")
    producer = Run(tmp_path, "stream-producer", "keep-sending", "3", log="producer.log", role="producer")
    outcome = trainer.outcome()
    assert outcome.status == 1, outcome.context()
    assert _names(outcome.record("rank0"), _fault("forward", 0, 3)), outcome.records
    since = time.monotonic()
    assert producer.wait(3 + 20, since=since) == 1, producer.output()
    assert load_record(tmp_path / "producer")["error"] == "StreamingError", producer.output()
