"""Hostile inputs, round 7: several ranks on ONE machine, as a hostile or careless user meets them.

Written from the docs alone (DESIGN.md, docs/distributed.md, reliability.md, training.md,
cli.md, getting-started.md, loop.md and how-to/multi-node.md, how-to/resume.md), it covers:

- ``lamploop.fit(..., world_size=n)``'s arguments as a careless user gets them wrong (a
  ``world_size`` of 0, -1, a bool, a float or a str; a launch command that is not a list of
  str; a device or strategy that does not exist), which must be refused with a
  ``ConfigurationError`` naming the argument *before any rank is started* (a sentinel launch
  command would leave a file behind);
- the launch variables the docs list (``LAMPLOOP_RANK``/``LAMPLOOP_WORLD_SIZE``/
  ``LAMPLOOP_CONTROL``/``LAMPLOOP_TOKEN``, torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
  ``MASTER_*``, Slurm's ``SLURM_*`` with ``LAMPLOOP_TOKEN`` and ``LAMPLOOP_CONTROL_PORT``), set
  missing, malformed or contradictory around a script that calls ``fit``: the script must end
  within seconds with a ``ConfigurationError`` naming the variable, never a raw
  ``ValueError``/``KeyError`` and never a wait for a peer that cannot come;
- ``local_data_parallel_training_loop`` given replicas that do not fit (not triples, bare
  modules, one model twice, models whose parameters differ in shape, number or in which are
  frozen, a replica on the meta device, one replica whose stream raises or yields an empty,
  NaN or malformed batch, or is a plain iterator), bad counts and keywords; and its positive
  promises about uneven streams (no hang, no example dropped: a replica with no batch at all
  trains like the other one alone, to float tolerance) and frozen parameters alike everywhere;
- ``fit(world_size=2)`` whose launched rank exits 0 or 3 or is SIGKILLed before it joins (an
  in-process root: it must name rank 1 and the status at once, not after the 60 s join timeout);
- real 2-rank runs of a user's script (tests/workers/hostile_r7_worker.py) whose follower
  crashes at import, is SIGKILLed or SIGSTOPped mid-epoch, raises or yields an empty or NaN
  batch on its rank alone, or asks for other settings than the root (accumulation, strategy,
  world size, no validation, a frozen parameter); whose root is SIGKILLed or SIGSTOPped; whose
  root (or follower alone, or whole process group) gets SIGTERM / SIGINT mid-epoch, which must
  stop every rank at a step boundary with ``TrainingInterrupted`` and a checkpoint from which
  the same script resumes bitwise equal to an uninterrupted run; a Ctrl-C while the follower
  still starts; a second SIGTERM, which must end everything at once; and a script that calls
  ``fit`` twice in a row (getting-started.md's resume pattern);
- ``lamploop demo --world-size`` given a bad count (exit status 2 or 1, cli.md).

After every process scenario each pid the run started (every rank writes its own at start) must
be gone: no orphan. Every wait is bounded and every test carries ``pytest.mark.timeout``. Tiny
float64 models, CPU, Gloo, 127.0.0.1, 2 ranks at most. The five defects it found are fixed
(CHANGELOG): parameters frozen on one rank alone, a script calling ``fit`` twice under
``fit(world_size=n)``, a follower's error before it joined named by the root only as an exit
status, and a replica's own error in ``local_data_parallel_training_loop`` now and then replaced
by the root's ``PeerLostError`` quoting it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support import WORKERS, free_port, wait_until

import lamploop
from lamploop.batches import BatchContext
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    DistributedError,
    LamploopError,
    NonFiniteLossError,
    PeerLostError,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/, for workers.warm_start
from workers import warm_start

WORKER = WORKERS / "hostile_r7_worker.py"
LAUNCH_PREFIXES = ("LAMPLOOP_", "SLURM_", "TORCHELASTIC_", "MASTER_", "GLOO_")
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
FEATURES = 3


# --------------------------------------------------------------------------------------------
# helpers: data, models, the launch environment
# --------------------------------------------------------------------------------------------


def _data(rows: int = 24, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    return x, x @ torch.tensor([[1.5], [-2.0], [0.5]], dtype=torch.float64)


def _module(hidden: int = 4, *, extra: bool = False, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(7)
    layers: list[torch.nn.Module] = [
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    ]
    if extra:
        layers.append(torch.nn.Linear(1, 1))
    return torch.nn.Sequential(*layers).to(dtype)


def _model(hidden: int = 4, **kw: Any) -> lamploop.SupervisedModel:
    return lamploop.SupervisedModel(_module(hidden, **kw), lamploop.mse_loss)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _batches(rows: int = 24, batch_size: int = 3) -> lamploop.BatchStreamFactory:
    x, y = _data(rows)
    return lamploop.tensor_batches(x, y, batch_size=batch_size, shuffle=False)


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_NAMES}
    if "LAMPLOOP_TEST_COLD_START" in os.environ:
        env["LAMPLOOP_TEST_COLD_START"] = os.environ["LAMPLOOP_TEST_COLD_START"]
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's variable in this process while ``fit`` runs in it."""
    for name in list(os.environ):
        if (name.startswith(LAUNCH_PREFIXES) and name != "LAMPLOOP_TEST_COLD_START") or name in LAUNCH_NAMES:
            monkeypatch.delenv(name)


def _alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is still a live (not zombie) process running ``marker`` in its command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rpartition(")")[2].split()[0]
    return marker in cmdline and state not in ("Z", "X")


# --------------------------------------------------------------------------------------------
# a user's script on several ranks (tests/workers/hostile_r7_worker.py)
# --------------------------------------------------------------------------------------------


class Run:
    """One start of the worker script: its config, its output folder, the pids its ranks wrote."""

    def __init__(self, base: Path, name: str, config: dict[str, Any], env: dict[str, str] | None = None):
        self.out = base / name
        self.out.mkdir(parents=True)
        self.config_path = base / f"{name}.json"
        self.config_path.write_text(json.dumps({"out": str(self.out), **config}))
        self.err = base / f"{name}.err"
        self.proc = warm_start.popen(
            [sys.executable, str(WORKER), str(self.config_path)],
            env=_clean_env() if env is None else env,
            stdout=subprocess.DEVNULL,
            stderr=self.err,
        )
        self.started = time.monotonic()

    def pids(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for path in self.out.glob("pid-*"):
            rank, _, pid = path.name.removeprefix("pid-").rpartition("-")
            found.setdefault(rank, []).append(int(pid))
        return found

    def all_pids(self) -> list[int]:
        return sorted({self.proc.pid, *(p for pids in self.pids().values() for p in pids)})

    def result(self, rank: int | str, call: int = 0) -> dict[str, Any] | None:
        path = self.out / f"result-{rank}-{call}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            msg = f"the script did not end within {timeout} s; stderr:\n{self.stderr()[-3000:]}"
            raise AssertionError(msg) from None

    def wait_for(self, name: str, timeout: float) -> None:
        wait_until(lambda: (self.out / name).exists(), timeout=timeout, what=f"{self.out / name}")

    def alive(self) -> list[int]:
        return [pid for pid in self.all_pids() if _alive(pid, str(self.config_path))]

    def assert_all_gone(self, within: float) -> None:
        """Every process this run started has ended within ``within`` seconds: no orphan."""
        deadline = time.monotonic() + within
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.alive()
        assert not left, f"processes left behind: {left} (ranks: {self.pids()})"

    def kill_leftovers(self) -> None:
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """``start(name, config, env=None)``: a Run; whatever it left is SIGKILLed at teardown (by pid)."""
    runs: list[Run] = []

    def make(name: str, config: dict[str, Any], env: dict[str, str] | None = None) -> Run:
        run = Run(tmp_path, name, config, env)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.kill_leftovers()


def _ok(result: dict[str, Any] | None) -> dict[str, Any]:
    assert result is not None, "the rank wrote no result"
    assert result["ok"], f"the rank failed: {result}"
    return result


def _failed(result: dict[str, Any] | None, cls: type[BaseException]) -> dict[str, Any]:
    assert result is not None, "the rank wrote no result"
    assert not result["ok"], f"the rank succeeded: {result}"
    assert cls.__name__ in result["classes"], f"not a {cls.__name__}: {result['type']}: {result['message']}"
    return result


# --------------------------------------------------------------------------------------------
# fit's arguments for several ranks, refused before any rank starts
# --------------------------------------------------------------------------------------------


def _fit(sentinel: Path, **changes: Any) -> Any:
    keywords: dict[str, Any] = {
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "max_epochs": 1,
        "device": "cpu",
        "reporters": [],
        "world_size": 2,
        "launch_command": [sys.executable, "-c", f"open({str(sentinel)!r}, 'w').close()"],
    }
    keywords.update(changes)
    return lamploop.fit(**keywords)


def fit_case(name: str, changes: Callable[[Path], dict[str, Any]], pattern: str) -> Any:
    return pytest.param(changes, pattern, id=name)


FIT_CASES = [
    fit_case("world_size 0", lambda _: {"world_size": 0}, r"world_size.*\b0\b"),
    fit_case("world_size -1", lambda _: {"world_size": -1}, r"world_size.*-1"),
    fit_case("world_size True", lambda _: {"world_size": True}, r"world_size.*True"),
    fit_case("world_size 2.0", lambda _: {"world_size": 2.0}, r"world_size.*2\.0"),
    fit_case("world_size '2'", lambda _: {"world_size": "2"}, r"world_size.*'2'"),
    fit_case(
        "launch_command with an int",
        lambda _: {"launch_command": [sys.executable, 5]},
        r"launch_command.*5",
    ),
    fit_case("device cuda without CUDA", lambda _: {"device": "cuda"}, r"cuda"),
    fit_case("device a list of two", lambda _: {"device": ["cpu", "cpu"]}, r"device.*\['cpu', 'cpu'\]"),
    fit_case("strategy unknown", lambda _: {"strategy": "ring_of_fire"}, r"strategy.*ring_of_fire"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("changes", "pattern"), FIT_CASES)
def test_fit_for_several_ranks_refuses_a_bad_argument_before_any_rank_starts(
    tmp_path: Path, no_launcher: None, changes: Callable[[Path], dict[str, Any]], pattern: str
) -> None:
    """training.md "Usability checks": fit checks before anything starts and raises
    ConfigurationError saying what to pass (world_size below 1 among them); errors.py: each
    message names the offending value."""
    sentinel = tmp_path / "a-rank-was-started"
    began = time.monotonic()
    with pytest.raises(ConfigurationError) as caught:
        _fit(sentinel, **changes(tmp_path))
    assert re.search(pattern, str(caught.value)), str(caught.value)
    assert time.monotonic() - began < 20
    time.sleep(0.2)
    assert not sentinel.exists(), "a rank was started before the arguments were checked"


# --------------------------------------------------------------------------------------------
# fit(world_size=2) with a launch command whose rank never joins: the root names it at once
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "status"),
    [
        pytest.param("pass", r"status 0\b", id="exits 0 without calling fit"),
        pytest.param("raise SystemExit(3)", r"status 3\b", id="exits 3"),
        pytest.param(
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", r"status -9|SIGKILL", id="SIGKILLed"
        ),
    ],
)
def test_a_launched_rank_that_ends_before_it_joins_fails_the_root_at_once_naming_it(
    no_launcher: None, code: str, status: str
) -> None:
    """distributed.md: fit(world_size=n) supervises the ranks it starts: "a rank that fails fails
    the run"; it must not wait the 60 s join timeout for a process that is gone."""
    began = time.monotonic()
    with pytest.raises(LamploopError) as caught:
        lamploop.fit(
            model=_model(),
            optimizer_factory=_sgd,
            train_batches=_batches(),
            max_epochs=1,
            device="cpu",
            reporters=[],
            world_size=2,
            launch_command=[sys.executable, "-c", code],
        )
    took = time.monotonic() - began
    message = str(caught.value)
    assert re.search(r"rank 1", message), message
    assert re.search(status, message), message
    assert took < 20, f"the root noticed its rank 1 had ended after {took:.1f} s"


# --------------------------------------------------------------------------------------------
# launch variables: missing, malformed, contradictory
# --------------------------------------------------------------------------------------------


def env_case(name: str, env: dict[str, str], pattern: str, world_size: int | None = None) -> Any:
    return pytest.param(env, pattern, world_size, id=name)


TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0"}
OWN = {
    "LAMPLOOP_RANK": "1",
    "LAMPLOOP_WORLD_SIZE": "2",
    "LAMPLOOP_CONTROL": f"127.0.0.1:{free_port()}",  # nobody listens there
    "LAMPLOOP_TOKEN": "hostile-r7-token",
}
"""What fit(world_size=2) gives the rank it starts (distributed.md), to spoil one at a time."""
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_LOCALID": "0"}

ENV_CASES = [
    env_case("RANK without WORLD_SIZE", {"RANK": "1", **TORCHRUN}, r"WORLD_SIZE"),
    env_case("WORLD_SIZE=abc", {"RANK": "0", "WORLD_SIZE": "abc", **TORCHRUN}, r"WORLD_SIZE.*abc"),
    env_case("RANK=abc", {"RANK": "abc", "WORLD_SIZE": "2", **TORCHRUN}, r"RANK.*abc"),
    env_case("RANK=2 of WORLD_SIZE=2", {"RANK": "2", "WORLD_SIZE": "2", **TORCHRUN}, r"RANK.*2.*WORLD_SIZE"),
    env_case(
        "LOCAL_RANK=abc",
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "abc"},
        r"LOCAL_RANK.*abc",
    ),
    env_case(
        "WORLD_SIZE=2 but fit(world_size=3)",
        {"RANK": "0", "WORLD_SIZE": "2", **TORCHRUN},
        r"world_size=3.*\(torchrun\) started 2 ranks",
        world_size=3,
    ),
    env_case(
        "MASTER_PORT=abc",
        {"RANK": "1", "WORLD_SIZE": "2", **TORCHRUN, "MASTER_PORT": "abc"},
        r"MASTER_PORT.*abc",
    ),
    env_case("LAMPLOOP_RANK=abc", {**OWN, "LAMPLOOP_RANK": "abc"}, r"LAMPLOOP_RANK.*abc"),
    env_case("LAMPLOOP_WORLD_SIZE=abc", {**OWN, "LAMPLOOP_WORLD_SIZE": "abc"}, r"LAMPLOOP_WORLD_SIZE.*abc"),
    env_case(
        "LAMPLOOP_WORLD_SIZE=2 but fit(world_size=3)",
        OWN,
        r"world_size=3.*\(lamploop\) started 2 ranks",
        world_size=3,
    ),
    env_case(
        "LAMPLOOP_RANK=5 of 2",
        {
            "LAMPLOOP_RANK": "5",
            "LAMPLOOP_WORLD_SIZE": "2",
            "LAMPLOOP_CONTROL": "127.0.0.1:1",
            "LAMPLOOP_TOKEN": "t",
        },
        r"LAMPLOOP_RANK.*5",
    ),
    env_case(
        "LAMPLOOP_CONTROL garbage",
        {
            "LAMPLOOP_RANK": "1",
            "LAMPLOOP_WORLD_SIZE": "2",
            "LAMPLOOP_CONTROL": "%%garbage%%",
            "LAMPLOOP_TOKEN": "t",
        },
        r"LAMPLOOP_CONTROL.*garbage",
    ),
    env_case(
        "LAMPLOOP_RANK without LAMPLOOP_CONTROL",
        {"LAMPLOOP_RANK": "1", "LAMPLOOP_WORLD_SIZE": "2", "LAMPLOOP_TOKEN": "t"},
        r"LAMPLOOP_CONTROL",
    ),
    env_case(
        "Slurm without LAMPLOOP_TOKEN",
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **SLURM},
        r"LAMPLOOP_TOKEN",
    ),
    env_case(
        "Slurm with an empty LAMPLOOP_TOKEN",
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **SLURM, "LAMPLOOP_TOKEN": ""},
        r"LAMPLOOP_TOKEN",
    ),
    env_case(
        "SLURM_PROCID=abc",
        {"SLURM_PROCID": "abc", "SLURM_NTASKS": "2", **SLURM, "LAMPLOOP_TOKEN": "t"},
        r"SLURM_PROCID.*abc",
    ),
    env_case(
        "SLURM_PROCID=2 of 2",
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "2", **SLURM, "LAMPLOOP_TOKEN": "t"},
        r"SLURM_PROCID.*2",
    ),
    env_case(
        "LAMPLOOP_CONTROL_PORT=abc under Slurm",
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            **SLURM,
            "LAMPLOOP_TOKEN": "t",
            "LAMPLOOP_CONTROL_PORT": "abc",
        },
        r"LAMPLOOP_CONTROL_PORT.*abc",
    ),
    env_case(
        "LAMPLOOP_CONTROL_PORT=70000 under Slurm",
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            **SLURM,
            "LAMPLOOP_TOKEN": "t",
            "LAMPLOOP_CONTROL_PORT": "70000",
        },
        r"LAMPLOOP_CONTROL_PORT.*70000",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("env", "pattern", "world_size"), ENV_CASES)
def test_a_malformed_or_contradictory_launch_variable_is_refused_naming_it(
    start: Callable[..., Run], env: dict[str, str], pattern: str, world_size: int | None
) -> None:
    """distributed.md / multi-node.md: fit reads these variables and decides root or follower;
    errors.py: a bad argument is a ConfigurationError naming the value and where it came from.
    A careful user of PyTorch expects no raw ValueError("invalid literal for int()") and no wait
    for a peer that the variables cannot describe."""
    run = start("env", {"world_size": world_size, "epochs": 1}, env=_clean_env(**env))
    status = run.wait(timeout=30)
    result = run.result(next(iter(run.pids())))
    assert status == 1, f"status {status}; {result}; stderr: {run.stderr()[-1500:]}"
    failure = _failed(result, ConfigurationError)
    assert re.search(pattern, failure["message"]), failure["message"]
    assert time.monotonic() - run.started < 25
    run.assert_all_gone(within=5)


@pytest.mark.timeout(60)
def test_torchrun_variables_of_a_single_rank_train_as_one_rank(start: Callable[..., Run]) -> None:
    """The positive control of the sweep above: RANK=0, WORLD_SIZE=1 (torchrun --nproc-per-node 1)
    is a run of one rank; fit returns the state."""
    run = start(
        "one", {"world_size": None, "epochs": 1}, env=_clean_env(RANK="0", WORLD_SIZE="1", **TORCHRUN)
    )
    assert run.wait(timeout=40) == 0, run.stderr()[-2000:]
    result = run.result("0")
    assert _ok(result)["returned"]["epoch"] == 1, result


# --------------------------------------------------------------------------------------------
# local_data_parallel_training_loop
# --------------------------------------------------------------------------------------------


def _local(replicas: Any, max_epochs: Any = 1, optimizer_factory: Any = _sgd, **keywords: Any) -> Any:
    return anyio.run(
        lambda: lamploop.local_data_parallel_training_loop(
            replicas, optimizer_factory, max_epochs, **keywords
        )
    )


def _pair(train: Any = None, **model: Any) -> list[tuple[Any, Any, Any]]:
    """Two replicas without validation, the second given ``train`` (default: the plain batches)
    and a model made with ``model``'s changes."""
    return [(_model(), _batches(), None), (_model(**model), _batches() if train is None else train, None)]


def _empty_factory(context: BatchContext) -> Any:
    async def stream() -> AsyncIterator[Any]:
        return
        yield

    return stream()


def _faulty(kind: str) -> lamploop.BatchStreamFactory:
    """The plain batches with a fault at the second batch of epoch 0 (on the replica that has it)."""
    plain = _batches()

    def factory(context: BatchContext) -> Any:
        if kind == "plain generator":
            return iter([])

        async def stream() -> AsyncIterator[Any]:
            index = 0
            async for features, target in plain(context):
                if index == 1:
                    if kind == "raise":
                        raise RuntimeError("hostile_r7: replica stream broke on purpose")
                    if kind == "empty":
                        features, target = features[:0], target[:0]
                    elif kind == "nan":
                        features = torch.full_like(features, math.nan)
                    elif kind == "triple":
                        yield features, target, target
                        continue
                    elif kind == "bare tensor":
                        yield features
                        continue
                    elif kind == "sizes":
                        target = target[:1]
                yield features, target
                index += 1

        return stream()

    return factory


def local_case(name: str, call: Callable[[], Any], error: Any, pattern: str) -> Any:
    return pytest.param(call, error, pattern, id=name)


LOCAL_CASES = [
    local_case("no replicas", lambda: _local([]), ConfigurationError, r"models_with_data_streams is empty"),
    local_case(
        "one triple, not a list of them",
        lambda: _local((_model(), _batches(), None)),
        ConfigurationError,
        r"models_with_data_streams",
    ),
    local_case(
        "a bare module",
        lambda: _local([(_module(), _batches(), None), (_model(), _batches(), None)]),
        ConfigurationError,
        r"SupervisedModel",
    ),
    local_case(
        "one SupervisedModel twice",
        lambda: (lambda m: _local([(m, _batches(), None), (m, _batches(), None)]))(_model()),
        ConfigurationError,
        r"share|same",
    ),
    local_case(
        "tensors as the batch factory",
        lambda: _local([(_model(), _data()[0], None), (_model(), _batches(), None)]),
        ConfigurationError,
        r"tensor_batches|Tensor",
    ),
    local_case(
        "an optimizer, not a factory",
        lambda: _local(_pair(), optimizer_factory=torch.optim.SGD(_module().parameters(), lr=0.1)),
        ConfigurationError,
        r"optimizer_factory|factory",
    ),
    local_case(
        "max_epochs -1", lambda: _local(_pair(), max_epochs=-1), ConfigurationError, r"max_epochs.*-1"
    ),
    local_case(
        "max_epochs True", lambda: _local(_pair(), max_epochs=True), ConfigurationError, r"max_epochs.*True"
    ),
    local_case(
        "accumulation 0",
        lambda: _local(_pair(), accumulate_gradient_over_n_batches=0),
        ConfigurationError,
        r"accumulate_gradient_over_n_batches.*0",
    ),
    local_case(
        "an unknown keyword",
        lambda: _local(_pair(), world_size=2),
        ConfigurationError,
        r"world_size",
    ),
    local_case(
        "a replica with another hidden size",
        lambda: _local(_pair(hidden=5)),
        DistributedError,
        r"rank 1.*'0\.weight'",
    ),
    local_case(
        "a replica with one more layer",
        lambda: _local(_pair(extra=True)),
        DistributedError,
        r"rank 1.*'3\.(weight|bias)'",
    ),
    local_case(
        "a replica on the meta device",
        lambda: _local(
            [(_model(), _batches(), None), (lamploop.SupervisedModel(_module().to("meta")), _batches(), None)]
        ),
        LamploopError,
        r"meta",
    ),
    local_case(
        "replica 1's stream raises",
        lambda: _local(_pair(train=_faulty("raise"))),
        (RuntimeError, LamploopError),  # the user's own error, or lamploop's quoting it
        r"replica stream broke on purpose",
    ),
    local_case(
        "replica 1 yields an empty batch", lambda: _local(_pair(train=_faulty("empty"))), BatchError, r"empty"
    ),
    local_case(
        "replica 1 yields a triple", lambda: _local(_pair(train=_faulty("triple"))), BatchError, r"pair|tuple"
    ),
    local_case(
        "replica 1 yields features and targets of other sizes",
        lambda: _local(_pair(train=_faulty("sizes"))),
        BatchError,
        r"3.*1|size",
    ),
    local_case(
        "replica 1's factory returns a plain iterator",
        lambda: _local(_pair(train=_faulty("plain generator"))),
        ConfigurationError,
        r"rank 1 of 2.*not an async iterable",
    ),
    local_case(
        "only the root validates",
        lambda: _local([(_model(), _batches(), _batches()), (_model(), _batches(), None)]),
        ConfigurationError,
        r"rank 1.*validation_batches",
    ),
    local_case(
        "no replica has a batch",
        lambda: _local([(_model(), _empty_factory, None), (_model(), _empty_factory, None)]),
        BatchError,
        r"batch",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("call", "error", "pattern"), LOCAL_CASES)
def test_local_data_parallel_refuses_replicas_that_do_not_fit(
    call: Callable[[], Any], error: Any, pattern: str
) -> None:
    """distributed.md "One process, several devices" and the function's Raises: a replica that is
    not a triple, two replicas sharing a module, models that differ (naming the rank and the
    tensor), and the first error of any replica, which ends every replica within seconds
    (reliability.md: "an error in any replica (an empty batch, a NaN loss) ends every replica
    with that error in under a second").
"""
    expected = error if isinstance(error, tuple) else (error,)
    began = time.monotonic()
    with pytest.raises(expected) as caught:
        call()
    message = f"{type(caught.value).__name__}: {caught.value}"
    assert re.search(pattern, str(caught.value), re.S), message
    assert time.monotonic() - began < 20


@pytest.mark.timeout(150)
def test_local_data_parallel_raises_the_failing_replicas_own_error_every_time() -> None:
    """The empty batch on replica 1, 60 times: each time the BatchError itself, as documented
    (reliability.md), never the PeerLostError that it causes on replica 0."""
    for attempt in range(60):
        with pytest.raises(LamploopError) as caught:
            _local(_pair(train=_faulty("empty")))
        kind = type(caught.value).__name__
        assert isinstance(caught.value, BatchError), f"attempt {attempt}: {kind}: {caught.value}"


@pytest.mark.timeout(60)
def test_local_data_parallel_nan_on_one_replica_names_that_rank() -> None:
    """reliability.md: NonFiniteLossError names the epoch, the step and every rank whose loss was bad."""
    with pytest.raises(NonFiniteLossError) as caught:
        _local(_pair(train=_faulty("nan")))
    assert caught.value.ranks == (1,), caught.value.ranks
    assert (caught.value.epoch, caught.value.step) == (0, 1)


@pytest.mark.timeout(60)
def test_local_data_parallel_with_one_replica_out_of_batches_trains_like_the_other_alone() -> None:
    """DESIGN.md 3 "Uneven streams": a rank whose stream is exhausted contributes zero examples;
    no example is dropped and nothing hangs. A replica with no batch at all thus trains exactly
    like the other replica alone, on its own batches (to float tolerance)."""
    x, y = _data()
    mine = lamploop.tensor_batches(x, y, batch_size=3, shuffle=False)

    def first_replica(context: BatchContext) -> Any:  # the whole data, whatever rank it runs as
        return mine(BatchContext(epoch=context.epoch, rank=0, nranks=1))

    replicas = [(_model(), first_replica, None), (_model(), _empty_factory, None)]
    state = _local(replicas, max_epochs=2)
    assert state.epoch == 2
    alone = _model()
    lamploop.fit(
        model=alone,
        optimizer_factory=_sgd,
        train_batches=first_replica,
        max_epochs=2,
        device="cpu",
        reporters=[],
        world_size=1,
    )
    for a, b in zip(replicas[0][0].module.parameters(), alone.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_local_data_parallel_with_uneven_streams_finishes() -> None:
    """DESIGN.md 3: lamp hangs on uneven streams; here both replicas finish the epochs."""
    replicas = [(_model(), _batches(rows=24), None), (_model(), _batches(rows=6), None)]
    state = _local(replicas, max_epochs=2)
    assert (state.epoch, len(state.learning_curve)) == (2, 2)


@pytest.mark.timeout(60)
def test_local_data_parallel_with_the_same_parameter_frozen_everywhere_trains_and_keeps_it() -> None:
    """The positive control of the next test: replicas that freeze the same parameter (fine-tuning,
    as DistributedDataParallel allows) train, and the frozen parameter stays as it was."""
    replicas = [(_model(), _batches(), None), (_model(), _batches(), None)]
    for model, _, _ in replicas:
        model.module.get_parameter("0.weight").requires_grad_(False)
    before = replicas[0][0].module.get_parameter("0.weight").detach().clone()
    state = _local(replicas, max_epochs=2)
    assert state.epoch == 2
    assert torch.equal(replicas[0][0].module.get_parameter("0.weight"), before)
    trained = replicas[0][0].module.get_parameter("2.weight")
    assert not torch.equal(trained, _module().get_parameter("2.weight"))


@pytest.mark.timeout(90)
def test_local_replicas_that_freeze_different_parameters_fail_naming_the_tensor(
    start: Callable[..., Run],
) -> None:
    """distributed.md: the ranks check they agree on the model before training; a careful PyTorch
    user expects a replica whose parameters differ in what is trained to be refused with a
    lamploop error naming the tensor, never a process killed by an abort in Gloo. In a process of
    its own (an abort would end pytest)."""
    run = start(
        "frozen-local", {"mode": "local", "epochs": 2, "ranks": {"1": {"fit": {"freeze": "0.weight"}}}}
    )
    code = run.wait(timeout=45)
    path = run.out / "result-local.json"
    result = json.loads(path.read_text()) if path.exists() else None
    assert code == 1, f"status {code}; {result}; stderr: {run.stderr()[:600]}"
    failure = _failed(result, LamploopError)
    assert re.search(r"0\.weight", failure["message"]), failure["message"]


# --------------------------------------------------------------------------------------------
# real runs of two ranks: fit(world_size=2) in a user's script
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_params(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The parameters of an uninterrupted 2-rank run of the worker (3 epochs), as float.hex."""
    base = tmp_path_factory.mktemp("reference")
    run = Run(base, "reference", {"world_size": 2, "epochs": 3})
    try:
        assert run.wait(timeout=90) == 0, run.stderr()[-2000:]
        result = run.result("0")
        _ok(result)
        return list(result["params"])
    finally:
        run.kill_leftovers()


@pytest.mark.timeout(120)
def test_a_plain_two_rank_run_returns_the_state_on_the_root_and_none_on_the_follower(
    start: Callable[..., Run], reference_params: list[str]
) -> None:
    """contract-changes.md: fit(world_size=n) returns None on follower ranks; both exit 0."""
    run = start("plain", {"world_size": 2, "epochs": 3})
    assert run.wait(timeout=60) == 0, run.stderr()[-2000:]
    root, follower = run.result("0"), run.result("1")
    assert _ok(root)["returned"]["epoch"] == 3, root
    assert _ok(follower)["returned"] is None, follower
    assert root["params"] == reference_params, "two identical runs differ"
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("before_fit", "status"),
    [
        pytest.param("import_crash", r"status 1\b", id="crashes at import"),
    ],
)
def test_a_follower_that_ends_before_fit_fails_the_root_promptly_naming_it(
    start: Callable[..., Run], before_fit: str, status: str
) -> None:
    """distributed.md: fit supervises the ranks it starts, "a rank that fails fails the run";
    reliability.md: the root names a follower's exit status. Not a wait for the 60 s join
    timeout, and never a silent success of the root alone."""
    run = start(before_fit, {"world_size": 2, "epochs": 2, "ranks": {"1": {"before_fit": before_fit}}})
    code = run.wait(timeout=45)
    took = time.monotonic() - run.started
    failure = _failed(run.result("0"), LamploopError)
    assert code == 1
    assert re.search(r"rank 1", failure["message"]), failure["message"]
    assert re.search(status, failure["message"]), failure["message"]
    assert took < 25, f"the root took {took:.1f} s to notice"
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
def test_a_follower_sigkilled_mid_epoch_ends_the_root_at_once_naming_it(start: Callable[..., Run]) -> None:
    """reliability.md: SIGKILL of a follower: PeerLostError(rank=that follower) in 0.0-0.1 s; the
    failed run's process exits with status 1 at once."""
    fault = {"kind": "sigkill", "epoch": 1, "batch": 1}
    run = start("sigkill", {"world_size": 2, "epochs": 3, "delay": 0.05, "ranks": {"1": {"fault": fault}}})
    run.wait_for("struck-1", timeout=45)
    struck = time.monotonic()
    assert run.wait(timeout=20) == 1
    assert time.monotonic() - struck < 8
    failure = _failed(run.result("0"), PeerLostError)
    assert failure["attributes"]["rank"] == 1, failure
    assert failure["attributes"]["how"] in ("died", "closed"), failure
    run.assert_all_gone(within=5)


@pytest.mark.timeout(90)
def test_a_follower_sigstopped_mid_epoch_is_named_silent_and_not_left_behind(
    start: Callable[..., Run],
) -> None:
    """reliability.md: a frozen follower: PeerLostError(rank=1, how="silent") within 5 s of the
    fault; distributed.md: "leaving kills them", so the stopped process does not outlive the run."""
    fault = {"kind": "sigstop", "epoch": 1, "batch": 1}
    run = start("sigstop", {"world_size": 2, "epochs": 3, "delay": 0.05, "ranks": {"1": {"fault": fault}}})
    run.wait_for("struck-1", timeout=45)
    struck = time.monotonic()
    assert run.wait(timeout=30) == 1
    assert time.monotonic() - struck < 12
    failure = _failed(run.result("0"), PeerLostError)
    assert (failure["attributes"]["rank"], failure["attributes"]["how"]) == (1, "silent"), failure
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
def test_the_root_sigkilled_mid_epoch_ends_its_follower_naming_rank_0(start: Callable[..., Run]) -> None:
    """reliability.md: SIGKILL of the root: PeerLostError(rank=0) on every follower at once."""
    fault = {"kind": "marker", "epoch": 1, "batch": 1}
    run = start("rootkill", {"world_size": 2, "epochs": 3, "delay": 0.3, "ranks": {"0": {"fault": fault}}})
    run.wait_for("marker-0", timeout=45)
    os.kill(run.proc.pid, signal.SIGKILL)
    wait_until(lambda: run.result("1") is not None, timeout=15, what="the follower's error")
    failure = _failed(run.result("1"), PeerLostError)
    assert failure["attributes"]["rank"] == 0, failure
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
def test_the_root_sigstopped_is_named_silent_and_once_continued_ends_too(start: Callable[..., Run]) -> None:
    """reliability.md: a frozen root: PeerLostError(rank=0, how="silent") on the follower within 5 s;
    the root, continued afterwards, finds its follower gone and ends (no hang, no orphan)."""
    fault = {"kind": "marker", "epoch": 1, "batch": 1}
    run = start("rootstop", {"world_size": 2, "epochs": 3, "delay": 0.3, "ranks": {"0": {"fault": fault}}})
    run.wait_for("marker-0", timeout=45)
    os.kill(run.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until(lambda: run.result("1") is not None, timeout=15, what="the follower's error")
        assert time.monotonic() - stopped < 10
    finally:
        os.kill(run.proc.pid, signal.SIGCONT)
    failure = _failed(run.result("1"), PeerLostError)
    assert (failure["attributes"]["rank"], failure["attributes"]["how"]) == (0, "silent"), failure
    assert run.wait(timeout=20) == 1
    _failed(run.result("0"), LamploopError)
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("kind", "pattern", "follower_error"),
    [
        pytest.param("raise", r"broke on purpose", LamploopError, id="stream raises"),
        pytest.param("empty", r"empty", BatchError, id="empty batch"),
    ],
)
def test_a_fault_in_the_followers_stream_alone_ends_the_root_as_aborted_with_its_message(
    start: Callable[..., Run], kind: str, pattern: str, follower_error: type[BaseException]
) -> None:
    """reliability.md: an error that one rank finds alone is raised on the others at once as
    PeerLostError(rank=that rank, how="aborted"), with its message."""
    fault = {"kind": kind, "epoch": 1, "batch": 1}
    run = start(kind, {"world_size": 2, "epochs": 3, "ranks": {"1": {"fault": fault}}})
    assert run.wait(timeout=45) == 1
    failure = _failed(run.result("0"), PeerLostError)
    assert (failure["attributes"]["rank"], failure["attributes"]["how"]) == (1, "aborted"), failure
    assert re.search(pattern, failure["message"]), failure["message"]
    own = run.result("1")
    if own is not None and kind == "empty":  # the follower's own error, when it got to write it
        _failed(own, follower_error)
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
def test_a_nan_on_the_follower_alone_is_a_non_finite_loss_error_on_every_rank(
    start: Callable[..., Run],
) -> None:
    """reliability.md: a NaN loss is detected by every rank itself, and every rank raises
    NonFiniteLossError naming the rank whose loss was bad, not the abort it causes."""
    fault = {"kind": "nan", "epoch": 1, "batch": 0}
    run = start("nan", {"world_size": 2, "epochs": 3, "ranks": {"1": {"fault": fault}}})
    assert run.wait(timeout=45) == 1
    for rank in ("0", "1"):
        failure = _failed(run.result(rank), NonFiniteLossError)
        assert (failure["attributes"]["ranks"], failure["attributes"]["epoch"]) == ([1], 1), failure
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        pytest.param(
            {"accumulate": 2}, LamploopError, r"accumulate_gradient_over_n_batches", id="accumulation"
        ),
        pytest.param({"strategy": "reduce_to_root"}, DistributedError, r"reduce_to_root", id="strategy"),
        pytest.param(
            {"world_size": 3},
            LamploopError,
            r"world_size=3",
            id="world_size",
        ),
        pytest.param({"validation": False}, LamploopError, r"validation_batches", id="no validation"),
        pytest.param(
            {"freeze": "0.weight"},
            LamploopError,
            r"0\.weight",
            id="a parameter frozen on the follower alone",
        ),
    ],
)
def test_a_follower_that_asks_for_other_settings_fails_both_ranks_at_start_saying_what(
    start: Callable[..., Run], change: dict[str, Any], error: type[BaseException], pattern: str
) -> None:
    """multi-node.md: every rank must hold the same model and per-rank settings; a rank that asks
    for another strategy fails the run at start (distributed.md: DistributedError naming what
    each rank asked for); a follower without validation batches whose root validates raises a
    ConfigurationError saying so. The root's error must say what differed too."""
    run = start("differs", {"world_size": 2, "epochs": 2, "ranks": {"1": {"fit": change}}})
    assert run.wait(timeout=45) == 1
    root = _failed(run.result("0"), error)
    assert re.search(pattern, root["message"]), root["message"]
    follower = run.result("1")
    if follower is not None:
        _failed(follower, LamploopError)
    assert time.monotonic() - run.started < 30
    run.assert_all_gone(within=10)


@pytest.mark.timeout(120)
def test_a_script_that_calls_fit_twice_in_a_row_resumes_promptly(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """getting-started.md: calling fit again with the same checkpoint_dir and a larger max_epochs
    trains only the new epochs; distributed.md: with world_size=2 the same command line runs again
    as rank 1. Both calls must end promptly (each is two ranks training one tiny epoch), every
    process gone, and the second call must have resumed (its curve holds both epochs)."""
    directory = tmp_path / "ckpt"
    run = start("twice", {"world_size": 2, "epochs": 1, "fit_calls": 2, "checkpoint_dir": str(directory)})
    code = run.wait(timeout=30)
    first, second = run.result("0", 0), run.result("0", 1)
    assert code == 0, f"status {code}: {first}, {second}; {run.stderr()[-2000:]}"
    assert _ok(first)["returned"] == {"epoch": 1, "curve": 1}, first
    assert _ok(second)["returned"] == {"epoch": 2, "curve": 2}, second
    run.assert_all_gone(within=10)


def _step_checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if re.fullmatch(r"epoch-\d{6}-step-\d{6}", p.name))


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("target", "sig"),
    [
        pytest.param("root", signal.SIGTERM, id="SIGTERM to the root"),
        pytest.param("group", signal.SIGINT, id="SIGINT to the process group"),
        pytest.param("follower", signal.SIGTERM, id="SIGTERM to the follower alone"),
    ],
)
def test_a_stop_signal_mid_epoch_stops_every_rank_at_a_step_and_the_same_script_resumes_bitwise(
    start: Callable[..., Run], tmp_path: Path, reference_params: list[str], target: str, sig: signal.Signals
) -> None:
    """reliability.md "Stopping on request": SIGTERM or SIGINT on any rank stops every rank after
    the step in progress, the root writes a checkpoint at that step boundary and raises
    TrainingInterrupted (reason: the signal), a follower's fit returns None; the next run of the
    same command resumes at that step and ends bitwise equal to an uninterrupted run on CPU."""
    directory = tmp_path / "ckpt"
    config = {
        "world_size": 2,
        "epochs": 3,
        "delay": 0.3,
        "checkpoint_dir": str(directory),
        "ranks": {"0": {"fault": {"kind": "marker", "epoch": 1, "batch": 1}}},
    }
    run = start("stopped", config)
    run.wait_for("marker-0", timeout=45)
    if target == "root":
        os.kill(run.proc.pid, sig)
    elif target == "group":
        os.killpg(run.proc.pid, sig)
    else:
        os.kill(run.pids()["1"][0], sig)
    assert run.wait(timeout=20) == 1, run.stderr()[-2000:]
    stop = _failed(run.result("0"), lamploop.errors.TrainingInterrupted)
    assert stop["attributes"]["reason"] == sig.name, stop
    assert stop["attributes"]["epoch"] == 1, stop
    assert stop["attributes"]["steps_done"] >= 1, stop
    follower = run.result("1")
    assert _ok(follower)["returned"] is None, follower
    steps = _step_checkpoints(directory)
    done = stop["attributes"]["steps_done"]
    assert f"epoch-000001-step-{done:06d}" in steps, (steps, stop)
    run.assert_all_gone(within=10)

    config["delay"] = 0.0
    again = start("resumed", config)
    assert again.wait(timeout=60) == 0, again.stderr()[-2000:]
    resumed = again.result("0")
    assert _ok(resumed)["returned"]["epoch"] == 3, resumed
    assert resumed["params"] == reference_params, "the resumed run differs from the uninterrupted one"
    again.assert_all_gone(within=10)


@pytest.mark.timeout(90)
def test_a_ctrl_c_while_the_follower_still_starts_is_a_stop_not_a_lost_rank(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """reliability.md "before training starts": a Ctrl-C (SIGINT to the process group) reaches a
    follower that fit(world_size=n) started while it is still starting; the root takes that as the
    stop it is: TrainingInterrupted ("stopped by SIGINT before training started (rank 1 exited with
    status -2 (SIGINT) before it joined, ...)"), nothing written."""
    directory = tmp_path / "ckpt"
    run = start("early-ctrl-c", {"world_size": 2, "epochs": 2, "checkpoint_dir": str(directory)})
    wait_until(lambda: "1" in run.pids(), timeout=45, what="rank 1's start")
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.wait(timeout=20) == 1, run.stderr()[-2000:]
    stop = _failed(run.result("0"), lamploop.errors.TrainingInterrupted)
    assert stop["attributes"]["reason"] == "SIGINT", stop
    assert re.search(r"before training started", stop["message"]), stop["message"]
    assert not directory.exists() or not any(directory.iterdir()), sorted(directory.iterdir())
    run.assert_all_gone(within=10)


@pytest.mark.timeout(90)
def test_a_second_sigterm_ends_the_root_and_its_follower_at_once(start: Callable[..., Run]) -> None:
    """reliability.md: a second signal stops at once, and kills the followers at once."""
    config = {
        "world_size": 2,
        "epochs": 3,
        "delay": 0.4,
        "ranks": {"0": {"fault": {"kind": "marker", "epoch": 1, "batch": 0}}},
    }
    run = start("twice-signalled", config)
    run.wait_for("marker-0", timeout=45)
    os.kill(run.proc.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.kill(run.proc.pid, signal.SIGTERM)
    second = time.monotonic()
    code = run.wait(timeout=20)
    assert code != 0
    assert time.monotonic() - second < 5, "the second SIGTERM did not stop the root at once"
    run.assert_all_gone(within=3)


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("value", "status"), [("0", 1), ("-1", 1), ("abc", 2), ("1.5", 2)])
def test_lamploop_demo_refuses_a_bad_world_size_saying_so(tmp_path: Path, value: str, status: int) -> None:
    """cli.md's exit statuses: 2 for bad command-line arguments (not an int), 1 when "a setting is
    refused" (an int below 1), each with the reason on stderr."""
    code = (
        "import runpy, sys; "
        f"sys.argv = ['lamploop', 'demo', '--world-size', {value!r}, '--out', {str(tmp_path / 'out')!r}]; "
        "runpy.run_module('lamploop', run_name='__main__', alter_sys=True)"
    )
    done = warm_start.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=40
    )
    assert done.returncode == status, (done.returncode, done.stderr[-1500:])
    assert "world-size" in done.stderr or "world_size" in done.stderr, done.stderr[-1500:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
