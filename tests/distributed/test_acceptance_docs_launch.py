"""Acceptance tests, from the docs alone: launching ``fit`` under torchrun and Slurm, and restarts.

Sources: DESIGN.md section 7 ("Where users outgrow one machine") and section 6 (checkpoints,
resume); docs/distributed.md, "Running it" and "Failure behaviour"; docs/checkpoints.md
("Resuming"); docs/reliability.md ("What is lost"); the docstrings of ``lamploop.fit`` and
``lamploop.distributed.launch``.

Every multi-process run here starts the real ``torchrun`` (``python -m torch.distributed.run``)
on 127.0.0.1, or two processes with Slurm's variables, running
``tests/workers/acceptance_launch_train.py``, which only calls ``lamploop.fit(...)``: a
float64 ``Linear(3, 1)``, SGD with momentum, 24 examples in batches of 3 cut by a pure function
of the epoch, batch ``i`` for rank ``i % nranks``, 4 epochs, checkpoints after every epoch.
Every wait is bounded and every process started is killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from support import free_port

from lamploop.distributed.launch import launch_env
from lamploop.errors import ConfigurationError

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "acceptance_launch_train.py"
MAX_EPOCHS = 4
RUN_TIMEOUT_S = 100.0  # an elastic restart imports torch twice; a loaded CI machine took past 60 s
TOKEN = "0123456789abcdef0123456789abcdef"


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location("acceptance_launch_train", WORKER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


# ----------------------------------------------------------------------------- helpers


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("SLURM_", "LAMPLOOP_", "TORCHELASTIC_", "GROUP_", "ROLE_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _kill_leftovers(out: Path) -> None:
    """SIGKILL the process group of every worker of this run that is still alive.

    Workers run by torchrun are session leaders (torchrun starts them with a session of their
    own), so killing torchrun's group would not reach them; each wrote its pid at start.  A pid
    is killed only while its command line still names this run's ``--out`` directory.
    """
    for pid_file in out.glob("pid-*"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(out).encode() in cmdline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _run_all(
    commands: Sequence[tuple[list[str], dict[str, str]]], out: Path, log_name: str
) -> tuple[list[int], str]:
    """Start every command in a new process group, wait for all (bounded), kill them after."""
    out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for i, (argv, env) in enumerate(commands):
            log = out.parent / f"{log_name}-{i}.log"
            logs.append(log)
            with log.open("wb") as sink:
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        cwd=REPO,
                        stdin=subprocess.DEVNULL,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                text = "\n".join(p.read_text(errors="replace")[-3000:] for p in logs)
                pytest.fail(f"a launched process did not end within {RUN_TIMEOUT_S} s (a hang):\n{text}")
        text = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
        return codes, f"exit statuses {codes}\n{text}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        _kill_leftovers(out)


def _worker_args(out: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [str(WORKER), "--out", str(out), "--checkpoint-dir", str(checkpoints), *extra]


def _torchrun(
    tmp: Path, name: str, rdzv: list[str], *worker_extra: str, checkpoints: Path | None = None
) -> dict[str, Any]:
    """One ``torchrun --nproc-per-node 2`` job; what every rank wrote, by file name."""
    out = tmp / name
    checkpoints = checkpoints if checkpoints is not None else tmp / f"{name}-checkpoints"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        *rdzv,
        *_worker_args(out, checkpoints, *worker_extra),
    ]
    (code,), log = _run_all([(argv, _clean_env())], out, name)
    return {"code": code, "log": log, "ranks": _results(out), "checkpoints": checkpoints}


def _static_rdzv() -> list[str]:
    return ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def _c10d_rdzv() -> list[str]:
    return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]


def _results(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("rank*-restart*.json"))}


def _epochs(result: dict[str, Any]) -> list[int]:
    return [r["epoch"] for r in result["requested"]]


def reference_parameters(max_epochs: int = MAX_EPOCHS) -> dict[str, list[float]]:
    """Plain-torch float64 data parallelism over 2 ranks, written apart from lamploop.

    Each step takes one batch of each rank (batches ``2s`` and ``2s + 1`` of the epoch), and
    the gradient is that of the sum of the losses of every example of the step over the
    number of those examples (DESIGN.md section 3), i.e. one process on the concatenated batches.
    """
    module = worker.initial_module()
    optimizer = torch.optim.SGD(module.parameters(), lr=worker.LEARNING_RATE, momentum=worker.MOMENTUM)
    for epoch in range(max_epochs):
        batches = worker.batches_of_epoch(epoch)
        for start in range(0, len(batches), 2):
            x = torch.cat([b[0] for b in batches[start : start + 2]])
            y = torch.cat([b[1] for b in batches[start : start + 2]])
            optimizer.zero_grad()
            (((module(x) - y) ** 2).sum() / len(x)).backward()
            optimizer.step()
    return worker.parameters(module)


def _assert_close_to_reference(params: dict[str, list[float]]) -> None:
    reference = reference_parameters()
    assert params.keys() == reference.keys()
    for name, values in reference.items():
        assert params[name] == pytest.approx(values, rel=1e-9, abs=1e-9), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``torchrun --nproc-per-node 2 train.py`` job (static rendezvous), run to the end."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return _torchrun(tmp, "run", _static_rdzv())


# ----------------------------------------------------------------------------- torchrun, one node


@pytest.mark.timeout(120)
def test_torchrun_ranks_decide_root_and_follower_from_rank_and_world_size(
    uninterrupted: dict[str, Any],
) -> None:
    """DESIGN.md section 7: "Processes are started by `torchrun` (...) or by Slurm; lamploop reads
    RANK / WORLD_SIZE / LOCAL_RANK and decides root or follower."  fit's docstring: "under
    ``torchrun`` or Slurm the launcher's variables decide the rank.  Only rank 0 checkpoints,
    reports and returns the state." and "the final state (``None`` on followers)"."""
    run = uninterrupted
    assert run["code"] == 0, run["log"]
    ranks = run["ranks"]
    assert sorted(ranks) == ["rank0-restart0", "rank1-restart0"], run["log"]
    root, follower = ranks["rank0-restart0"], ranks["rank1-restart0"]
    assert "error" not in root, root.get("traceback")
    assert "error" not in follower, follower.get("traceback")
    assert root["env"]["WORLD_SIZE"] == "2"
    assert root["returned"] == {"epoch": MAX_EPOCHS}
    assert follower["returned"] is None
    assert {(r["rank"], r["nranks"]) for r in root["requested"]} == {(0, 2)}
    assert {(r["rank"], r["nranks"]) for r in follower["requested"]} == {(1, 2)}
    assert _epochs(root) == _epochs(follower) == list(range(MAX_EPOCHS))
    assert (run["checkpoints"] / "latest").read_text().strip() == f"epoch-{MAX_EPOCHS:06d}"


@pytest.mark.timeout(120)
def test_torchrun_two_ranks_end_equal_and_match_a_float64_data_parallel_reference(
    uninterrupted: dict[str, Any],
) -> None:
    """docs/distributed.md: "`R` ranks x `k` accumulated batches of size `b` train like one rank
    with batches of `R*k*b` (tested to 1e-6 in float64)", and, for `all_reduce` (fit's "auto"),
    "parameters | identical because updates are identical"; run as "torchrun --nproc-per-node 4
    train.py        # train.py calls lamploop.fit(...)"."""
    ranks = uninterrupted["ranks"]
    assert uninterrupted["code"] == 0, uninterrupted["log"]
    root, follower = ranks["rank0-restart0"], ranks["rank1-restart0"]
    assert root["hex"] == follower["hex"]
    _assert_close_to_reference(root["params"])


# ----------------------------------------------------------------------------- restarts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed_rank", [1, 0], ids=["follower_killed", "root_killed"])
def test_elastic_restart_after_sigkill_resumes_from_latest_checkpoint_bitwise(
    tmp_path: Path, uninterrupted: dict[str, Any], killed_rank: int
) -> None:
    """DESIGN.md section 7: "A restarted job resumes from the latest checkpoint by itself."
    docs/distributed.md: "With `--max-restarts N` a restarted job resumes from the latest
    checkpoint by itself if `fit` was given a `checkpoint_dir` on shared storage."
    docs/reliability.md: "A killed run resumes from the last checkpoint, bitwise equal to an
    uninterrupted run on CPU".  docs/distributed.md, "torchrun, one node": "Rank 0 listens on a
    free port and publishes it (...) in torchrun's own store, under a key scoped to
    `TORCHELASTIC_RESTART_COUNT`; the followers read it there" (the restarted ranks meet again)."""
    run = _torchrun(
        tmp_path,
        "killed",
        ["--max-restarts", "1", *_c10d_rdzv()],
        "--kill-rank",
        str(killed_rank),
        "--kill-epoch",
        "2",
        "--kill-after-batches",
        "2",
    )
    ranks = run["ranks"]
    assert run["code"] == 0, run["log"]
    # The first attempt: the killed rank wrote nothing; the survivor failed (it may also have been
    # stopped by torchrun before it could write its result), and torchrun restarted the job.
    assert f"rank{killed_rank}-restart0" not in ranks
    survivor = ranks.get(f"rank{1 - killed_rank}-restart0")
    if survivor is not None:
        assert "error" in survivor
        assert _epochs(survivor) == [0, 1, 2]
    root, follower = ranks["rank0-restart1"], ranks["rank1-restart1"]
    assert root["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert "error" not in root, root.get("traceback")
    assert "error" not in follower, follower.get("traceback")
    # The restarted job found epoch 2's checkpoint and trained epochs 2 and 3 only.
    assert root["latest_before"] == "epoch-000002"
    assert _epochs(root) == _epochs(follower) == [2, 3]
    assert root["returned"] == {"epoch": MAX_EPOCHS}
    assert follower["returned"] is None
    expected = uninterrupted["ranks"]["rank0-restart0"]["hex"]
    assert root["hex"] == expected
    assert follower["hex"] == expected


@pytest.mark.timeout(120)
def test_second_plain_launch_of_a_finished_job_trains_nothing_more(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """fit's docstring: "checkpoint_dir: write a checkpoint after every epoch there, and resume
    from its latest checkpoint when ``resume`` is true" and "max_epochs: the number of epochs in
    all (a resumed run counts those already done)"; docs/checkpoints.md: "training on from epoch
    k gives bitwise the same parameters as a run that was never interrupted"."""
    assert uninterrupted["code"] == 0, uninterrupted["log"]
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted["checkpoints"], checkpoints)
    before = sorted(p.name for p in checkpoints.iterdir())
    run = _torchrun(tmp_path, "again", _static_rdzv(), checkpoints=checkpoints)
    assert run["code"] == 0, run["log"]
    root, follower = run["ranks"]["rank0-restart0"], run["ranks"]["rank1-restart0"]
    assert root["latest_before"] == f"epoch-{MAX_EPOCHS:06d}"
    assert _epochs(root) == _epochs(follower) == []
    assert root["returned"] == {"epoch": MAX_EPOCHS}
    assert follower["returned"] is None
    expected = uninterrupted["ranks"]["rank0-restart0"]["hex"]
    assert root["hex"] == follower["hex"] == expected
    assert sorted(p.name for p in checkpoints.iterdir()) == before


# ----------------------------------------------------------------------------- Slurm


@pytest.mark.timeout(120)
def test_slurm_one_node_step_decides_ranks_from_slurm_variables(tmp_path: Path) -> None:
    """docs/distributed.md, "Slurm": "lamploop reads `SLURM_PROCID`, `SLURM_NTASKS`,
    `SLURM_LOCALID`; the root is `LAMPLOOP_ROOT_ADDR`, else the first host of
    `SLURM_JOB_NODELIST` (...) The control port is `LAMPLOOP_CONTROL_PORT` (...)
    `LAMPLOOP_TOKEN` is required."  A one-node step (``srun --ntasks 2``) simulated by starting
    both tasks with Slurm's variables; the root is found through SLURM_JOB_NODELIST."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    port = str(free_port())
    commands = [
        (
            [sys.executable, *_worker_args(out, checkpoints)],
            _clean_env(
                SLURM_PROCID=str(task),
                SLURM_NTASKS="2",
                SLURM_LOCALID=str(task),
                SLURM_JOB_NODELIST="localhost",
                SLURM_JOB_ID="4242",
                LAMPLOOP_CONTROL_PORT=port,
                LAMPLOOP_TOKEN=TOKEN,
            ),
        )
        for task in (0, 1)
    ]
    codes, log = _run_all(commands, out, "task")
    assert codes == [0, 0], log
    ranks = _results(out)
    root, follower = ranks["rank0-restart0"], ranks["rank1-restart0"]
    assert root["returned"] == {"epoch": MAX_EPOCHS}
    assert follower["returned"] is None
    assert {(r["rank"], r["nranks"]) for r in root["requested"]} == {(0, 2)}
    assert {(r["rank"], r["nranks"]) for r in follower["requested"]} == {(1, 2)}
    assert root["hex"] == follower["hex"]
    _assert_close_to_reference(root["params"])
    assert (checkpoints / "latest").read_text().strip() == f"epoch-{MAX_EPOCHS:06d}"


SLURM = {"SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "LAMPLOOP_TOKEN": "t"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param(
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",
            },
            {"launcher": "torchrun", "rank": 1, "world_size": 2, "local_rank": 0},
            id="torchrun_rank1_local0",
        ),
        pytest.param(
            {
                "RANK": "0",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "10.0.0.9",
                "MASTER_PORT": "29500",
            },
            {"launcher": "torchrun", "rank": 0, "world_size": 4, "root_host": "10.0.0.9"},
            id="torchrun_root_on_master_addr",
        ),
        pytest.param(
            {**SLURM, "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "gpu[12-15]", "SLURM_JOB_ID": "123456"},
            {
                "launcher": "slurm",
                "rank": 1,
                "world_size": 4,
                "local_rank": 1,
                "root_host": "gpu12",
                "control_port": 23456,
                "token": "t",
            },
            id="slurm_nodelist_and_job_id_port",
        ),
        pytest.param(
            {
                **SLURM,
                "SLURM_PROCID": "0",
                "SLURM_JOB_NODELIST": "gpu[12-15]",
                "LAMPLOOP_ROOT_ADDR": "10.1.2.3",
                "LAMPLOOP_CONTROL_PORT": "31000",
                "SLURM_JOB_ID": "7",
            },
            {"launcher": "slurm", "rank": 0, "root_host": "10.1.2.3", "control_port": 31000},
            id="slurm_root_addr_and_control_port_win",
        ),
        pytest.param(
            {**SLURM, "SLURM_PROCID": "2", "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9"},
            {"launcher": "slurm", "rank": 2, "root_host": "10.9.9.9", "control_port": 29511},
            id="slurm_launch_node_and_default_port",
        ),
    ],
)
def test_launch_env_reads_the_documented_variables(environ: dict[str, str], expected: dict[str, Any]) -> None:
    """DESIGN.md section 7: "lamploop reads RANK / WORLD_SIZE / LOCAL_RANK and decides root or
    follower" (RANK, not LOCAL_RANK, as on a second node); docs/distributed.md: "lamploop reads
    `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
    `MASTER_PORT`"; "The control channel and the tensor channel's store listen on `MASTER_ADDR`";
    "lamploop reads `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; the root is
    `LAMPLOOP_ROOT_ADDR`, else the first host of `SLURM_JOB_NODELIST` (`gpu[12-15]` -> `gpu12`
    ...), else `SLURM_LAUNCH_NODE_IPADDR`. The control port is `LAMPLOOP_CONTROL_PORT`, else
    `20000 + SLURM_JOB_ID % 20000` (...), else 29511."""
    env = launch_env(environ)
    assert env is not None
    for field, value in expected.items():
        assert getattr(env, field) == value, field


# ----------------------------------------------------------------------------- misconfigurations

_TORCHRUN_REST = {"LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
_SLURM_REST = {"SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost", "LAMPLOOP_TOKEN": TOKEN}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("environ", "names"),
    [
        pytest.param(
            {"WORLD_SIZE": "2", **_TORCHRUN_REST},
            ["RANK"],
            id="world_size_without_rank",
        ),
        pytest.param(
            {"RANK": "1", **_TORCHRUN_REST},
            ["WORLD_SIZE"],
            id="rank_without_world_size",
        ),
        pytest.param({"RANK": "2", "WORLD_SIZE": "2", **_TORCHRUN_REST}, ["RANK"], id="rank_ge_world_size"),
        pytest.param({"RANK": "-1", "WORLD_SIZE": "2", **_TORCHRUN_REST}, ["RANK"], id="rank_negative"),
        pytest.param({"RANK": "one", "WORLD_SIZE": "2", **_TORCHRUN_REST}, ["RANK"], id="rank_not_integer"),
        pytest.param(
            {"RANK": "0", "WORLD_SIZE": "2.0", **_TORCHRUN_REST}, ["WORLD_SIZE"], id="world_size_not_integer"
        ),
        pytest.param(
            {"RANK": "0", "WORLD_SIZE": "0", **_TORCHRUN_REST}, ["WORLD_SIZE"], id="world_size_zero"
        ),
        pytest.param(
            {"RANK": "0", "WORLD_SIZE": "2", **_TORCHRUN_REST, "LOCAL_RANK": "x"},
            ["LOCAL_RANK"],
            id="local_rank_not_integer",
        ),
        pytest.param(
            {"SLURM_PROCID": "2", "SLURM_NTASKS": "2", **_SLURM_REST},
            ["SLURM_PROCID", "SLURM_NTASKS"],
            id="slurm_procid_ge_ntasks",
        ),
        pytest.param(
            {"SLURM_PROCID": "zero", "SLURM_NTASKS": "2", **_SLURM_REST},
            ["SLURM_PROCID"],
            id="slurm_procid_not_integer",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2x", **_SLURM_REST},
            ["SLURM_NTASKS"],
            id="slurm_ntasks_not_integer",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **_SLURM_REST, "SLURM_LOCALID": "zz"},
            ["SLURM_LOCALID"],
            id="slurm_localid_not_integer",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu12"},
            ["LAMPLOOP_TOKEN"],
            id="slurm_without_token",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **_SLURM_REST, "LAMPLOOP_CONTROL_PORT": "port"},
            ["LAMPLOOP_CONTROL_PORT"],
            id="slurm_control_port_not_integer",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **_SLURM_REST, "LAMPLOOP_CONTROL_PORT": "99999"},
            ["LAMPLOOP_CONTROL_PORT"],
            id="slurm_control_port_out_of_range",
        ),
        pytest.param(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **_SLURM_REST, "SLURM_JOB_ID": "abc"},
            ["SLURM_JOB_ID"],
            id="slurm_job_id_not_integer",
        ),
    ],
)
def test_malformed_launcher_variables_raise_configuration_error_naming_them(
    environ: dict[str, str], names: list[str]
) -> None:
    """``lamploop.distributed.launch.launch_env``: "Raises: ConfigurationError: a variable is
    malformed or a required one is missing."; lamploop.errors: "Each message names the offending
    value and where it came from."; docs/distributed.md: "`LAMPLOOP_TOKEN` is required"."""
    try:
        env = launch_env(environ)
    except ConfigurationError as error:
        message = str(error)
    else:
        raise AssertionError(f"no error: launch_env returned {env!r}")
    for name in names:
        assert name in message, message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("environ", "name"),
    [
        pytest.param(
            {"WORLD_SIZE": "2"},
            "RANK",
            id="world_size_without_rank",
        ),
        pytest.param({"RANK": "2", "WORLD_SIZE": "2", **_TORCHRUN_REST}, "RANK", id="rank_ge_world_size"),
        pytest.param(
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "2", **_SLURM_REST},
            "SLURM_PROCID",
            id="slurm_procid_ge_ntasks",
        ),
    ],
)
def test_fit_under_a_misconfigured_launcher_fails_at_once_naming_the_variable(
    tmp_path: Path, environ: dict[str, str], name: str
) -> None:
    """fit's docstring: "under ``torchrun`` or Slurm the launcher's variables decide the rank";
    ``launch_env``: "ConfigurationError: a variable is malformed or a required one is missing";
    docs/distributed.md, "Failure behaviour": "a failed run's process exits at once with its
    status".  One process running ``fit`` with the variables: an error naming the variable, at
    once (well inside the heartbeat timeout), no training and no hang."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    started = time.monotonic()
    (code,), _log = _run_all(
        [([sys.executable, *_worker_args(out, checkpoints, "--max-epochs", "1")], _clean_env(**environ))],
        out,
        "misconfigured",
    )
    elapsed = time.monotonic() - started
    results = list(_results(out).values())
    assert code != 0, f"exit 0: fit ran as {[(r['rank'], r['nranks']) for r in results[0]['requested'][:1]]}"
    assert len(results) == 1
    assert "ConfigurationError" in results[0]["error"], results[0]["error"]
    assert name in results[0]["error"], results[0]["error"]
    assert results[0]["requested"] == []
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert not (checkpoints / "latest").exists()
