"""Hostile inputs, round 9: written from the docs alone (docs/cli.md, control-channel.md,
transport.md, federated.md, training.md and the public docstrings).

It covers what earlier rounds did not:

- the command line: a run directory whose ``config.json`` is not UTF-8, a JSON list, a
  directory, or has a ``config`` that is no object; ``lr-find`` with ``nan``, ``inf`` and 0 steps;
  ``demo`` with an infinite learning rate or empty hidden sizes; ``inspect`` of a checkpoint
  whose ``checkpoint.json`` is a JSON list or not UTF-8; ``plot`` of a missing run;
- the three listeners (control root, aggregator, sample receiver): a stranger whose first frame
  is JSON nested thousands deep (small enough for the pre-authentication limit, deep enough to
  exhaust Python's recursion limit when decoded);
- federated rounds: a node whose training stream is empty beside one with data, and every
  node's stream empty (FedAvg's ``sum_i n_i`` is then 0);
- ``lr_find``: NaN bounds, threshold and smoothing.

Every wait is bounded; each subprocess runs under ``timeout``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lamploop
from lamploop.errors import ConfigurationError, LamploopError

TOKEN = "hostile-r9-token-0123456789abcdef"
CLEAN_PREFIXES = ("LAMPLOOP_", "SLURM_", "TORCHELASTIC_", "MASTER_", "GLOO_")
DEPTH = 3000  # 6000 bytes of brackets: under 16 KiB, far beyond the recursion limit (1000)


# --------------------------------------------------------------------------------------------
# the command line, every run started at once in the background (2 at a time)
# --------------------------------------------------------------------------------------------


class Run:
    def __init__(self, returncode: int, stdout: str, stderr: str, seconds: float) -> None:
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_PREFIXES)}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(cwd: Path, *args: str, timeout: float = 150) -> Run:
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lamploop", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=_env(),
        )
    except subprocess.TimeoutExpired as expired:
        return Run(-999, str(expired.stdout or ""), f"HUNG after {timeout} s: {expired.stderr!r}", timeout)
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def _demo_config_dir(root: Path, name: str) -> Path:
    from lamploop.demo import DemoConfig, save_config

    directory = root / name
    directory.mkdir()
    save_config(DemoConfig(epochs=1, world_size=1, hidden_sizes=(8,)), directory)
    return directory


def _prepare(root: Path) -> dict[str, tuple[str, ...]]:
    """Make the files every command needs; the commands by name."""
    commands: dict[str, tuple[str, ...]] = {}

    d = _demo_config_dir(root, "not-utf8")
    (d / "config.json").write_bytes(b"\xff\xfe\x00{\x80\x81 not utf-8 \xc3\x28")
    commands["config not utf-8"] = ("demo", "--resume", "not-utf8")

    d = _demo_config_dir(root, "a-list")
    (d / "config.json").write_text("[1, 2, 3]")
    commands["config a list"] = ("demo", "--resume", "a-list")

    d = root / "a-dir-config"
    d.mkdir()
    (d / "config.json").mkdir()
    commands["config a directory"] = ("demo", "--resume", "a-dir-config")

    d = _demo_config_dir(root, "config-a-string")
    document = json.loads((d / "config.json").read_text())
    assert "config" in document, document
    document["config"] = "epochs=1"
    (d / "config.json").write_text(json.dumps(document))
    commands["config field a string"] = ("demo", "--resume", "config-a-string")

    commands["lr-find min-lr nan"] = ("lr-find", "--min-lr", "nan", "--num-steps", "5", "--hidden-sizes", "8")
    commands["lr-find max-lr inf"] = ("lr-find", "--max-lr", "inf", "--num-steps", "5", "--hidden-sizes", "8")
    commands["lr-find num-steps 0"] = ("lr-find", "--num-steps", "0", "--hidden-sizes", "8")

    commands["demo learning-rate inf"] = (
        "demo",
        "--out",
        "inf-lr",
        "--epochs",
        "1",
        "--world-size",
        "1",
        "--learning-rate",
        "inf",
    )
    commands["demo seed 2**64"] = (
        "demo",
        "--out",
        "big-seed",
        "--epochs",
        "1",
        "--world-size",
        "1",
        "--hidden-sizes",
        "8",
        "--seed",
        str(2**64),
    )
    commands["lr-find seed 2**64"] = (
        "lr-find",
        "--num-steps",
        "5",
        "--hidden-sizes",
        "8",
        "--seed",
        str(2**64),
    )

    checkpoint = root / "list-run" / "epoch-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint.json").write_text("[]")
    commands["inspect descriptor a list"] = ("inspect", "list-run")

    checkpoint = root / "binary-run" / "epoch-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xff\xff")
    commands["inspect descriptor not utf-8"] = ("inspect", "binary-run")

    commands["plot a missing run"] = ("plot", "no-such-run", "-o", "curve.png")
    return commands


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("cli_r9")
    commands = _prepare(root)
    pool = ThreadPoolExecutor(max_workers=2)
    futures: dict[str, Future[Run]] = {
        name: pool.submit(_cli, root, *args) for name, args in commands.items()
    }
    yield root, futures
    pool.shutdown(wait=True)


def _one_line_error(run: Run, statuses: Sequence[int], *any_of_words: Sequence[str]) -> str:
    """cli.md, "Exit statuses": "one line on stderr says why"; never a traceback."""
    assert run.returncode != -999, run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.returncode in statuses, (run.returncode, run.stderr[-2000:])
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    text = " ".join(lines)
    for words in any_of_words:
        assert any(word in text for word in words), (words, text)
    return text


CONFIG_CASES = {
    "config not utf-8": "not-utf8",
    "config a list": "a-list",
    "config a directory": "a-dir-config",
    "config field a string": "config-a-string",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_demo_resume_with_a_broken_config_json_is_one_line_naming_the_file(cli: Any, name: str) -> None:
    """cli.md: `load_config(directory, cls)` "reads it back strictly: an unknown key, a missing
    one or a wrong type is a `ConfigurationError` naming the field and the file"; Exit statuses:
    "1 | ... a setting is refused ...; one line on stderr says why"."""
    root, futures = cli
    run = futures[name].result()
    text = _one_line_error(run, (1,), ("config.json",))
    assert text.startswith("lamploop: "), text
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    directory = root / CONFIG_CASES[name]
    assert not any(p.name.startswith("epoch-") for p in directory.iterdir()), "it trained anyway"


LR_FIND_CASES = {
    "lr-find min-lr nan": ("min_lr", "min-lr"),
    "lr-find max-lr inf": ("max_lr", "max-lr"),
    "lr-find num-steps 0": ("num_steps", "num-steps"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LR_FIND_CASES))
def test_lr_find_with_a_nonsensical_bound_is_refused_naming_it(cli: Any, name: str) -> None:
    """training.md: "Bad arguments (`min_lr >= max_lr`, `num_steps < 2`, ...) are a
    `ConfigurationError` before anything runs"; cli.md exit status 1 "a setting is refused"
    (2 "bad command-line arguments"), "one line on stderr says why"."""
    _, futures = cli
    run = futures[name].result()
    _one_line_error(run, (1, 2), LR_FIND_CASES[name])
    assert "suggested learning rate" not in run.stdout, run.stdout


@pytest.mark.timeout(300)
def test_demo_with_an_infinite_learning_rate_is_refused_before_training(cli: Any) -> None:
    """cli.md exit statuses: "1 | ... a setting is refused ...; one line on stderr says why" (the
    demo's config: "learning_rate must be a positive finite number")."""
    root, futures = cli
    run = futures["demo learning-rate inf"].result()
    _one_line_error(run, (1, 2), ("learning_rate", "learning-rate"))
    out = root / "inf-lr"
    assert not out.exists() or not any(p.name.startswith("epoch-") for p in out.iterdir())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["demo seed 2**64", "lr-find seed 2**64"])
def test_a_seed_too_large_for_torch_is_one_line_not_a_traceback(cli: Any, name: str) -> None:
    """cli.md: `--seed N`; exit statuses: "1 | ... a setting is refused ...; one line on stderr
    says why", 2 "bad command-line arguments". (`--seed -1` is refused so: "seed must be an int
    >= 0, got -1".) A seed of 2**64 must be refused the same way, not crash in torch."""
    root, futures = cli
    run = futures[name].result()
    _one_line_error(run, (1, 2), ("seed",))
    if name.startswith("demo"):
        # a refused setting trains nothing, and leaves no config.json that --resume would repeat
        out = root / "big-seed"
        assert not out.exists() or not (out / "config.json").exists(), (out / "config.json").read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["inspect descriptor a list", "inspect descriptor not utf-8"])
def test_inspect_of_a_checkpoint_whose_descriptor_is_garbage_names_it_and_exits_1(
    cli: Any, name: str
) -> None:
    """cli.md: "A bad file is named, on stdout in the report and on stderr, one line per
    problem, and the exit status is 1"; status 1: "a checkpoint is bad or missing (`inspect`)"."""
    _, futures = cli
    run = futures[name].result()
    _one_line_error(run, (1,), ("checkpoint.json",))


@pytest.mark.timeout(300)
def test_plot_of_a_missing_run_is_one_line_and_status_1(cli: Any) -> None:
    """cli.md: status 1 when "a checkpoint is bad or missing"; "one line on stderr says why"."""
    root, futures = cli
    run = futures["plot a missing run"].result()
    _one_line_error(run, (1,), ("no-such-run",))
    assert not (root / "curve.png").exists()


# --------------------------------------------------------------------------------------------
# the three listeners and a stranger whose first frame is nested thousands deep
# --------------------------------------------------------------------------------------------


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


NESTED_LIST = b"[" * DEPTH + b"]" * DEPTH
NESTED_HELLO = b'{"type": "hello", "nonce": ' + b"[" * DEPTH + b"]" * DEPTH + b"}"


async def _deep_stranger(port: int, body: bytes) -> str:
    """Read the server's challenge, send one deep frame; how the connection ended."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    try:
        with anyio.fail_after(10):
            header = await stream.receive(4)
            while len(header) < 4:
                header += await stream.receive(4 - len(header))
            (length,) = struct.unpack(">I", header)
            got = 0
            while got < length:
                got += len(await stream.receive(length - got))
            await stream.send(_frame(body))
        with anyio.fail_after(15):
            try:
                while await stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError, OSError):
                return "closed"
        return "closed"
    finally:
        await stream.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("body", [NESTED_LIST, NESTED_HELLO], ids=["list", "hello"])
async def test_control_root_refuses_a_deeply_nested_frame_and_the_follower_joins(body: bytes) -> None:
    """control-channel.md: the decoder refuses "pathological nesting" as `FrameError`; "A peer
    that did not prove the token (... bytes that are not a frame ...) is only refused: the root
    logs a warning ..., keeps the last 16 in `root.recent_refusals` ... and goes on";
    "Strangers cannot crash or stall the root, nor disturb the joined peers"."""
    from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot, Train
    from lamploop.modelspec import ModelSpec, TensorSpec

    spec = ModelSpec((TensorSpec("fc.weight", (3, 2), "float32"),))
    seen: list[Any] = []

    async def follow(port: int) -> None:
        follower = TcpControlFollower(
            host="127.0.0.1", port=port, rank=1, nranks=2, token=TOKEN, model_spec=spec, connect_timeout=20
        )
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            async for command in commands:
                seen.append(command)

    with anyio.fail_after(45):
        async with (
            anyio.create_task_group() as tg,
            TcpControlRoot(nranks=2, token=TOKEN, model_spec=spec, join_timeout=30) as root,
        ):
            _, port = root.address
            assert await _deep_stranger(port, body) == "closed"
            tg.start_soon(follow, port)
            await root.on_rendezvous_ready(Rendezvous(host="127.0.0.1", port=29999))
            assert root.peers() == (1,)
            await root.broadcast(Train(epoch=0, lr_factor=1.0))
            await root.broadcast(Stop(reason="done"))
            assert len(root.recent_refusals) >= 1
    assert seen == [
        Rendezvous(host="127.0.0.1", port=29999),
        Train(epoch=0, lr_factor=1.0),
        Stop(reason="done"),
    ]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_sample_receiver_refuses_a_deeply_nested_frame_and_serves_the_producer() -> None:
    """transport.md: the server checks first that "it is a hello with a well-formed nonce, in a
    frame that decodes and fits the pre-authentication limit; otherwise the peer is a stranger,
    closed without a reply"; streaming.md's producer then sends as usual."""
    from lamploop.streaming import FifoBuffer
    from lamploop.streaming.producer import AsyncProducer
    from lamploop.streaming.receiver import SampleReceiver

    buffer = FifoBuffer(capacity=16, watermark=1, seed=0)
    with anyio.fail_after(45):
        async with SampleReceiver(buffer, token=TOKEN, expected_producers=["sim"]) as receiver:
            _, port = receiver.address
            assert await _deep_stranger(port, NESTED_HELLO) == "closed"
            async with AsyncProducer(
                receiver.address, name="sim", token=TOKEN, reconnect_timeout=20
            ) as producer:
                for i in range(5):
                    await producer.send({"x": torch.full((3,), float(i))})
            await receiver.wait_all_done()
            buffer.close()
            got = [int(sample.tensors["x"][0]) async for sample in buffer]
    assert got == list(range(5))


# --------------------------------------------------------------------------------------------
# federated rounds
# --------------------------------------------------------------------------------------------

OPTIONS = {"sizes": [4, 6, 3], "seed": 0, "dtype": "float64"}


def _plan() -> Any:
    from lamploop.federated import ModelDescription, OptimizerConfig, TrainingPlan, mlp
    from lamploop.modelspec import model_spec

    return TrainingPlan(
        name="hostile-r9",
        model=ModelDescription("mlp", OPTIONS, model_spec(mlp(OPTIONS))),
        optimizer=OptimizerConfig("sgd", learning_rate=0.1),
        local_epochs=1,
        optimizer_state="reset",
    )


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=generator)


def _empty_stream(context: Any) -> Any:
    async def nothing() -> Any:
        return
        yield  # pragma: no cover

    return nothing()


async def _federate(tmp: Path, nodes: dict[str, Any], **settings: Any) -> tuple[Any, dict[str, Any]]:
    """Run an aggregator and the nodes (name -> train batches); its result or error, and theirs."""
    from lamploop.federated import (
        AggregatorSettings,
        NodeSettings,
        approve_plan,
        mlp,
        run_aggregator,
        run_node,
    )

    await anyio.Path(tmp).mkdir(parents=True, exist_ok=True)
    plan = _plan()
    outcome: dict[str, Any] = {}
    listening = anyio.Event()
    port_box: list[int] = []

    def on_listening(port: int) -> None:
        port_box.append(port)
        listening.set()

    async def aggregator() -> None:
        try:
            outcome["aggregator"] = await run_aggregator(
                plan=plan,
                initial_model=mlp(OPTIONS),
                token=TOKEN,
                settings=AggregatorSettings(
                    **{"rounds": 1, "join_timeout": 20, "round_timeout": 30, **settings}
                ),
                on_listening=on_listening,
            )
        except Exception as error:
            outcome["aggregator"] = error

    async def node(name: str, batches: Any) -> None:
        allow = tmp / f"{name}-allow.json"
        approve_plan(plan, allow)
        try:
            outcome[name] = await run_node(
                name=name,
                host="127.0.0.1",
                port=port_box[0],
                token=TOKEN,
                allow_list=allow,
                train_batches=batches,
                settings=NodeSettings(connect_timeout=20, idle_timeout=30),
            )
        except Exception as error:
            outcome[name] = error

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(aggregator)
            await listening.wait()
            for name, batches in nodes.items():
                tg.start_soon(node, name, batches)
    return outcome["aggregator"], outcome


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_node_with_an_empty_training_stream_does_not_spoil_the_average(tmp_path: Path) -> None:
    """federated.md: "the new global model is the FedAvg of their parameters,
    `sum_i n_i * p_i / sum_i n_i` over the nodes' sample counts `n_i`" and "the round goes on
    with the others if at least `min_nodes` answered": a node that trained on 0 examples weighs
    0 (or is left out, named); either way the result is node-b's round alone."""
    x, y = _data(1, 24)
    with_data = lamploop.tensor_batches(x, y, batch_size=8, shuffle=False)
    alone, _ = await _federate(tmp_path / "alone", {"node-b": with_data}, min_nodes=1, expected_nodes=1)
    assert not isinstance(alone, BaseException), repr(alone)
    (tmp_path / "both").mkdir()
    both, outcome = await _federate(
        tmp_path / "both", {"node-a": _empty_stream, "node-b": with_data}, min_nodes=1, expected_nodes=2
    )
    assert not isinstance(both, BaseException), (repr(both), outcome)
    (record,) = both.rounds
    assert "node-b" in [report.node for report in record.answered]
    for name, tensor in both.model.items():
        assert torch.isfinite(tensor).all(), f"{name} is not finite: {tensor}"
        torch.testing.assert_close(tensor, alone.model[name], rtol=1e-12, atol=1e-12)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_every_node_with_an_empty_stream_never_gives_a_nan_global_model(tmp_path: Path) -> None:
    """federated.md: FedAvg is `sum_i n_i * p_i / sum_i n_i`; with every `n_i` 0 that is 0/0. The
    docs do not say which of the documented outcomes follows (a `FederatedError` naming the nodes,
    or a round that keeps a finite model); a NaN global model is neither (answers "with
    non-finite parameters" are "not averaged")."""
    (tmp_path / "x").mkdir()
    result, _outcome = await _federate(
        tmp_path / "x", {"node-a": _empty_stream, "node-c": _empty_stream}, min_nodes=1, expected_nodes=2
    )
    if isinstance(result, BaseException):
        assert isinstance(result, LamploopError), repr(result)
        return
    for name, tensor in result.model.items():
        assert torch.isfinite(tensor).all(), f"global {name} is not finite after a round of 0 examples"


# --------------------------------------------------------------------------------------------
# lr_find
# --------------------------------------------------------------------------------------------


def _never(*_: Any) -> Any:
    raise AssertionError("called: the arguments were not checked first")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ({"min_lr": math.nan}, "min_lr"),
        ({"max_lr": math.nan}, "max_lr"),
        ({"min_lr": -1e-3}, "min_lr"),
        ({"divergence_threshold": math.nan}, "divergence_threshold"),
        ({"smoothing": math.nan}, "smoothing"),
        ({"num_steps": True}, "num_steps"),
    ],
    ids=["min_lr-nan", "max_lr-nan", "min_lr-negative", "threshold-nan", "smoothing-nan", "num_steps-bool"],
)
def test_lr_find_refuses_nan_bounds_before_anything_runs(arguments: dict[str, Any], name: str) -> None:
    """training.md: "Bad arguments (`min_lr >= max_lr`, `num_steps < 2`, a threshold not above 1,
    a smoothing outside `[0, 1)`...) are a `ConfigurationError` before anything runs"; the
    docstring: "Every argument is checked before anything runs"."""
    with pytest.raises(ConfigurationError, match=name):
        lamploop.lr_find(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=_never,
            train_batches=_never,
            **arguments,
        )
