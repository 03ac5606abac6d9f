"""Faults during real multi-process runs: strangers on the control port, killed ranks.

DESIGN.md section 5: a stranger, garbage bytes, an oversized frame or a silent
connection is refused and logged, and never crashes or stalls the root; a rank that dies
ends the run on every other rank with an error instead of a hang.

Three worker processes (``tests/workers/rank.py``) run four runs in turn, and the
module's fixture disturbs them from here while they run:

1. ``disturbed`` (ranks p0, p1): once the root listens, raw connections reach its
   control port -- one that says nothing, garbage in a well-formed frame and an HTTP
   request while the follower joins, and a header announcing a 2 GiB frame after epoch 0,
   where the root waits until the fixture has seen each refused; then it finishes;
2. ``undisturbed``: the same run again, for comparison;
3. ``kill-follower`` (p0, p2): p2 is killed with SIGKILL in the middle of training;
4. ``kill-root`` (p0, p1): p0 is killed with SIGKILL in the middle of training.

The tests then check what the fixture saw.  Every wait is bounded.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from workers import rank as worker  # tests/ is on sys.path: pytest puts conftest.py's folder there

import lamploop
from lamploop.control.wire import Challenge, FrameDecoder, Refuse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANDSHAKE_TIMEOUT_S = 2.0
DEATH_NOTICED_WITHIN_S = 30.0
PROBES = {
    "garbage": b"\x00\x00\x00\x10" + b"\xff\xfe\x00not json at all",
    "http": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "oversized": b"\x7f\xff\xff\xff",
}

_SHORT = {
    "members": [0, 1],
    "strategy": "reduce_to_root",
    "k": 1,
    "epochs": 3,
    "data": {"seed": 500, "batches": [6, 6]},
    "model": {"seed": 3},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"name": "decrement"},
    # The root's alone: a silent stranger is dropped quickly.  (Followers keep the default,
    # since a root may be slow to answer while its first optimizer imports torch._dynamo.)
    "root_control": {"handshake_timeout": HANDSHAKE_TIMEOUT_S},
}
# Long enough to be killed mid-training: 40 batches of 10 ms sleep per epoch, 50 epochs.
_LONG = {**_SHORT, "epochs": 50, "data": {"seed": 600, "batches": [40, 40]}, "batch_sleep": 0.01}


def _runs(workdir: Path) -> list[dict[str, Any]]:
    pause = {"epoch": 0, "until_file": str(workdir / "go.json"), "timeout": 60.0}
    return [
        {**_SHORT, "name": "disturbed", "pause_after_epoch": pause},
        {**_SHORT, "name": "undisturbed"},
        {**_LONG, "name": "kill-follower", "members": [0, 2], "continue_on_error": True},
        {**_LONG, "name": "kill-root", "members": [0, 1]},
    ]


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[list[Any], float | None]:
    """Every message the root sent on ``sock``, and after how many seconds it closed it (None: it did not)."""
    decoder = FrameDecoder()
    messages: list[Any] = []
    started = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - started < timeout:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return messages, time.monotonic() - started
        if not data:
            return messages, time.monotonic() - started
        messages.extend(decoder.feed(data))
    return messages, None


def _first_message(sock: socket.socket, timeout: float) -> Any:
    decoder = FrameDecoder()
    sock.settimeout(timeout)
    while True:
        data = sock.recv(65536)
        assert data, "the root closed the connection before its challenge"
        messages = decoder.feed(data)
        if messages:
            return messages[0]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("faults")
    seen: dict[str, Any] = {"workdir": workdir}
    with worker.Processes(workdir) as procs:
        procs.start_runs({"workdir": str(workdir), "runs": _runs(workdir)}, workdir / "runs.json", range(3))
        everyone = ["p0", "p1", "p2"]

        # 1. Strangers while the run is under way: the first three as the follower joins
        # and training starts, the oversized frame while the root waits after epoch 0 (its
        # event loop idle, so the time it takes to refuse is its own, not a busy epoch's).
        ready = procs.wait_for_file(workdir / "disturbed" / "ready.json", 180, alive=everyone)
        address = ("127.0.0.1", ready["port"])
        probes = {}
        with socket.create_connection(address, timeout=5) as silent:
            for name, data in PROBES.items():
                if name == "oversized":
                    procs.wait_for_file(workdir / "disturbed" / "progress.json", 60, alive=everyone)
                with socket.create_connection(address, timeout=5) as sock:
                    # After the challenge, as a follower would: a stranger that speaks first
                    # is closed before any handshake (tests/control/test_control_hostile.py).
                    challenge = _first_message(sock, 10.0)
                    sock.sendall(data)
                    messages, closed_after = _read_until_closed(sock, 10.0)
                    probes[name] = ([challenge, *messages], closed_after)
            probes["silent"] = _read_until_closed(silent, 10.0 + HANDSHAKE_TIMEOUT_S)
        seen["probes"] = probes
        worker.write_json(workdir / "go.json", {})

        # 2. The same run undisturbed, then 3. a follower dies mid-training.
        procs.wait_for_file(workdir / "kill-follower" / "progress.json", 60, alive=everyone)
        time.sleep(0.3)
        procs.procs["p2"].send_signal(signal.SIGKILL)
        killed = time.time()
        root = procs.wait_for_file(
            workdir / "kill-follower" / "rank0.json", DEATH_NOTICED_WITHIN_S + 10, alive=["p0"]
        )
        seen["follower_killed"] = {"root": root, "after_s": root.get("failed_at", killed) - killed}
        seen["p2_status"] = procs.wait("p2", 10)

        # 4. The root dies mid-training.
        procs.wait_for_file(workdir / "kill-root" / "progress.json", 60, alive=["p0", "p1"])
        time.sleep(0.3)
        procs.procs["p0"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = procs.wait("p1", DEATH_NOTICED_WITHIN_S + 10)
        seen["root_killed"] = {
            "p1_status": status,
            "after_s": time.monotonic() - killed,
            "follower": json.loads((workdir / "kill-root" / "rank1.json").read_text())
            if (workdir / "kill-root" / "rank1.json").exists()
            else None,
        }
        seen["p0_status"] = procs.wait("p0", 10)
        seen["logs"] = procs.logs()
    return seen


def _refused(probe: tuple[list[Any], float | None]) -> None:
    """Closed after the challenge, without a reply: garbage is not told why (the least work)."""
    messages, closed_after = probe
    assert closed_after is not None, "the root never closed the connection"
    assert [type(m) for m in messages] == [Challenge]


def _root_result(workdir: Path, run: str) -> dict[str, Any]:
    result = worker.outcome(workdir, run, 0)
    assert result["ok"], result
    return result


def test_strangers_do_not_change_the_result(scenario: dict[str, Any]) -> None:
    workdir = scenario["workdir"]
    disturbed, undisturbed = _root_result(workdir, "disturbed"), _root_result(workdir, "undisturbed")
    assert worker.outcome(workdir, "disturbed", 1)["ok"]
    assert disturbed["state"] == undisturbed["state"]
    assert lamploop.state.converter.structure(disturbed["state"], lamploop.LoopState).epoch == 3
    for name in ("rank0", "live", "rank1"):
        got, expected = (
            worker.tensors(workdir, "disturbed", name),
            worker.tensors(workdir, "undisturbed", name),
        )
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{name} {key}"


def test_garbage_is_refused_and_logged(scenario: dict[str, Any]) -> None:
    _refused(scenario["probes"]["garbage"])
    _refused(scenario["probes"]["http"])
    refusals = _root_result(scenario["workdir"], "disturbed")["refusals"]
    assert any("not UTF-8 JSON" in r for r in refusals), refusals


def test_an_oversized_frame_is_refused_at_its_header(scenario: dict[str, Any]) -> None:
    _refused(scenario["probes"]["oversized"])
    # The body never came: the root refused on the 4-byte header, well before its handshake timeout.
    assert scenario["probes"]["oversized"][1] < HANDSHAKE_TIMEOUT_S
    refusals = _root_result(scenario["workdir"], "disturbed")["refusals"]
    assert any("2147483647" in r for r in refusals), refusals


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(scenario: dict[str, Any]) -> None:
    messages, closed_after = scenario["probes"]["silent"]
    assert closed_after is not None, "the root kept a silent connection open"
    assert [type(m) for m in messages] == [Challenge, Refuse]  # a silent peer is told why
    refusals = _root_result(scenario["workdir"], "disturbed")["refusals"]
    assert any("hello" in r for r in refusals), refusals
    assert len(refusals) == 4, refusals


def test_a_killed_follower_fails_the_root_with_an_error_naming_it(scenario: dict[str, Any]) -> None:
    seen = scenario["follower_killed"]
    assert scenario["p2_status"] == -signal.SIGKILL
    root = seen["root"]
    assert not root["ok"], root
    error = root["error"]
    assert "LamploopError" in error["mro"], error
    # The collective breaks first; the control channel then names the lost rank (DESIGN 5).
    assert error["type"] == "PeerLostError", error
    assert "rank 1" in error["message"], error
    assert seen["after_s"] < DEATH_NOTICED_WITHIN_S
    # The root did not hang: its process went on to the next run.
    assert (scenario["workdir"] / "kill-root" / "ready.json").exists()


def test_a_killed_root_ends_the_follower_with_an_error(scenario: dict[str, Any]) -> None:
    seen = scenario["root_killed"]
    assert scenario["p0_status"] == -signal.SIGKILL
    assert seen["p1_status"] == 1, scenario["logs"]
    assert seen["after_s"] < DEATH_NOTICED_WITHIN_S
    follower = seen["follower"]
    assert follower is not None
    assert not follower["ok"]
    assert "LamploopError" in follower["error"]["mro"], follower
