"""Who am I: launcher variables, and two real launches of ``lamploop.fit`` on two ranks.

``launch_env`` is pure (it takes the environment as a dict), so the parsing tests need no
process.  The end-to-end tests start the worker script ``tests/workers/rank.py fit``
under ``torchrun`` and, separately, with ``fit(world_size=2, launch_command=...)`` which
starts rank 1 itself; both compare rank 0's result with ``fit`` on one process over the
same examples (``tensor_batches`` deals batch ``i`` to rank ``i % 2``, so two ranks with
batches of 8 see, step by step, what one rank sees with batches of 16).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fit_reference import Reference, check_against_single_process, single_process_fit
from support import free_port
from workers import rank as worker  # tests/ is on sys.path: pytest puts conftest.py's folder there

from lamploop.distributed.launch import DEFAULT_SLURM_CONTROL_PORT, LaunchEnv, launch_env
from lamploop.errors import ConfigurationError

LAMPLOOP = {
    "LAMPLOOP_RANK": "2",
    "LAMPLOOP_WORLD_SIZE": "3",
    "LAMPLOOP_CONTROL": "10.0.0.5:4242",
    "LAMPLOOP_TOKEN": "s3",
}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1",
    "LAMPLOOP_TOKEN": "secret",
}


# --- launch_env: pure parsing ----------------------------------------------------------------


def test_no_launcher_means_none() -> None:
    assert launch_env({}) is None
    assert launch_env({"PATH": "/bin", "RANK": "1"}) is None  # RANK alone is not torchrun
    assert launch_env({"SLURM_PROCID": "0"}) is None  # nor SLURM_PROCID without SLURM_NTASKS


def test_lamploop_variables() -> None:
    assert launch_env(LAMPLOOP) == LaunchEnv(
        rank=2,
        world_size=3,
        local_rank=2,
        launcher="lamploop",
        root_host="10.0.0.5",
        control_port=4242,
        token="s3",
    )


def test_lamploop_variables_win_over_torchrun_and_slurm() -> None:
    env = launch_env({**SLURM, **TORCHRUN, **LAMPLOOP})
    assert env is not None
    assert (env.launcher, env.rank, env.world_size) == ("lamploop", 2, 3)


def test_torchrun_variables() -> None:
    assert launch_env(TORCHRUN) == LaunchEnv(
        rank=1, world_size=4, local_rank=1, launcher="torchrun", root_host="node0", store_port=29500
    )


def test_torchrun_defaults_and_lamploop_overrides() -> None:
    env = launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert env == LaunchEnv(rank=0, world_size=2, local_rank=0, launcher="torchrun", root_host="127.0.0.1")
    env = launch_env({**TORCHRUN, "LAMPLOOP_CONTROL_PORT": "6000", "LAMPLOOP_TOKEN": "t"})
    assert env is not None
    assert (env.control_port, env.token, env.store_port) == (6000, "t", 29500)


def test_torchrun_wins_over_slurm() -> None:
    """``srun torchrun ...``: the ranks are torchrun's, not Slurm's task ids."""
    env = launch_env({**SLURM, **TORCHRUN})
    assert env is not None
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 1, 4)


def test_slurm_variables() -> None:
    assert launch_env(SLURM) == LaunchEnv(
        rank=3,
        world_size=4,
        local_rank=1,
        launcher="slurm",
        root_host="10.1.1.1",
        control_port=DEFAULT_SLURM_CONTROL_PORT,
        token="secret",
    )
    env = launch_env({**SLURM, "LAMPLOOP_ROOT_ADDR": "head", "LAMPLOOP_CONTROL_PORT": "7000"})
    assert env is not None
    assert (env.root_host, env.control_port) == ("head", 7000)


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        pytest.param({**LAMPLOOP, "LAMPLOOP_RANK": "two"}, ["LAMPLOOP_RANK", "'two'"], id="lamploop-rank"),
        pytest.param(
            {**LAMPLOOP, "LAMPLOOP_WORLD_SIZE": "3.0"}, ["LAMPLOOP_WORLD_SIZE", "'3.0'"], id="lamploop-size"
        ),
        pytest.param(
            {**LAMPLOOP, "LAMPLOOP_CONTROL": "10.0.0.5"}, ["LAMPLOOP_CONTROL", "host:port"], id="no-port"
        ),
        pytest.param(
            {**LAMPLOOP, "LAMPLOOP_CONTROL": "10.0.0.5:http"}, ["LAMPLOOP_CONTROL"], id="port-not-int"
        ),
        pytest.param({**LAMPLOOP, "LAMPLOOP_CONTROL": ":4242"}, ["LAMPLOOP_CONTROL"], id="no-host"),
        pytest.param(
            {k: v for k, v in LAMPLOOP.items() if k != "LAMPLOOP_CONTROL"},
            ["LAMPLOOP_CONTROL"],
            id="no-control",
        ),
        pytest.param({**TORCHRUN, "RANK": "first"}, ["RANK", "'first'"], id="torchrun-rank"),
        pytest.param({**TORCHRUN, "WORLD_SIZE": ""}, ["WORLD_SIZE"], id="torchrun-size"),
        pytest.param({**TORCHRUN, "LOCAL_RANK": "x"}, ["LOCAL_RANK", "'x'"], id="torchrun-local-rank"),
        pytest.param(
            {**TORCHRUN, "MASTER_PORT": "port"}, ["MASTER_PORT", "'port'"], id="torchrun-master-port"
        ),
        pytest.param(
            {**TORCHRUN, "LAMPLOOP_CONTROL_PORT": "p"}, ["LAMPLOOP_CONTROL_PORT"], id="torchrun-control-port"
        ),
        pytest.param({**SLURM, "SLURM_NTASKS": "many"}, ["SLURM_NTASKS", "'many'"], id="slurm-ntasks"),
        pytest.param(
            {**SLURM, "LAMPLOOP_CONTROL_PORT": "p"}, ["LAMPLOOP_CONTROL_PORT"], id="slurm-control-port"
        ),
    ],
)
def test_malformed_values_are_named(environ: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        launch_env(environ)
    for word in words:
        assert word in str(caught.value)


def test_slurm_without_a_token_is_refused() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "LAMPLOOP_TOKEN"}
    with pytest.raises(ConfigurationError, match="LAMPLOOP_TOKEN"):
        launch_env(environ)


def test_slurm_without_a_root_address_is_refused() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_LAUNCH_NODE_IPADDR"}
    with pytest.raises(ConfigurationError, match="LAMPLOOP_ROOT_ADDR"):
        launch_env(environ)


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        pytest.param(
            {k: v for k, v in LAMPLOOP.items() if k != "LAMPLOOP_WORLD_SIZE"},
            ["LAMPLOOP_WORLD_SIZE"],
            id="lamploop-no-size",
        ),
        pytest.param({**LAMPLOOP, "LAMPLOOP_RANK": "3"}, ["LAMPLOOP_RANK", "3"], id="lamploop-rank-too-big"),
        pytest.param(
            {**LAMPLOOP, "LAMPLOOP_RANK": "-1"}, ["LAMPLOOP_RANK", "-1"], id="lamploop-negative-rank"
        ),
        pytest.param({**TORCHRUN, "RANK": "4"}, ["RANK", "4"], id="torchrun-rank-too-big"),
        pytest.param({**TORCHRUN, "WORLD_SIZE": "0"}, ["WORLD_SIZE", "0"], id="torchrun-no-ranks"),
        pytest.param({**SLURM, "SLURM_PROCID": "4"}, ["SLURM_PROCID", "4"], id="slurm-rank-too-big"),
        pytest.param({**SLURM, "LAMPLOOP_TOKEN": ""}, ["LAMPLOOP_TOKEN"], id="slurm-empty-token"),
    ],
)
def test_impossible_values_are_refused_up_front(environ: dict[str, str], words: list[str]) -> None:
    """A rank outside ``0..world_size-1``, no ranks, a missing world size or an empty token
    cannot make a working job: say which variable is wrong now, not later in a handshake."""
    with pytest.raises(ConfigurationError) as caught:
        launch_env(environ)
    for word in words:
        assert word in str(caught.value)


# --- two ranks, launched for real ----------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both launches at once (each is mostly waiting on process start-up): their outputs and statuses."""
    root = tmp_path_factory.mktemp("launch")
    outs = {"torchrun": root / "torchrun", "spawn": root / "spawn"}
    for out in outs.values():
        out.mkdir()
    script = str(worker.WORKER_SCRIPT)
    with worker.Processes(root) as procs:
        procs.start(
            "torchrun",
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), script, "fit", str(outs["torchrun"]), "torchrun"],
        )  # fmt: skip
        procs.start("spawn", [sys.executable, script, "fit", str(outs["spawn"]), "spawn"])
        codes = procs.wait_all(200, grace=200)
        yield {"outs": outs, "codes": codes, "logs": procs.logs()}


@pytest.fixture(scope="module")
def single_process() -> Reference:
    """``fit`` on one process, batches of 16: what two ranks with batches of 8 must match."""
    return single_process_fit()


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_fit_under_torchrun(launched: dict[str, Any], single_process: Any) -> None:
    assert launched["codes"]["torchrun"] == 0, launched["logs"]
    check_against_single_process(launched["outs"]["torchrun"], single_process, "torchrun")
    follower = json.loads((launched["outs"]["torchrun"] / "follower-1.json").read_text())
    assert follower["launcher"] == "torchrun"


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_fit_starts_its_own_follower(launched: dict[str, Any], single_process: Any) -> None:
    assert launched["codes"]["spawn"] == 0, launched["logs"]
    check_against_single_process(launched["outs"]["spawn"], single_process, None)
    follower = json.loads((launched["outs"]["spawn"] / "follower-1.json").read_text())
    assert follower["launcher"] == "lamploop"
