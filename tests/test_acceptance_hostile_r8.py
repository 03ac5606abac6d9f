"""Hostile inputs, round 8: written from the docs alone (docs/pipeline.md, distributed.md,
training.md, streaming.md, checkpoints.md and the public docstrings).

It covers what earlier rounds did not:

- ``open_pipeline_group``: a rank 1 whose rank 0 never comes (a long group ``timeout`` and a
  short ``join_timeout``: the join must end at the latter), a rank 0 whose port is taken, two
  processes claiming the same rank (in a world of 3 whose last rank never comes, and in a world
  of 2 that trains), and arguments that cannot be right (a world of 0 ranks, a negative rank,
  a port out of range, a NaN or negative timeout);
- ``local_data_parallel_training_loop``: an optimizer factory that raises, or returns
  ``None``, on the second replica only; a replica whose parameters lie on two devices; a
  checkpoint of another model handed over as ``init_state``; settings of the wrong type;
- ``fit``: devices that do not exist here; a ``checkpoint_dir`` that is a file or lies under
  one; a resume whose newest checkpoint is truncated (it must fall back and train on exactly);
- streaming: ``send_rows`` with a column of zero rows beside one of two, with a column on the
  ``meta`` device, and through a ``BlockingProducer`` into a receiver on its own thread whose
  buffer was closed before the first sample.

Every wait is bounded; processes are started by the warm server (tests/workers/warm_start.py)
and SIGKILLed by pid at teardown if still there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support import WORKERS, free_port

import lamploop
from lamploop.checkpoint import MODEL_FILE, load_checkpoint, save_checkpoint
from lamploop.distributed import local_data_parallel_training_loop
from lamploop.errors import (
    ConfigurationError,
    LamploopError,
    StreamingError,
)
from lamploop.pipeline import open_pipeline_group
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.streaming import FifoBuffer
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
from lamploop.streaming.receiver import SampleReceiver

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/, for workers.warm_start
from workers import warm_start

WORKER = WORKERS / "hostile_r8_worker.py"
LAUNCH_PREFIXES = ("LAMPLOOP_", "SLURM_", "TORCHELASTIC_", "MASTER_", "GLOO_")
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
TOKEN = "hostile-r8-token-0123456789abcdef"
FEATURES = 3


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _data(rows: int = 24, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    return x, x @ torch.tensor([[1.5], [-2.0], [0.5]], dtype=torch.float64)


def _module(hidden: int = 4) -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).double()


def _model(hidden: int = 4) -> lamploop.SupervisedModel:
    return lamploop.SupervisedModel(_module(hidden), lamploop.mse_loss)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _batches(rows: int = 24, batch_size: int = 4) -> Any:
    x, y = _data(rows)
    return lamploop.tensor_batches(x, y, batch_size=batch_size, shuffle=False)


def _pair(**model_kw: Any) -> list[tuple[lamploop.SupervisedModel, Any, Any]]:
    return [(_model(**model_kw), _batches(), None), (_model(**model_kw), _batches(), None)]


def _local(replicas: Any, optimizer_factory: Any = _sgd, max_epochs: int = 1, **keywords: Any) -> Any:
    async def main() -> Any:
        with anyio.fail_after(60):
            return await local_data_parallel_training_loop(
                replicas, optimizer_factory, max_epochs, **keywords
            )

    return anyio.run(main)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_NAMES}
    if "LAMPLOOP_TEST_COLD_START" in os.environ:
        env["LAMPLOOP_TEST_COLD_START"] = os.environ["LAMPLOOP_TEST_COLD_START"]
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if (name.startswith(LAUNCH_PREFIXES) and name != "LAMPLOOP_TEST_COLD_START") or name in LAUNCH_NAMES:
            monkeypatch.delenv(name)


def _raised(call: Callable[[], Any]) -> BaseException:
    """The exception ``call`` raises (the test then says what it must be)."""
    try:
        call()
    except BaseException as error:  # what it is, the test looks at
        return error
    raise AssertionError("nothing was raised")


def _no_default_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("this process already has a default process group")


# --------------------------------------------------------------------------------------------
# pipeline ranks as processes (tests/workers/hostile_r8_worker.py)
# --------------------------------------------------------------------------------------------


class Rank:
    def __init__(self, base: Path, name: str, config: dict[str, Any]) -> None:
        self.out = base / f"{name}.json"
        self.config_path = base / f"{name}.config.json"
        self.config_path.write_text(json.dumps({"out": str(self.out), **config}))
        self.err = base / f"{name}.err"
        self.proc = warm_start.popen(
            [sys.executable, str(WORKER), str(self.config_path)],
            env=_clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=self.err,
        )

    def started(self) -> bool:
        return Path(str(self.out) + ".started").exists()

    def joined(self) -> bool:
        return Path(str(self.out) + ".joined").exists()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(timeout, 0.01))
        except subprocess.TimeoutExpired:
            return None

    def result(self) -> dict[str, Any] | None:
        return json.loads(self.out.read_text()) if self.out.exists() else None

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")[-2000:] if self.err.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[..., Rank]]:
    started: list[Rank] = []

    def make(name: str, **config: Any) -> Rank:
        rank = Rank(tmp_path, name, config)
        started.append(rank)
        return rank

    yield make
    for rank in started:
        rank.kill()


def _wait_started(procs: list[Rank], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.started() for p in procs):
        assert time.monotonic() < deadline, "a rank's process did not start"
        time.sleep(0.05)


def _wait_all(procs: list[Rank], bound: float) -> list[int | None]:
    """Wait up to ``bound`` s (from now) for every process; their exit statuses (None: still running)."""
    deadline = time.monotonic() + bound
    return [p.wait(deadline - time.monotonic()) for p in procs]


# --------------------------------------------------------------------------------------------
# 1. open_pipeline_group
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_pipeline_rank_1_whose_rank_0_never_comes_gives_up_at_join_timeout_not_timeout(
    ranks: Callable[..., Rank],
) -> None:
    """pipeline.md: "waiting up to `join_timeout` for every rank to arrive ...; a rank that never
    came is named when `join_timeout` passes"; "Every wait is bounded: joining by `join_timeout`".
    Rank 1 of 2, nobody listening on rank 0's port, ``timeout=60`` but ``join_timeout=2``: a
    DistributedError within 2 s plus a margin (not after the group's 60 s), naming rank 0."""
    rank = ranks("lonely-1", rank=1, world_size=2, port=free_port(), timeout=60.0, join_timeout=2.0)
    _wait_started([rank])
    status = rank.wait(25.0)
    assert status is not None, "rank 1 still waits 25 s after its start, with join_timeout=2"
    result = rank.result()
    assert result is not None, rank.stderr()
    assert not result["ok"], result
    assert "DistributedError" in result["classes"], result
    assert result["elapsed"] < 2.0 + 10.0, result
    assert "rank 0" in result["message"], result


@pytest.mark.timeout(90)
def test_pipeline_rank_0_on_a_taken_port_is_a_distributed_error_naming_the_port(
    ranks: Callable[..., Rank],
) -> None:
    """open_pipeline_group's docstring: "DistributedError: the store could not be opened or
    reached"; pipeline.md: "refusals that say what is wrong". Another socket listens on the port
    rank 0 is told to host its store on: rank 0 must fail at once (not after join_timeout=30)
    with a DistributedError that names the port."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        rank = ranks("taken-0", rank=0, world_size=2, port=port, timeout=30.0, join_timeout=30.0)
        _wait_started([rank])
        status = rank.wait(20.0)
        assert status is not None, "rank 0 still runs 20 s after its start on a taken port"
    result = rank.result()
    assert result is not None, rank.stderr()
    assert not result["ok"], result
    assert "DistributedError" in result["classes"], result
    assert result["elapsed"] < 10.0, result
    assert str(port) in result["message"], result


@pytest.mark.timeout(120)
def test_pipeline_two_processes_claiming_rank_1_of_3_all_end_within_join_timeout(
    ranks: Callable[..., Rank],
) -> None:
    """pipeline.md: "a rank that never came is named when `join_timeout` passes ("pipeline rank 0
    of 2: ranks [1] did not join the pipeline within 300 s")"; "Both waits are the data-parallel
    ranks' barrier ...: every rank goes on, or none does". Ranks 0, 1 and 1 again of 3; rank 2
    never comes. No rank may go on (rank 2 is missing), every process ends with a
    DistributedError within join_timeout (4 s) plus a margin, and rank 0 names rank 2 (or the
    rank given twice)."""
    port = free_port()
    common = {"world_size": 3, "port": port, "timeout": 60.0, "join_timeout": 4.0}
    procs = [ranks("dup3-0", rank=0, **common)]
    _wait_started(procs)
    time.sleep(0.5)  # rank 0's store listens
    procs += [ranks("dup3-1a", rank=1, **common), ranks("dup3-1b", rank=1, **common)]
    _wait_started(procs)
    statuses = _wait_all(procs, 30.0)
    assert None not in statuses, f"still running 30 s after start with join_timeout=4: {statuses}"
    results = [p.result() for p in procs]
    assert all(r is not None for r in results), [p.stderr() for p in procs]
    assert not any(p.joined() for p in procs), "a rank went on although rank 2 never came"
    for result in results:
        assert not result["ok"], results
        assert "DistributedError" in result["classes"], results
        assert result["elapsed"] < 4.0 + 12.0, results
    message = results[0]["message"]
    assert "[2]" in message or "twice" in message or "duplicate" in message.lower(), message


@pytest.mark.timeout(120)
def test_pipeline_a_second_rank_1_of_2_fails_with_a_lamploop_error_and_nothing_hangs(
    ranks: Callable[..., Rank],
) -> None:
    """pipeline.md "Never a hang": "Every wait is bounded: joining by `join_timeout` ..., every
    send and receive ... by the group's `timeout`"; the docstring: "DistributedError: ... the
    other ranks did not join (or set up their group) within join_timeout, or one's set-up
    failed". Ranks 0, 1 and a second 1 of a world of 2 (join_timeout 6 s, timeout 6 s), each
    training one epoch of a 2-stage model inside the block: every process ends within
    join_timeout + timeout + a margin, at most one process trains stage 1, and every failure is
    a lamploop error (no raw RuntimeError out of torch)."""
    port = free_port()
    common = {"world_size": 2, "port": port, "timeout": 6.0, "join_timeout": 6.0, "train": True}
    procs = [ranks("dup2-0", rank=0, **common)]
    _wait_started(procs)
    time.sleep(0.5)
    procs += [ranks("dup2-1a", rank=1, **common), ranks("dup2-1b", rank=1, **common)]
    _wait_started(procs)
    statuses = _wait_all(procs, 45.0)
    assert None not in statuses, f"still running 45 s after start (join 6 s, timeout 6 s): {statuses}"
    results = [p.result() for p in procs]
    assert all(r is not None for r in results), [p.stderr() for p in procs]
    ok_stage_1 = [r for r in results[1:] if r["ok"]]
    assert len(ok_stage_1) <= 1, f"two processes both trained stage 1: {results}"
    assert any(not r["ok"] for r in results), results
    for result in results:
        if not result["ok"]:
            assert "LamploopError" in result["classes"], results


BAD_GROUP_ARGUMENTS = [
    pytest.param({"world_size": 0}, "world_size", id="world_size-0"),
    pytest.param({"world_size": -1}, "world_size", id="world_size-negative"),
    pytest.param({"rank": -1}, "rank", id="rank-negative"),
    pytest.param({"port": 70000}, "port", id="port-70000"),
    pytest.param({"port": -5}, "port", id="port-negative"),
    pytest.param({"port": "29500"}, "port", id="port-str"),
    pytest.param({"join_timeout": -1.0}, "join_timeout", id="join_timeout-negative"),
    pytest.param({"join_timeout": math.nan}, "join_timeout", id="join_timeout-nan"),
    pytest.param({"timeout": math.nan}, "timeout", id="timeout-nan"),
    pytest.param({"timeout": -3.0}, "timeout", id="timeout-negative"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("changes", "word"), BAD_GROUP_ARGUMENTS)
def test_open_pipeline_group_refuses_impossible_arguments_naming_them(
    changes: dict[str, Any], word: str
) -> None:
    """open_pipeline_group's docstring: "ConfigurationError: bad arguments". A world of 0 ranks,
    a negative rank, a port out of 0..65535 or not an int, a NaN or negative timeout: each a
    ConfigurationError naming the argument, at once, leaving no default process group."""
    _no_default_group()
    arguments: dict[str, Any] = {
        "rank": 0,
        "world_size": 1,
        "host": "127.0.0.1",
        "port": free_port(),
        "timeout": 10.0,
        "join_timeout": 10.0,
    }
    arguments.update(changes)
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as raised, open_pipeline_group(**arguments):
        pass
    assert time.monotonic() - started < 5.0
    assert word in str(raised.value), str(raised.value)
    assert not torch.distributed.is_initialized()


# --------------------------------------------------------------------------------------------
# 2. local_data_parallel_training_loop and fit
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_local_optimizer_factory_raising_on_the_second_replica_only_is_a_lamploop_error() -> None:
    """local_data_parallel_training_loop's docstring: "LamploopError: the first error of any
    replica (the others are ended within seconds)". The optimizer factory works for the first
    replica and raises on the second: within the bound (no hang), the user's own error as itself
    or a LamploopError that quotes it (the docstring is ambiguous between the two: a user's
    ValueError is not a LamploopError), never an error of lamploop's making that hides it."""
    calls: list[int] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("hostile-r8: no optimizer for this replica")
        return _sgd(params)

    started = time.monotonic()
    error = _raised(lambda: _local(_pair(), optimizer_factory=factory))
    assert time.monotonic() - started < 30.0
    assert isinstance(error, (ValueError, LamploopError)), repr(error)
    assert "no optimizer for this replica" in str(error), str(error)


@pytest.mark.timeout(90)
def test_local_optimizer_factory_returning_none_on_the_second_replica_names_optimizer_factory() -> None:
    """DESIGN/distributed.md: ``optimizer_factory`` makes each replica's optimizer; the
    docstring: "LamploopError: the first error of any replica". A factory that returns ``None``
    for the second replica must be refused as a lamploop error naming ``optimizer_factory``, not
    an ``AttributeError: 'NoneType' object has no attribute ...`` from deep inside."""
    calls: list[int] = []

    def factory(params: Any) -> Any:
        calls.append(1)
        return None if len(calls) == 2 else _sgd(params)

    error = _raised(lambda: _local(_pair(), optimizer_factory=factory))
    assert isinstance(error, LamploopError), repr(error)
    assert "optimizer_factory" in str(error), str(error)


@pytest.mark.timeout(60)
def test_local_replica_with_parameters_on_two_devices_is_refused() -> None:
    """local_data_parallel_training_loop's docstring: "ConfigurationError: ... a replica on
    another device (``meta``) or several". The second replica's last layer lies on ``meta`` and
    its first on the CPU: a ConfigurationError before training, naming the device."""
    second = _module()
    second[2] = torch.nn.Linear(4, 1, dtype=torch.float64, device="meta")
    replicas = [
        (_model(), _batches(), None),
        (lamploop.SupervisedModel(second, lamploop.mse_loss), _batches(), None),
    ]
    with pytest.raises(ConfigurationError) as raised:
        _local(replicas)
    assert "meta" in str(raised.value) or "device" in str(raised.value), str(raised.value)


@pytest.mark.timeout(90)
def test_local_init_state_of_another_model_is_a_lamploop_error_naming_the_tensor(tmp_path: Path) -> None:
    """checkpoints.md "Resuming": "`local_data_parallel_training_loop` take
    `init_state=checkpoint.state` (they load the model, optimizer and best model themselves)".
    A checkpoint of a model with 5 hidden units, loaded without ``model=``, handed to replicas
    with 4: a lamploop error naming the tensor that differs, not torch's RuntimeError from
    ``load_state_dict`` ("size mismatch for 0.weight")."""
    other = _module(hidden=5)
    state = LoopStateWithModelAndOptimizerData(
        LoopState(epoch=1), model=other.state_dict(), optimizer=_sgd(other.parameters()).state_dict()
    )
    save_checkpoint(tmp_path, state)
    checkpoint = load_checkpoint(tmp_path)
    error = _raised(lambda: _local(_pair(), max_epochs=2, init_state=checkpoint.state))
    assert isinstance(error, LamploopError), repr(error)
    assert "0.weight" in str(error), str(error)


LOCAL_BAD_KEYWORDS = [
    pytest.param({"heartbeat_timeout": "4"}, "heartbeat_timeout", id="heartbeat_timeout-str"),
    pytest.param({"collective_timeout": math.nan}, "collective_timeout", id="collective_timeout-nan"),
    pytest.param({"bucket_cap_mb": -1.0}, "bucket_cap_mb", id="bucket_cap_mb-negative"),
    pytest.param({"precision": "fp8"}, "precision", id="precision-fp8"),
    pytest.param({"on_non_finite_loss": "ignore"}, "on_non_finite_loss", id="on_non_finite_loss-ignore"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("keywords", "word"), LOCAL_BAD_KEYWORDS)
def test_local_settings_of_the_wrong_type_are_refused_naming_them(
    keywords: dict[str, Any], word: str
) -> None:
    """local_data_parallel_training_loop's docstring: the other arguments are those of
    ``drive_distributed_training`` ... "ConfigurationError: ... an unknown keyword"; the brief of
    every entry point: bad inputs are lamploop errors naming what is wrong. Each bad setting: a
    ConfigurationError naming it, before any replica trains."""
    with pytest.raises(ConfigurationError) as raised:
        _local(_pair(), **keywords)
    assert word in str(raised.value), str(raised.value)


FIT_BAD_DEVICES = [
    pytest.param("cuda", id="cuda"),
    pytest.param("cuda:3", id="cuda-3"),
    pytest.param(0, id="int-0"),
    pytest.param(torch.device("meta"), id="meta"),
    pytest.param("mps", id="mps"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", FIT_BAD_DEVICES)
def test_fit_on_a_device_this_machine_lacks_is_a_configuration_error_naming_it(
    device: Any, no_launcher: None
) -> None:
    """fit's docstring: "device: where to train"; "Raises: lamploop.errors.LamploopError: any of
    its subclasses"; distributed.md: a device that a rank lacks "is refused, saying so". On a
    machine without CUDA (and MPS), ``fit(device=...)`` with such a device (or ``meta``) must be a
    ConfigurationError that names the device, not torch's AssertionError ("Torch not compiled
    with CUDA enabled") or a RuntimeError from deep inside."""
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    error = _raised(
        lambda: lamploop.fit(
            model=_model(),
            optimizer_factory=_sgd,
            train_batches=_batches(),
            max_epochs=1,
            device=device,
            reporters=[],
        )
    )
    assert isinstance(error, ConfigurationError), repr(error)
    assert "device" in str(error), str(error)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_fit_checkpoint_dir_that_is_a_file_is_a_lamploop_error_naming_it(
    where: str, tmp_path: Path, no_launcher: None
) -> None:
    """fit's docstring: "checkpoint_dir: write a checkpoint after every epoch there"; "Raises:
    lamploop.errors.LamploopError: any of its subclasses". A ``checkpoint_dir`` that is an
    existing regular file (or lies under one) cannot hold checkpoints: a lamploop error naming
    the path, not a raw ``FileExistsError``/``NotADirectoryError``."""
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    directory = afile if where == "a-file" else afile / "checkpoints"
    error = _raised(
        lambda: lamploop.fit(
            model=_model(),
            optimizer_factory=_sgd,
            train_batches=_batches(),
            max_epochs=1,
            device="cpu",
            reporters=[],
            checkpoint_dir=directory,
        )
    )
    assert isinstance(error, LamploopError), repr(error)
    assert "not-a-dir" in str(error), str(error)


@pytest.mark.timeout(90)
def test_fit_resume_with_a_truncated_newest_checkpoint_falls_back_and_trains_on_exactly(
    tmp_path: Path, no_launcher: None, caplog: pytest.LogCaptureFixture
) -> None:
    """checkpoints.md "Falls back": "`load_checkpoint(root)` loads the checkpoint `latest` names;
    if that one is missing or invalid (a bad sha256, a truncated file, ...), it logs a warning
    naming it and why, and loads the most recently saved valid one instead"; "Resuming": "training
    on from epoch k gives bitwise the same parameters as a run that was never interrupted".
    Two epochs with checkpoints, the newest's model file cut in half, then ``fit(max_epochs=3)``
    again: it resumes at epoch 1 (warning about epoch-000002), trains epochs 1 and 2, and its
    epoch 1 equals the first run's, bitwise."""
    directory = tmp_path / "ckpt"

    def run(max_epochs: int) -> LoopState:
        state = lamploop.fit(
            model=_model(),
            optimizer_factory=_sgd,
            train_batches=_batches(),
            validation_batches=_batches(rows=8),
            max_epochs=max_epochs,
            device="cpu",
            reporters=[],
            checkpoint_dir=directory,
        )
        assert state is not None
        return state

    first = run(2)
    newest = directory / "epoch-000002" / MODEL_FILE
    assert newest.exists(), sorted(p.name for p in directory.iterdir())
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        resumed = run(3)
    assert resumed.epoch == 3
    assert len(resumed.learning_curve) == 3
    assert resumed.learning_curve[:2] == first.learning_curve[:2], (first, resumed)
    assert any("epoch-000002" in record.getMessage() for record in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


# --------------------------------------------------------------------------------------------
# 3. streaming
# --------------------------------------------------------------------------------------------


async def _with_receiver(body: Callable[[tuple[str, int], FifoBuffer], Any], **receiver_kw: Any) -> Any:
    buffer = FifoBuffer(capacity=64, watermark=1, seed=0)
    with anyio.fail_after(30):
        async with SampleReceiver(buffer, token=TOKEN, **receiver_kw) as receiver:
            return await body(receiver.address, buffer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["async", "blocking"])
@pytest.mark.parametrize(
    "columns",
    [
        pytest.param(lambda: {"x": torch.zeros(0, 3), "y": torch.zeros(2)}, id="zero-rows-beside-two"),
        pytest.param(lambda: {"x": torch.zeros(2, 3), "y": torch.zeros(0)}, id="two-rows-beside-zero"),
    ],
)
def test_send_rows_zero_rows_beside_two_is_refused_and_sends_nothing(
    kind: str, columns: Callable[[], Any]
) -> None:
    """streaming.md: "columns with different numbers of rows, a 0-d column or a row too large for
    a frame are refused before anything is sent"; send_rows's docstring: "TypeError, ValueError:
    ``columns`` is not a non-empty mapping of str to tensors with one number of rows ...; nothing
    is kept". A column of 0 rows beside one of 2 has two numbers of rows: refused, no seq taken,
    and the producer goes on."""

    async def body(address: tuple[str, int], buffer: FifoBuffer) -> tuple[BaseException | None, int, int]:
        if kind == "async":
            async with AsyncProducer(address, name="sim", token=TOKEN, reconnect_timeout=10) as producer:
                try:
                    await producer.send_rows(columns())
                    refused = None
                except (TypeError, ValueError, LamploopError) as error:
                    refused = error
                seq_after = producer.next_seq
                await producer.send({"x": torch.ones(3), "y": torch.tensor(1.0)})
            return refused, seq_after, buffer.received

        def simulate() -> tuple[BaseException | None, int]:
            with BlockingProducer(address, name="sim", token=TOKEN, reconnect_timeout=10) as producer:
                try:
                    producer.send_rows(columns())
                    refused = None
                except (TypeError, ValueError, LamploopError) as error:
                    refused = error
                seq_after = producer.next_seq
                producer.send({"x": torch.ones(3), "y": torch.tensor(1.0)})
            return refused, seq_after

        refused, seq_after = await anyio.to_thread.run_sync(simulate)
        return refused, seq_after, buffer.received

    refused, seq_after, received = anyio.run(_with_receiver, body)
    assert refused is not None, "send_rows took columns of 0 and 2 rows"
    assert "'x'" in str(refused), str(refused)
    assert "'y'" in str(refused), str(refused)
    assert seq_after == 0
    assert received == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["async", "blocking"])
def test_send_rows_with_a_meta_column_is_refused_naming_it_and_the_producer_goes_on(kind: str) -> None:
    """streaming.md: each row is sent as a sample, "the same bytes as `send_many` of the rows would
    send"; send_rows's docstring: "TypeError, ValueError: ``columns`` is not a non-empty mapping
    of str to tensors ...; nothing is kept" (``send`` refuses a tensor on ``meta``, which has no
    bytes). A column on the ``meta`` device must be refused naming ``'x'``, with no seq taken and
    the producer still usable, not a NotImplementedError from the encoder."""

    columns = {"x": torch.zeros(3, 2, device="meta"), "y": torch.zeros(3)}

    async def body(address: tuple[str, int], buffer: FifoBuffer) -> tuple[BaseException | None, int, int]:
        if kind == "async":
            async with AsyncProducer(address, name="sim", token=TOKEN, reconnect_timeout=10) as producer:
                try:
                    await producer.send_rows(columns)
                    refused = None
                except Exception as error:  # what it is, the test looks at
                    refused = error
                seq_after = producer.next_seq
                await producer.send_rows({"x": torch.ones(2, 2), "y": torch.zeros(2)})
            return refused, seq_after, buffer.received

        def simulate() -> tuple[BaseException | None, int]:
            with BlockingProducer(address, name="sim", token=TOKEN, reconnect_timeout=10) as producer:
                try:
                    producer.send_rows(columns)
                    refused = None
                except Exception as error:
                    refused = error
                seq_after = producer.next_seq
                producer.send_rows({"x": torch.ones(2, 2), "y": torch.zeros(2)})
            return refused, seq_after

        refused, seq_after = await anyio.to_thread.run_sync(simulate)
        return refused, seq_after, buffer.received

    refused, seq_after, received = anyio.run(_with_receiver, body)
    assert refused is not None, "send_rows took a column on the meta device"
    assert isinstance(refused, (TypeError, ValueError, LamploopError)), repr(refused)
    assert "'x'" in str(refused), str(refused)
    assert "meta" in str(refused), str(refused)
    assert seq_after == 0
    assert received == 2


@pytest.mark.timeout(60)
def test_blocking_send_rows_into_an_own_thread_receiver_whose_buffer_closed_early_is_refused() -> None:
    """streaming.md "Who may send": "A sample that arrives after the buffer was closed (the
    producers were declared done) refuses its producer (`StreamingError: ... arrived after the
    trainer closed its buffer`) and never ends the run"; "Receiving off the training's thread":
    what the owner reads "is unchanged". A BlockingProducer's ``send_rows`` into a receiver on its
    own thread whose buffer was closed before any sample: the producer fails with that
    StreamingError within its bound, the receiver's block leaves without an error, and the
    buffer took nothing."""

    async def main() -> tuple[BaseException | None, int, int]:
        buffer = FifoBuffer(capacity=16, watermark=1, seed=0)
        with anyio.fail_after(40):
            async with SampleReceiver(buffer, token=TOKEN, own_thread=True) as receiver:
                buffer.close()

                def simulate() -> BaseException | None:
                    try:
                        with BlockingProducer(
                            receiver.address, name="late", token=TOKEN, reconnect_timeout=5
                        ) as producer:
                            producer.send_rows({"x": torch.arange(6.0).reshape(3, 2)})
                            producer.done()
                    except StreamingError as error:
                        return error
                    return None

                refused = await anyio.to_thread.run_sync(simulate)
                refusals = receiver.refusals
        return refused, refusals, buffer.received

    refused, refusals, received = anyio.run(main)
    assert refused is not None, "the late producer was not refused"
    assert "arrived after the trainer closed its buffer" in str(refused), str(refused)
    assert refusals >= 1
    assert received == 0
