"""Several ranks train like one: separate processes, real Gloo groups, the TCP control channel.

The reference for every multi-rank run is one rank (``drive_distributed_training`` with
``nranks=1, control=None``) trained on the union of the same batches: per optimizer step,
every rank's ``k`` batches of that step concatenated in rank order (DESIGN.md section 3).
Everything is float64, so parameters agree to ``atol=1e-6`` and losses to ``1e-9``.
Followers start from other weights than the root, so a follower that trained from its
own weights would show.

Starting a process that imports torch costs seconds, so one set of three worker
processes (``tests/workers/rank.py``) runs every multi-process case in turn, each on a
fresh control port, and the tests read what it wrote.  Resuming uses a second, fresh
pair of processes.  The refusals happen in the control handshake, before any tensor
work, so they run in-process: root and follower as tasks of one event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
import torch
from torch import nn
from workers import rank as worker  # tests/ is on sys.path: pytest puts conftest.py's folder there

import lamploop
from lamploop import ALL_EPOCHS, LoopState, SupervisedModel
from lamploop.checkpoint import load_checkpoint
from lamploop.control import TcpControlFollower, TcpControlRoot
from lamploop.distributed import (
    drive_distributed_training,
    follow_distributed_training,
    local_data_parallel_training_loop,
)
from lamploop.errors import HandshakeError
from lamploop.modelspec import model_spec

pytestmark = pytest.mark.slow

STRATEGIES = ("reduce_to_root", "all_reduce")
# SGD with momentum for one strategy, Adam for the other: optimizer state matters in both.
OPTIMIZERS = {
    "reduce_to_root": {"name": "sgd", "lr": 0.3, "momentum": 0.9},
    "all_reduce": {"name": "adam", "lr": 0.08},
}
EPOCHS = 3
PARAMS_ATOL = 1e-6  # and rtol=0
LOSS_TOL = 1e-9
FLEET_TIMEOUT_S = 200.0  # a bound for a loaded machine; idle, it takes a fraction


def equivalence_run(nranks: int, k: int, strategy: str) -> dict[str, Any]:
    return {
        "name": f"eq-{nranks}ranks-k{k}-{strategy}",
        "members": list(range(nranks)),
        "strategy": strategy,
        "k": k,
        "epochs": EPOCHS,
        # 5 batches per rank: with k=2 every epoch ends in the middle of an accumulation group.
        "data": {
            "seed": 100 + 10 * nranks + k,
            "batches": [5] * nranks,
            "valid_batches": 2,
            # With k=1 the validation loss rises (the best model is epoch 0's); with k=2 it
            # falls in some cases and not in others.
            "valid_class": 0 if k == 1 else None,
        },
        "model": {"seed": 1},
        "optimizer": OPTIMIZERS[strategy],
        "schedule": {"name": "decrement", "every": 1, "fraction": 0.5},
    }


def uneven_run(train: list[int], valid: list[int], k: int, strategy: str) -> dict[str, Any]:
    """Ranks with ``train[r]`` training and ``valid[r]`` validation batches."""
    run = equivalence_run(len(train), k, strategy)
    run["name"] = f"uneven-{'-'.join(map(str, train))}-k{k}-{strategy}"
    run["data"] = {"seed": 300 + k + len(train), "batches": train, "valid_batches": valid}
    return run


def resume_run(strategy: str, workdir: Path) -> dict[str, Any]:
    return {
        "name": f"resume-full-{strategy}",
        "members": [0, 1],
        "strategy": strategy,
        "k": 2,
        "epochs": 4,
        "data": {"seed": 400, "batches": [3, 4], "valid_batches": 2},
        "model": {"seed": 2},
        "optimizer": OPTIMIZERS[strategy],
        # A schedule with state: a resumed run must ask it what the uninterrupted one asked.
        "schedule": {"name": "plateau", "threshold": 0.02},
        "checkpoint_dir": str(workdir / f"checkpoints-{strategy}"),
    }


EQUIVALENCE_CASES = [(n, k, s) for n in (2, 3) for k in (1, 2) for s in STRATEGIES]
UNEVEN_CASES = [
    # Rank 1 has 3 training batches fewer, and 2 validation batches fewer.
    ([7, 4], [3, 1], 1, "reduce_to_root"),
    ([7, 4], [3, 1], 2, "all_reduce"),
    # Rank 1 has no batch at all; rank 2 runs out in the middle of an accumulation group.
    ([4, 0, 3], [2, 0, 1], 2, "reduce_to_root"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Every multi-process case; the work directories of the two process sets.

    Three workers run the equivalence, uneven and uninterrupted resume runs in turn.  A
    fresh pair, started at the same time so that its start-up overlaps theirs, waits for
    the uninterrupted runs and resumes each from its epoch-2 checkpoint.
    """
    workdir, resumed = tmp_path_factory.mktemp("fleet"), tmp_path_factory.mktemp("resumed")
    runs = [equivalence_run(*case) for case in EQUIVALENCE_CASES]
    runs += [uneven_run(*case) for case in UNEVEN_CASES]
    runs += [resume_run(s, workdir) for s in STRATEGIES]
    resumes = []
    for strategy in STRATEGIES:
        run = resume_run(strategy, workdir)
        run["name"] = f"resume-from-2-{strategy}"
        run["resume_from"] = str(Path(run.pop("checkpoint_dir")) / "epoch-000002")
        run["wait_for"] = str(workdir / f"resume-full-{strategy}" / "rank0.json")
        run["timeout"] = FLEET_TIMEOUT_S + 60  # it waits for the whole fleet
        resumes.append(run)
    with worker.Processes(workdir) as procs, worker.Processes(resumed) as fresh:
        procs.start_runs({"workdir": str(workdir), "runs": runs}, workdir / "runs.json", range(3))
        fresh.start_runs({"workdir": str(resumed), "runs": resumes}, resumed / "runs.json", range(2))
        codes = procs.wait_all(FLEET_TIMEOUT_S)
        assert codes == {"p0": 0, "p1": 0, "p2": 0}, procs.logs()
        codes = fresh.wait_all(60)
        assert codes == {"p0": 0, "p1": 0}, fresh.logs()
    return workdir, resumed


# --- the single-process reference --------------------------------------------------------------


async def reference(
    run: dict[str, Any],
) -> tuple[LoopState, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One rank on the union of every rank's batches: (state, final = best params, live params)."""
    nranks, k, data = len(run["members"]), run["k"], run["data"]
    module = worker.make_module(run["model"], 0)
    live: dict[str, torch.Tensor] = {}

    async def keep_live(state: lamploop.LoopStateWithModelAndOptimizerData, _: Any) -> None:
        live.update({name: t.detach().clone() for name, t in state.model.items()})

    state = await drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=SupervisedModel(module),
        optimizer_factory=worker.optimizer_factory(run["optimizer"]),
        train_batches=worker.stream_factory(lambda e, r: worker.union_train_batches(data, e, nranks, k)),
        validation_batches=worker.stream_factory(lambda e, r: worker.union_valid_batches(data, e, nranks)),
        max_epochs=run["epochs"],
        checkpoint_state=keep_live,
        return_min_validation_loss_model=ALL_EPOCHS,
        learning_rate_schedule=worker.make_schedule(run["schedule"]),
    )
    return state, module.state_dict(), live


def assert_same_curve(actual: LoopState, expected: LoopState, tol: float) -> None:
    assert actual.epoch == expected.epoch
    assert actual.min_validation_epoch == expected.min_validation_epoch
    assert [e.epoch for e in actual.learning_curve] == [e.epoch for e in expected.learning_curve]
    for a, e in zip(actual.learning_curve, expected.learning_curve, strict=True):
        assert a.training_loss == pytest.approx(e.training_loss, abs=tol, rel=0), f"epoch {e.epoch}"
        assert e.validation_loss is not None
        assert a.validation_loss is not None
        assert a.validation_loss == pytest.approx(e.validation_loss, abs=tol, rel=0), f"epoch {e.epoch}"
    assert actual.min_validation_loss == pytest.approx(expected.min_validation_loss, abs=tol, rel=0)


def assert_same_params(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, atol: float
) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0.0, msg=f"parameter {name}")


def root_state(workdir: Path, run: str) -> LoopState:
    result = worker.outcome(workdir, run, 0)
    assert result["ok"], result
    return lamploop.state.converter.structure(result["state"], LoopState)


def test_followers_start_from_other_weights() -> None:
    """The setup itself: were the root's weights not broadcast, the results would differ."""
    root, follower = worker.make_module({"seed": 1}, 0), worker.make_module({"seed": 1}, 1)
    assert not torch.equal(root[0].weight, follower[0].weight)


# --- equivalence --------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(FLEET_TIMEOUT_S + 90)
@pytest.mark.parametrize(("nranks", "k", "strategy"), EQUIVALENCE_CASES)
async def test_ranks_train_like_one_process_on_the_union(
    fleet: tuple[Path, Path], nranks: int, k: int, strategy: str
) -> None:
    workdir = fleet[0]
    run = equivalence_run(nranks, k, strategy)
    expected_state, expected_best, expected_live = await reference(run)
    if run["data"]["valid_class"] is not None:
        # The case exercises model selection: the best epoch is not the last one.
        assert expected_state.min_validation_epoch == 0
        assert not torch.equal(expected_best["0.weight"], expected_live["0.weight"])

    assert_same_curve(root_state(workdir, run["name"]), expected_state, LOSS_TOL)
    assert_same_params(worker.tensors(workdir, run["name"], "rank0"), expected_best, atol=PARAMS_ATOL)
    assert_same_params(worker.tensors(workdir, run["name"], "live"), expected_live, atol=PARAMS_ATOL)
    for rank in range(1, nranks):
        assert worker.outcome(workdir, run["name"], rank)["ok"]
        # Every follower ends with the root's live parameters (not its own start, not the best).
        assert_same_params(
            worker.tensors(workdir, run["name"], f"rank{rank}"),
            worker.tensors(workdir, run["name"], "live"),
            atol=1e-12,
        )


@pytest.mark.anyio
@pytest.mark.timeout(FLEET_TIMEOUT_S + 90)
@pytest.mark.parametrize(("train", "valid", "k", "strategy"), UNEVEN_CASES)
async def test_uneven_streams_finish_and_drop_nothing(
    fleet: tuple[Path, Path], train: list[int], valid: list[int], k: int, strategy: str
) -> None:
    workdir = fleet[0]
    run = uneven_run(train, valid, k, strategy)
    data, nranks = run["data"], len(train)
    expected_state, expected_best, expected_live = await reference(run)
    state = root_state(workdir, run["name"])

    # Each epoch's training loss is the mean over every example the ranks hold, computed
    # with the parameters each step started from: the reference's, loss for loss.
    every_example = sum(
        int(y.shape[0]) for r in range(nranks) for _, y in worker.train_batches_of(data, 0, r)
    )
    assert sum(int(y.shape[0]) for _, y in worker.union_train_batches(data, 0, nranks, k)) == every_example
    assert_same_curve(state, expected_state, LOSS_TOL)
    # Independently: the last validation loss is the mean over every rank's validation
    # examples (rank 1 has fewer) under the live parameters of the last epoch.
    module = worker.make_module(run["model"], 0)
    module.load_state_dict(worker.tensors(workdir, run["name"], "live"))
    with torch.no_grad():
        x, y = (torch.cat(t) for t in zip(*worker.union_valid_batches(data, EPOCHS - 1, nranks), strict=True))
        mean = float(torch.nn.functional.cross_entropy(module(x), y))
    last = state.learning_curve[-1].validation_loss
    assert last is not None
    assert last[1] == pytest.approx(mean, abs=LOSS_TOL, rel=0)
    assert_same_params(worker.tensors(workdir, run["name"], "rank0"), expected_best, atol=PARAMS_ATOL)
    assert_same_params(worker.tensors(workdir, run["name"], "live"), expected_live, atol=PARAMS_ATOL)
    for rank in range(1, nranks):
        assert worker.outcome(workdir, run["name"], rank)["ok"]


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("k", "strategy"), [(1, "reduce_to_root"), (2, "reduce_to_root"), (1, "all_reduce"), (2, "all_reduce")]
)
async def test_local_data_parallel_matches_single_process(k: int, strategy: str) -> None:
    run = equivalence_run(2, k, strategy)
    run["data"]["seed"] += 1000
    data = run["data"]
    expected_state, expected_best, expected_live = await reference(run)
    modules = [worker.make_module(run["model"], rank) for rank in range(2)]
    train = worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r))
    valid = worker.stream_factory(lambda e, r: worker.valid_batches_of(data, e, r))
    live: dict[str, torch.Tensor] = {}

    async def keep_live(state: lamploop.LoopStateWithModelAndOptimizerData, _: Any) -> None:
        live.update({name: t.detach().clone() for name, t in state.model.items()})

    with anyio.fail_after(25):
        state = await local_data_parallel_training_loop(
            [(SupervisedModel(m), train, valid) for m in modules],
            worker.optimizer_factory(run["optimizer"]),
            EPOCHS,
            checkpoint_state=keep_live,
            return_min_validation_loss_model=ALL_EPOCHS,
            learning_rate_schedule=worker.make_schedule(run["schedule"]),
            accumulate_gradient_over_n_batches=k,
            strategy=strategy,
        )
    assert_same_curve(state, expected_state, LOSS_TOL)
    assert_same_params(modules[0].state_dict(), expected_best, atol=PARAMS_ATOL)
    assert_same_params(live, expected_live, atol=PARAMS_ATOL)
    assert_same_params(modules[1].state_dict(), expected_live, atol=PARAMS_ATOL)


# --- resuming ------------------------------------------------------------------------------------


@pytest.mark.timeout(FLEET_TIMEOUT_S + 90)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resumed_run_equals_the_uninterrupted_one(fleet: tuple[Path, Path], strategy: str) -> None:
    """A fresh pair of processes resumes from the epoch-2 checkpoint and trains to epoch 4."""
    fleet_dir, resumed = fleet
    full, again = f"resume-full-{strategy}", f"resume-from-2-{strategy}"
    checkpoints = sorted(p.name for p in (fleet_dir / f"checkpoints-{strategy}").glob("epoch-*"))
    assert checkpoints == [f"epoch-{e:06d}" for e in range(1, 5)]
    expected = root_state(fleet_dir, full)
    assert expected.epoch == 4
    # The plateau schedule had seen a validation loss by then: its state matters when resuming.
    schedule = worker.make_schedule(resume_run(strategy, fleet_dir)["schedule"])
    saved = load_checkpoint(fleet_dir / f"checkpoints-{strategy}" / "epoch-000002", schedule=schedule)
    assert saved.state.loop_state.epoch == 2
    assert saved.schedule_state != schedule.init()
    assert_same_curve(root_state(resumed, again), expected, 1e-12)
    for name in ("rank0", "live", "rank1"):
        assert_same_params(
            worker.tensors(resumed, again, name), worker.tensors(fleet_dir, full, name), atol=1e-12
        )


# --- refusals in the handshake, before any tensor work ---------------------------------------------


def _module(*, hidden: int = 8, extra: bool = False, dtype: str = "float64") -> nn.Module:
    return worker.make_module({"seed": 0, "hidden": hidden, "extra_layer": extra, "dtype": dtype}, 0)


async def _root_and_follower(
    *,
    root_module: nn.Module,
    follower_module: nn.Module,
    root_nranks: int = 2,
    follower_nranks: int = 2,
    follower_token: str = "right-token",
    join_timeout: float = 20.0,
) -> tuple[BaseException | None, BaseException | None, float]:
    """A root and one follower (rank 1), independent tasks of this event loop.

    Returns what each raised (``None``: nothing) and how long it all took.
    """
    data = {"seed": 7, "batches": [2, 2, 2]}
    common: dict[str, Any] = {
        "device": "cpu",
        "train_batches": worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r)),
        "validation_batches": None,
    }
    errors: dict[str, BaseException] = {}

    async def root(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        try:
            async with TcpControlRoot(
                nranks=root_nranks,
                token="right-token",
                model_spec=model_spec(root_module),
                join_timeout=join_timeout,
            ) as control:
                task_status.started(control.address[1])
                await drive_distributed_training(
                    nranks=root_nranks,
                    control=control,
                    model=SupervisedModel(root_module),
                    optimizer_factory=worker.optimizer_factory({"name": "sgd"}),
                    max_epochs=1,
                    **common,
                )
        except Exception as exc:
            errors["root"] = exc

    async def follower(port: int) -> None:
        try:
            async with TcpControlFollower(
                host="127.0.0.1",
                port=port,
                rank=1,
                nranks=follower_nranks,
                token=follower_token,
                model_spec=model_spec(follower_module),
                connect_timeout=5.0,
            ) as control:
                await follow_distributed_training(
                    rank=1,
                    nranks=follower_nranks,
                    control=control,
                    model=SupervisedModel(follower_module),
                    **common,
                )
        except Exception as exc:
            errors["follower"] = exc

    worker.optimizer_factory({"name": "sgd"})(root_module.parameters())  # the first one imports torch._dynamo
    started = time.monotonic()
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tasks:
            port = await tasks.start(root)
            tasks.start_soon(follower, port)
    return errors.get("root"), errors.get("follower"), time.monotonic() - started


def _only(exc: BaseException | None) -> BaseException | None:
    """The one exception inside (nested) single-member exception groups."""
    inner = getattr(exc, "exceptions", None)
    while isinstance(inner, tuple) and len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("follower_module", "root_nranks", "follower_nranks", "words"),
    [
        pytest.param(
            _module(extra=True), 2, 2, ["model differs", "unexpected tensors", "4.weight"], id="extra-layer"
        ),
        pytest.param(
            _module(hidden=9), 2, 2, ["model differs", "0.weight", "(8, 4)", "(9, 4)"], id="other-shape"
        ),
        pytest.param(
            _module(dtype="float32"), 2, 2, ["model differs", "float64", "float32"], id="other-dtype"
        ),
        pytest.param(_module(), 2, 3, ["nranks=3", "nranks=2"], id="follower-thinks-3-ranks"),
        pytest.param(_module(), 3, 2, ["nranks=2", "nranks=3"], id="follower-thinks-2-ranks"),
    ],
)
async def test_a_follower_that_does_not_fit_is_refused_on_both_sides(
    follower_module: nn.Module, root_nranks: int, follower_nranks: int, words: list[str]
) -> None:
    root_error, follower_error, elapsed = await _root_and_follower(
        root_module=_module(),
        follower_module=follower_module,
        root_nranks=root_nranks,
        follower_nranks=follower_nranks,
    )
    root_error, follower_error = _only(root_error), _only(follower_error)
    assert isinstance(root_error, HandshakeError), repr(root_error)
    assert isinstance(follower_error, HandshakeError), repr(follower_error)
    for error in (root_error, follower_error):
        for word in words:
            assert word in str(error)
    assert elapsed < 10.0  # refused at once, not after the 20 s join timeout (margin for a loaded machine)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_wrong_token_is_refused_on_both_sides() -> None:
    root_error, follower_error, elapsed = await _root_and_follower(
        root_module=_module(), follower_module=_module(), follower_token="wrong-token", join_timeout=1.5
    )
    root_error, follower_error = _only(root_error), _only(follower_error)
    assert isinstance(follower_error, HandshakeError), repr(follower_error)
    assert "token" in str(follower_error)
    # The root cannot tell a follower with the wrong token from a stranger: it refuses it,
    # remembers why, and fails when the join timeout passes, naming the missing rank.
    assert isinstance(root_error, HandshakeError), repr(root_error)
    assert "missing ranks [1]" in str(root_error)
    assert "token" in str(root_error)
    assert 1.5 <= elapsed < 6.0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_slow_setup_on_the_root_does_not_time_out_a_joining_follower() -> None:
    """The root's set-up must not block the event loop on which its control root serves.

    A process's first optimizer imports ``torch._dynamo`` (seconds; over ten on a loaded
    machine: seen in these tests as "the root ... did not finish the handshake in 10 s").
    Here a factory that blocks until the follower (in a thread with its own event loop) has
    finished its handshake stands in for it: were the root's loop blocked by the factory, the
    handshake could never finish, and the factory gives up after 30 s. No clock decides it
    (a 2 s factory against a 0.5 s handshake timeout did, and a loaded machine could miss it).
    """
    data = {"seed": 7, "batches": [2, 2]}
    common: dict[str, Any] = {
        "device": "cpu",
        "train_batches": worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r)),
        "validation_batches": None,
    }
    root_module, follower_module = worker.make_module({"seed": 0}, 0), worker.make_module({"seed": 0}, 1)
    worker.optimizer_factory({"name": "sgd"})(root_module.parameters())  # the real import, out of the way

    joined = threading.Event()  # set when the follower's handshake is done (its log line says so)

    class _Joined(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("rank 1 joined"):
                joined.set()

    handler = _Joined(logging.INFO)
    control_logger = logging.getLogger("lamploop.control")
    level = control_logger.level
    control_logger.addHandler(handler)
    control_logger.setLevel(logging.INFO)

    def slow_factory(params: Any) -> torch.optim.Optimizer:
        assert joined.wait(30), "the follower could not finish its handshake while the factory ran"
        return torch.optim.SGD(params, lr=0.1)

    errors: dict[str, BaseException] = {}

    def follower(port: int) -> None:
        async def follow() -> None:
            async with TcpControlFollower(
                host="127.0.0.1",
                port=port,
                rank=1,
                nranks=2,
                token="t",
                model_spec=model_spec(follower_module),
                handshake_timeout=10.0,
            ) as control:
                await follow_distributed_training(
                    rank=1, nranks=2, control=control, model=SupervisedModel(follower_module), **common
                )

        try:
            anyio.run(follow)
        except Exception as exc:
            errors["follower"] = exc

    with anyio.fail_after(40):
        async with TcpControlRoot(
            nranks=2, token="t", model_spec=model_spec(root_module), join_timeout=30.0
        ) as root:
            thread = threading.Thread(target=follower, args=(root.address[1],), daemon=True)
            thread.start()
            try:
                state = await drive_distributed_training(
                    nranks=2,
                    control=root,
                    model=SupervisedModel(root_module),
                    optimizer_factory=slow_factory,
                    max_epochs=1,
                    **common,
                )
            finally:
                await anyio.to_thread.run_sync(thread.join, 20.0)
                control_logger.removeHandler(handler)
                control_logger.setLevel(level)
    assert "follower" not in errors, repr(errors.get("follower"))
    assert state.epoch == 1
