"""Faults of federated rounds, with real processes, sockets and signals: nothing hangs, nothing is lost.

- a node SIGKILLed inside local training: the round goes on with the others, naming it;
- a node whose allow-list lacks the plan: it refuses naming the hash (and alone, the run fails so);
- strangers (a wrong token, garbage, an oversized frame, silence): refused, the result unchanged;
- the aggregator SIGKILLed after some rounds and started again: the run ends bitwise equal to
  an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from functools import partial
from pathlib import Path

import anyio
import safetensors.torch
import torch
from test_federated import _assert_close, _sgd_steps

from lamploop.errors import FederatedError, HandshakeError, PlanNotApprovedError
from lamploop.federated import AggregatorSettings, OptimizerConfig, mlp, plan_hash, run_aggregator, save_plan
from lamploop.federated.link import Link, join_aggregator
from tests.workers.federated_harness import (
    TOKEN,
    free_port,
    in_process_node,
    make_plan,
    node_result,
    processes,
    start_aggregator,
    start_node,
)


def test_a_node_killed_inside_local_training_is_named_and_the_round_goes_on(tmp_path: Path) -> None:
    plan = make_plan()
    port = free_port()
    marker = tmp_path / "node-2-training"
    nodes = [
        start_node(tmp_path, plan, port, "node-0", rows=[0, 40], batch_size=40),
        start_node(tmp_path, plan, port, "node-1", rows=[40, 80], batch_size=40),
        # node-2 spins the CPU for 30 s in its one training batch: killed in there.
        start_node(
            tmp_path, plan, port, "node-2", rows=[80, 120], batch_size=40, spin_s=30, marker=str(marker)
        ),
    ]

    async def kill_when_training() -> None:
        while not marker.exists():  # noqa: ASYNC110 -- another process's file: nothing to wait on
            await anyio.sleep(0.02)
        os.kill(nodes[2].pid, signal.SIGKILL)

    async def main() -> object:
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_when_training)
            with anyio.fail_after(40):
                result = await run_aggregator(
                    plan=plan,
                    initial_model=mlp(dict(plan.model.options)),
                    token=TOKEN,
                    port=port,
                    settings=AggregatorSettings(
                        rounds=2, min_nodes=2, expected_nodes=3, join_timeout=20, round_timeout=25
                    ),
                )
        return result

    with processes(nodes):
        result = anyio.run(main)
        for node in nodes[:2]:
            assert node_result(node)["trained"] == [0, 1]
        assert nodes[2].wait(timeout=5) == -signal.SIGKILL
    first, second = result.rounds  # type: ignore[attr-defined]
    assert [r.node for r in first.answered] == ["node-0", "node-1"]
    assert [m.node for m in first.missing] == ["node-2"]
    assert first.missing[0].why.startswith("lost:")
    assert first.wall_s < 20  # the round went on when node-2's connection broke, not at the deadline
    assert [r.node for r in second.answered] == ["node-0", "node-1"]
    assert second.missing == ()  # node-2 was gone before round 1: not sent it
    # The survivors' FedAvg: two synchronous steps on their union, node-2's data never counted.
    _assert_close(dict(result.model), _sgd_steps(plan, (0, 80), steps=2))  # type: ignore[attr-defined]


async def _wrong_token(port: int) -> str:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    link = Link(stream, max_frame_bytes=1 << 20)
    try:
        await join_aggregator(link, b"not the token", "intruder")
    except HandshakeError as exc:
        return str(exc)
    finally:
        await link.aclose()
    return "joined"


async def _closed_after(port: int, data: bytes) -> float:
    """Send ``data`` and return the seconds until the aggregator closed the connection."""
    started = time.monotonic()
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        if data:
            await stream.send(data)
        with anyio.fail_after(10):
            try:
                while await stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                pass
    return time.monotonic() - started


def test_a_plan_off_the_allow_list_is_refused_by_hash_and_strangers_change_nothing(tmp_path: Path) -> None:
    plan = make_plan()
    digest = plan_hash(plan)
    other = make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.25))  # approved instead of plan
    port = free_port()
    nodes = [
        start_node(tmp_path, plan, port, "node-0", rows=[0, 40], batch_size=40),
        start_node(tmp_path, other, port, "node-1", rows=[40, 80], batch_size=40),
    ]
    strangers: dict[str, object] = {}

    async def strangers_knock() -> None:
        await anyio.sleep(0.3)  # the aggregator listens, and gathers its nodes for seconds
        strangers["wrong token"] = await _wrong_token(port)
        strangers["garbage"] = await _closed_after(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
        strangers["oversized"] = await _closed_after(port, struct.pack(">I", 1 << 30) + b"x" * 100)
        strangers["silent"] = await _closed_after(port, b"")

    async def main() -> object:
        async with anyio.create_task_group() as tg:
            tg.start_soon(strangers_knock)
            with anyio.fail_after(40):
                return await run_aggregator(
                    plan=plan,
                    initial_model=mlp(dict(plan.model.options)),
                    token=TOKEN,
                    port=port,
                    settings=AggregatorSettings(
                        rounds=1, min_nodes=1, expected_nodes=2, join_timeout=20, handshake_timeout=1.0
                    ),
                )

    with processes(nodes):
        result = anyio.run(main)
        assert node_result(nodes[0])["trained"] == [0]
        assert node_result(nodes[1]) == {"trained": [], "refused": [0], "failed": False}
    (record,) = result.rounds  # type: ignore[attr-defined]
    assert [r.node for r in record.answered] == ["node-0"]
    (missing,) = record.missing
    assert missing.node == "node-1"
    assert missing.why.startswith("refused:")
    assert digest in missing.why
    assert "allow-list" in missing.why
    assert digest in (tmp_path / "node-1.log").read_text()  # the node's own log names the hash too
    assert "wrong token" in str(strangers["wrong token"])
    for kind in ("garbage", "oversized"):
        assert strangers[kind] < 5, kind
    assert 0.9 < strangers["silent"] < 5  # type: ignore[operator]
    _assert_close(dict(result.model), _sgd_steps(plan, (0, 40), steps=1))  # type: ignore[attr-defined]


def test_when_every_node_refuses_the_plan_the_run_fails_naming_its_hash(tmp_path: Path) -> None:
    plan = make_plan()
    port = free_port()
    node = in_process_node(tmp_path, make_plan(name="another plan"), port, "node-0", (0, 40), 40)

    caught: list[PlanNotApprovedError] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(node)  # ends when the aggregator tells it the run failed
            with anyio.fail_after(20):
                try:
                    await run_aggregator(
                        plan=plan,
                        initial_model=mlp(dict(plan.model.options)),
                        token=TOKEN,
                        port=port,
                        settings=AggregatorSettings(rounds=2, min_nodes=1, join_timeout=10, round_attempts=2),
                    )
                except PlanNotApprovedError as exc:
                    caught.append(exc)

    anyio.run(main)
    (error,) = caught
    assert error.plan_hash == plan_hash(plan)
    assert plan_hash(plan) in str(error)
    assert "node-0" in str(error)
    assert "round 0 (attempt 2 of 2)" in str(error)  # sent again once, refused again


def test_too_few_nodes_fail_the_run_clearly_within_join_timeout(tmp_path: Path) -> None:
    plan = make_plan()
    port = free_port()
    node = in_process_node(tmp_path, plan, port, "node-0", (0, 40), 40)
    caught: list[FederatedError] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(node)
            with anyio.fail_after(20):
                try:
                    await run_aggregator(
                        plan=plan,
                        initial_model=mlp(dict(plan.model.options)),
                        token=TOKEN,
                        port=port,
                        settings=AggregatorSettings(rounds=1, min_nodes=2, join_timeout=1.5),
                    )
                except FederatedError as exc:
                    caught.append(exc)

    started = time.monotonic()
    anyio.run(main)
    assert time.monotonic() - started < 10
    (error,) = caught
    assert str(error) == "round 0: 1 node(s) connected (node-0) within join_timeout=1.5 s; min_nodes=2"


def _momentum_plan() -> object:
    return make_plan(
        optimizer=OptimizerConfig("sgd", learning_rate=0.1, momentum=0.9),
        local_steps=None,
        local_epochs=1,
        optimizer_state="keep",
    )


ROUNDS = 6
SHARDS = ((0, 40), (40, 120))


def _uninterrupted(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The same federation, never interrupted, every party in this process (real sockets)."""
    plan = _momentum_plan()
    port = free_port()
    nodes = [in_process_node(tmp_path, plan, port, f"node-{i}", rows, 10) for i, rows in enumerate(SHARDS)]  # type: ignore[arg-type]

    async def main() -> dict[str, torch.Tensor]:
        async with anyio.create_task_group() as tg:
            for node in nodes:
                # A thread (and event loop) each: torch's grad mode is per thread, and a node's
                # validation pass (no_grad) must not overlap another node's training.
                tg.start_soon(partial(anyio.to_thread.run_sync, anyio.run, node, abandon_on_cancel=True))
            with anyio.fail_after(30):
                result = await run_aggregator(
                    plan=plan,  # type: ignore[arg-type]
                    initial_model=mlp(dict(plan.model.options)),  # type: ignore[attr-defined]
                    token=TOKEN,
                    port=port,
                    settings=AggregatorSettings(rounds=ROUNDS, min_nodes=2, expected_nodes=2),
                )
        return dict(result.model)

    return anyio.run(main)


def _rounds_checkpointed(directory: Path) -> int:
    try:
        name = (directory / "latest").read_text().strip()
    except FileNotFoundError:
        return 0
    return int(name.removeprefix("epoch-"))


def test_an_aggregator_killed_after_some_rounds_resumes_and_ends_equal_to_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    plan = _momentum_plan()
    plan_file = save_plan(plan, tmp_path / "plan.json")  # type: ignore[arg-type]
    port = free_port()
    checkpoints = tmp_path / "checkpoints"
    config = {
        "port": port,
        "plan": str(plan_file),
        "rounds": ROUNDS,
        "min_nodes": 2,
        "expected_nodes": 2,
        "checkpoint_dir": str(checkpoints),
        "out": str(tmp_path / "final.safetensors"),
    }
    # Each training batch spins the CPU 30 ms: a round takes a few tenths of a second.
    nodes = [
        start_node(tmp_path, plan, port, f"node-{i}", rows=list(rows), batch_size=10, spin_s=0.03)  # type: ignore[arg-type]
        for i, rows in enumerate(SHARDS)
    ]
    first = start_aggregator(tmp_path, **config)
    with processes([*nodes, first]):
        deadline = time.monotonic() + 40
        while _rounds_checkpointed(checkpoints) < 2:
            assert time.monotonic() < deadline, "no checkpoint of round 1 within 40 s"
            assert first.poll() is None, "the aggregator ended early"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=5) == -signal.SIGKILL
        killed_after = _rounds_checkpointed(checkpoints)
        assert 2 <= killed_after < ROUNDS  # killed in the middle of the run
        second = start_aggregator(tmp_path, **config)
        with processes([second]):
            out, _ = second.communicate(timeout=40)
            assert second.returncode == 0, (tmp_path / "aggregator.log").read_text()[-2000:]
        assert json.loads(out.strip().splitlines()[-1])["rounds"] == list(range(ROUNDS))
        for node in nodes:
            assert node_result(node)["trained"][-1] == ROUNDS - 1  # rejoined, and got the current round
    resumed = safetensors.torch.load_file(config["out"])
    expected = _uninterrupted(tmp_path)
    assert set(resumed) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), name
