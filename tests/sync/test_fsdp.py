"""The sharded strategy (:class:`lamploop.sync.FullyShard`) and its checkpoints, on real Gloo groups.

Two runs of ``tests/workers/fsdp_rank.py`` (2 ranks, then 3), each a sequence of jobs, so that
the processes start twice for the whole module.  The references lamploop did not write: PyTorch's
FSDP2 in a loop written from its docs (the ``hand`` jobs), and plain float64 training in this
process on the same examples (:func:`float64_reference`).  The MLP 8-13-5 has odd sizes, so
the shards are uneven; 62 examples in batches of 6 dealt round robin make the ranks' streams
uneven (2 ranks: 6 and 5 batches; 3 ranks: 4, 4 and 3), also inside a step with accumulation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file
from support import WORKERS, free_port
from torch import nn
from workers import fsdp_fit as fit_worker
from workers import fsdp_rank as worker
from workers import warm_start

import lamploop
from lamploop.checkpoint import load_checkpoint, verify_checkpoint
from lamploop.checkpoint.load import load_checkpoint_leaving_shards
from lamploop.checkpoint.sharded import (
    ShardsOnDisk,
    load_sharded,
    read_best,
    read_full,
    save_sharded,
    shard_file,
    sharded_model_spec,
    verify_sharded,
)
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.inspection import model_tensor_summary
from lamploop.modelspec import model_spec
from lamploop.sync.collectives import Collectives
from lamploop.sync.fsdp import FullyShard

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKER = WORKERS / "fsdp_rank.py"
EXACT = 1e-10
N = 62
# Jobs both world sizes run: lamploop and the hand-written FSDP2 loop, Adam with accumulation,
# SGD with momentum and clipping (a global norm over shards), one without resharding.
CASES = [
    {"optimizer": "adam", "k": 2, "epochs": 2},
    {"optimizer": "sgd", "k": 1, "epochs": 2, "clip": 0.5},
    {"optimizer": "sgd", "k": 3, "epochs": 1, "reshard": False},
]


def _case_name(case: dict[str, Any]) -> str:
    return (
        f"{case['optimizer']}-k{case['k']}"
        + ("-clip" if "clip" in case else "")
        + ("-keep" if "reshard" in case else "")
    )


def _start(rundir: Path, nranks: int, jobs: list[dict[str, Any]]) -> list[Any]:
    rundir.mkdir(parents=True, exist_ok=True)
    (rundir / "jobs.json").write_text(json.dumps({"port": free_port(), "jobs": jobs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    return [
        warm_start.popen(
            [sys.executable, str(WORKER), str(rundir), str(rank), str(nranks)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(nranks)
    ]


def _finish(runs: list[tuple[Path, list[Any]]], timeout: float = 180.0) -> None:
    """Wait for every process of ``runs`` (bounded), kill what is left, fail with a rank's traceback."""
    deadline = time.monotonic() + timeout
    outputs: dict[tuple[Path, int], str] = {}
    try:
        for rundir, procs in runs:
            for rank, proc in enumerate(procs):
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outputs[rundir, rank] = out.decode(errors="replace")
    finally:
        for _, procs in runs:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
    for rundir, procs in runs:
        for rank, proc in enumerate(procs):
            if proc.returncode != 0:
                failed = rundir / f"failed.rank{rank}"
                detail = failed.read_text() if failed.exists() else outputs.get((rundir, rank), "")[-4000:]
                pytest.fail(
                    f"{rundir.name}: rank {rank} of {len(procs)} exited with {proc.returncode}:\n{detail}"
                )


# Mixed precision (FSDP2's MixedPrecisionPolicy): 8-example batches, 2 ranks, 2 per step, so that
# every step counts 32 examples; the loss scales (1/32, 2/32) are then exact in bfloat16 and
# lamploop's sums scaled after are FSDP2's averages bit for bit.
MIXED = {"n": 128, "batch": 8, "optimizer": "adam", "k": 2, "epochs": 2}
POLICIES = {"bf16-32": {"param_dtype": "bf16", "reduce_dtype": "32"}, "bf16": {"param_dtype": "bf16"}}
# float16: FSDP2 divides by sqrt(R) before and after a float16 reduction (against overflow),
# lamploop sums and scales after; each rounds its own way.
FLOAT16 = {"param_dtype": "16"}


def _mixed_precision_jobs() -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = [{"kind": "hand", "name": "hand-mp-64", **MIXED}]
    for name, policy in [*POLICIES.items(), ("16", FLOAT16)]:
        jobs.append({"kind": "lamploop", "name": f"lamploop-mp-{name}", **MIXED, **policy})
        jobs.append({"kind": "hand", "name": f"hand-mp-{name}", **MIXED, **policy})
    return jobs


def _jobs(nranks: int) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    for case in CASES:
        name = _case_name(case)
        jobs.append({"kind": "lamploop", "name": f"lamploop-{name}", "n": N, "validate": True, **case})
        jobs.append({"kind": "hand", "name": f"hand-{name}", "n": N, **case})
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The 2-rank and the 3-rank run, started together (the 3-rank run loads the 2-rank
    checkpoint last, once it exists), and beside them the first runs through fit (:func:`fit_runs`)."""
    two, three = tmp_path_factory.mktemp("fsdp2"), tmp_path_factory.mktemp("fsdp3")
    fit_root = tmp_path_factory.mktemp("fit")
    first_fits = _first_fits(fit_root)
    adam = {"n": N, "optimizer": "adam", "k": 2}
    two_jobs = [
        *_jobs(2),
        # A checkpoint after epoch 1 of 2, the uninterrupted run, and the run resumed from it.
        {"kind": "lamploop", "name": "saved", "epochs": 1, "save": "ckpt", "save_at": 1, **adam},
        {"kind": "lamploop", "name": "resumed", "epochs": 2, "load": "ckpt", **adam},
        {"kind": "no_batch", "name": "no_batch"},
        *_mixed_precision_jobs(),
    ]
    (three / "ckpt").symlink_to(two / "ckpt", target_is_directory=True)
    three_jobs = [*_jobs(3), {"kind": "load_only", "name": "loaded", "optimizer": "adam", "load": "ckpt"}]
    started = [(two, _start(two, 2, two_jobs)), (three, _start(three, 3, three_jobs)), *first_fits]
    fsdp_fit = first_fits[1]
    try:
        _finish([fsdp_fit])  # the fsdp fit alone: the runs that resume from it start meanwhile
        second_fits = _second_fits(fit_root)
    except BaseException:
        for _, procs in started:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
        raise
    _finish([run for run in started if run is not fsdp_fit] + second_fits)
    return two, three, fit_root


@pytest.fixture(scope="module")
def two_ranks(runs: tuple[Path, Path, Path]) -> Path:
    return runs[0]


@pytest.fixture(scope="module")
def three_ranks(runs: tuple[Path, Path, Path]) -> Path:
    return runs[1]


def float64_reference(case: dict[str, Any], nranks: int) -> dict[str, torch.Tensor]:
    """One process, float64: each step's examples of every rank in one batch, mean loss."""
    x, y = worker.data(N)
    module = worker.mlp()
    optimizer = worker.optimizer_for(case["optimizer"], module.parameters())
    for epoch in range(case["epochs"]):
        for step in worker.plan(N, epoch, nranks, case["k"]):
            idx = torch.cat([i for batches in step for i in batches])
            nn.functional.cross_entropy(module(x[idx]), y[idx], reduction="mean").backward()
            if "clip" in case:
                torch.nn.utils.clip_grad_norm_(module.parameters(), case["clip"])
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach() for name, p in module.named_parameters()}


def _assert_close(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for name in got:
        error = float((got[name] - want[name]).abs().max())
        assert error <= EXACT, f"{what}: {name} differs by {error:.3g}"


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=_case_name)
def test_equals_torch_fsdp2_by_hand_and_float64_training(
    case: dict[str, Any], nranks: int, two_ranks: Path, three_ranks: Path
) -> None:
    rundir = two_ranks if nranks == 2 else three_ranks
    name = _case_name(case)
    got = load_file(str(rundir / f"lamploop-{name}.safetensors"))
    _assert_close(
        got, load_file(str(rundir / f"hand-{name}.safetensors")), f"{name}, {nranks} ranks vs FSDP2 by hand"
    )
    reference = float64_reference(case, nranks)
    _assert_close(got, reference, f"{name}, {nranks} ranks vs float64 on one process")
    start = worker.mlp()
    moved = max(float((p.detach() - reference[n]).abs().max()) for n, p in start.named_parameters())
    assert moved > 1e-3  # training moved the parameters: the comparison can tell


@pytest.mark.parametrize("nranks", [2, 3])
def test_validation_of_uneven_streams_is_the_mean_over_every_example(
    nranks: int, two_ranks: Path, three_ranks: Path
) -> None:
    """Rank 1 of 2 (rank 2 of 3) has one batch fewer: it runs a stand-in forward, which counts nothing."""
    rundir = two_ranks if nranks == 2 else three_ranks
    name = _case_name(CASES[0])
    module = worker.mlp()
    with torch.no_grad():
        for key, p in module.named_parameters():
            p.copy_(load_file(str(rundir / f"lamploop-{name}.safetensors"))[key])
        x, y = worker.data(N)
        expected = float(nn.functional.cross_entropy(module(x), y))
    for rank in range(nranks):
        got = json.loads((rundir / f"lamploop-{name}.rank{rank}.json").read_text())["validation_loss"]
        assert got == pytest.approx(expected, rel=1e-12, abs=0), f"rank {rank}"


def test_mixed_precision_equals_torch_fsdp2_by_hand_with_the_same_policy(two_ranks: Path) -> None:
    """``param_dtype="bf16"`` (forward and backward in bfloat16, float64 shards and Adam state),
    gradients reduce-scattered in float32 or in bfloat16, on Gloo: bit for bit FSDP2's own loop
    with the same ``MixedPrecisionPolicy``; and each policy changed the arithmetic."""
    full = load_file(str(two_ranks / "hand-mp-64.safetensors"))
    got = {name: load_file(str(two_ranks / f"lamploop-mp-{name}.safetensors")) for name in POLICIES}
    for name in POLICIES:
        hand = load_file(str(two_ranks / f"hand-mp-{name}.safetensors"))
        assert got[name].keys() == hand.keys() == full.keys()
        for key, tensor in got[name].items():
            assert tensor.dtype == torch.float64, key  # the shards keep their own dtype
            assert torch.equal(tensor, hand[key]), f"{name}: {key} differs from FSDP2 by hand"
        moved = max(float((got[name][k] - full[k]).abs().max()) for k in full)
        assert moved > 1e-5, f"{name}: no different from float64 ({moved:.3g})"
    reduce_dtype = max(float((got["bf16-32"][k] - got["bf16"][k]).abs().max()) for k in full)
    assert reduce_dtype > 1e-6, "reducing in float32 or in bfloat16 made no difference"
    # float16 (param_dtype="16"): FSDP2's divisions round otherwise; close, and not float64.
    half = load_file(str(two_ranks / "lamploop-mp-16.safetensors"))
    half_by_hand = load_file(str(two_ranks / "hand-mp-16.safetensors"))
    assert max(float((half[k] - half_by_hand[k]).abs().max()) for k in full) < 1e-5  # 1.0e-6 measured
    assert max(float((half[k] - full[k]).abs().max()) for k in full) > 3e-5  # 1.0e-4 measured


def test_a_rank_without_any_batch_is_refused_on_every_rank(two_ranks: Path) -> None:
    for rank in range(2):
        message = (two_ranks / f"no_batch.rank{rank}.txt").read_text()
        assert message.startswith("BatchError: 1 of 2 ranks have no training batch"), message
        assert message.endswith("(every rank: True)"), message


def test_resume_from_a_sharded_checkpoint_is_bitwise(two_ranks: Path) -> None:
    uninterrupted = load_file(str(two_ranks / "lamploop-adam-k2.safetensors"))
    resumed = load_file(str(two_ranks / "resumed.safetensors"))
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name


def test_a_two_rank_checkpoint_loads_on_three_ranks_and_on_one(two_ranks: Path, three_ranks: Path) -> None:
    saved = load_file(str(two_ranks / "saved.safetensors"))
    _assert_close(load_file(str(three_ranks / "loaded.safetensors")), saved, "2 -> 3 ranks")
    model, optimizer, meta = read_full(two_ranks / "ckpt")  # the root: follows `latest`
    assert meta == {"epoch": 1}
    for name, tensor in saved.items():
        assert torch.equal(model[name], tensor), name
    # One rank: a plain module and optimizer, from the same shards.
    module = worker.mlp(seed=7)
    plain = worker.optimizer_for("adam", module.parameters())
    load_sharded(two_ranks / "ckpt", module=module, optimizer=plain)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
    state = plain.state_dict()
    assert set(state["state"]) == {0, 1, 2, 3}
    assert torch.equal(state["state"][0]["exp_avg"], optimizer["state"][0]["exp_avg"])
    assert float(state["state"][0]["step"]) > 0


def test_verify_names_an_altered_or_missing_shard(two_ranks: Path, tmp_path: Path) -> None:
    source = two_ranks / "ckpt" / "epoch-000001"
    assert verify_sharded(source) == []
    copy = tmp_path / "epoch-000001"
    copy.mkdir()
    for path in source.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    shard = copy / shard_file(1, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify_sharded(copy)
    assert any(shard.name in p and "sha256" in p for p in problems), problems
    # verify_checkpoint (lamploop inspect) reads save_sharded's checkpoints too: the index stands in
    # for the descriptor.
    assert verify_checkpoint(source).ok
    report = verify_checkpoint(copy)
    assert [f.name for f in report.files] == ["sharded.json", shard_file(0, 2), shard_file(1, 2)]
    assert any(shard.name in p and "sha256" in p for p in report.problems), report.problems
    shard.unlink()
    assert any(shard.name in p for p in verify_sharded(copy))
    with pytest.raises(Exception, match=shard.name):
        read_full(copy)


def test_refuses_an_unsharded_model_and_a_bad_dtype() -> None:
    with pytest.raises(ConfigurationError, match="shard the model first"):
        FullyShard().gradient_sync(None, [], [nn.Linear(2, 2)], bucket_cap_mb=25.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="param_dtype"):
        FullyShard(param_dtype="fp8")


def test_shard_refuses_a_bare_process_group_and_a_module_that_is_none(tmp_path: Path) -> None:
    """``shard`` takes lamploop's Collectives; a torch process group (what FSDP2's own
    ``fully_shard`` takes) is refused naming both, not an AttributeError from inside."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    group = dist.ProcessGroupGloo(store, 0, 1)
    module = worker.mlp()
    with pytest.raises(ConfigurationError, match=r"Collectives .*got ProcessGroupGloo"):
        FullyShard().shard(group, module)  # type: ignore[arg-type]
    collectives = Collectives(group, rank=0, nranks=1, device=torch.device("cpu"), timeout=5.0)
    with pytest.raises(ConfigurationError, match=r"module must be a torch.nn.Module, got NoneType"):
        FullyShard().shard(collectives, None)  # type: ignore[arg-type]
    assert not any(type(p).__name__ == "DTensor" for p in module.parameters())


def test_a_torch_whose_fsdp2_lacks_a_needed_method_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch 2.11's FSDP2 has no ``set_reduce_scatter_unused_params`` (a GPU machine's torch
    2.11.0+cu130 raised AttributeError from deep inside ``shard``): both ``shard`` and ``fit``
    refuse such a torch with a ConfigurationError naming the method, before any rank starts."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    module = worker.mlp()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    with pytest.raises(
        ConfigurationError, match=r"FullyShard.shard: .*FSDPModule.set_reduce_scatter_unused_params"
    ):
        FullyShard().shard(None, module)  # type: ignore[arg-type]  # refused before it is used
    assert not isinstance(module, FSDPModule)
    assert all(torch.equal(p, before[name]) for name, p in module.named_parameters())
    launched = tmp_path / "launched"
    with pytest.raises(
        ConfigurationError, match=r"^fit: strategy 'fsdp' needs .*set_reduce_scatter_unused_params"
    ):
        lamploop.fit(
            model=lamploop.SupervisedModel(worker.mlp()),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(torch.randn(8, 4), torch.randint(0, 2, (8,)), batch_size=4),
            max_epochs=1,
            device="cpu",
            world_size=2,
            strategy="fsdp",
            launch_command=[sys.executable, "-c", f"open({str(launched)!r}, 'w')"],
            reporters=[],
        )
    assert not launched.exists()


def test_importing_lamploop_leaves_fsdp2_and_dtensor_to_the_first_sharded_model() -> None:
    """FSDP2 and DTensor (with sympy) cost every process about 1.2 s of start-up: ``import
    lamploop`` and an unsharded forward leave them unimported; sharding imports them, and the
    names moved to ``lamploop.sync.fsdp_collectives`` are still ``lamploop.sync.fsdp``'s."""
    script = """
import sys, torch, lamploop
from lamploop.sync import fsdp
heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "sympy")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
module = torch.nn.Linear(2, 2)
assert not fsdp.is_sharded(module) and not fsdp.is_dtensor(module.weight)
assert fsdp.local_bytes([module.weight, None]) == 16
assert not [m for m in heavy if m in sys.modules]
from lamploop.sync import fsdp_collectives
assert fsdp.mesh_of is fsdp_collectives.mesh_of
assert fsdp.AbortableAllGather is fsdp_collectives.AbortableAllGather
from torch.distributed.fsdp import FSDPModule
assert fsdp.FSDP2_METHODS
try:
    fsdp.no_such_name
except AttributeError as exc:
    assert "no_such_name" in str(exc)
else:
    raise AssertionError("fsdp.no_such_name resolved")
print("ok")
"""
    # A fresh interpreter, not a warm worker (tests/workers/warm_start.py): what gets imported is the point.
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok", result.stdout


def test_save_refuses_an_existing_checkpoint_name_on_one_rank(tmp_path: Path) -> None:
    """One rank over a one-rank Gloo group: the whole flow, and a second save of the same name refused."""
    import datetime

    import torch.distributed as dist

    from lamploop.distributed.process_group import new_process_group

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    cpu = torch.device("cpu")
    group = new_process_group(store, rank=0, nranks=1, device=cpu, timeout=30, prefix="t")
    collectives = Collectives(group, rank=0, nranks=1, device=cpu, timeout=30)
    module = worker.mlp()
    FullyShard().shard(collectives, module)
    path = save_sharded(tmp_path, collectives=collectives, module=module, optimizer=None, epoch=3)
    assert (tmp_path / "latest").read_text().strip() == path.name == "epoch-000003"
    model, _, _ = read_full(path)
    for name, p in worker.mlp().named_parameters():
        assert torch.equal(model[name], p.detach())
    with pytest.raises(Exception, match="exists already"):
        save_sharded(tmp_path, collectives=collectives, module=module, optimizer=None, epoch=3)


def test_prepare_rebuilds_the_optimizer_over_the_shards_with_its_state() -> None:
    """What a driver would call after the ranks met: the optimizer, made before sharding and
    holding state (a resumed run's), continues over the DTensor shards with the same state."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lamploop.distributed.process_group import new_process_group

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    cpu = torch.device("cpu")
    group = new_process_group(store, rank=0, nranks=1, device=cpu, timeout=30, prefix="p")
    collectives = Collectives(group, rank=0, nranks=1, device=cpu, timeout=30)
    module, twin = worker.mlp(), worker.mlp()
    optimizer = worker.optimizer_for("adam", module.parameters())
    twin_optimizer = worker.optimizer_for("adam", twin.parameters())
    x, y = worker.data(12)
    for m, opt in ((module, optimizer), (twin, twin_optimizer)):
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    rebuilt = FullyShard().prepare(collectives, module, optimizer)
    assert rebuilt is not None
    assert all(isinstance(p, DTensor) for p in module.parameters())
    for m, opt in ((module, rebuilt), (twin, twin_optimizer)):
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.detach()), name  # type: ignore[attr-defined]


# --- through fit: strategy="fsdp" on processes fit starts itself ---------------------------------------

FIT_WORKER = WORKERS / "fsdp_fit.py"


def _fit(out: Path, **config: Any) -> Any:
    """``fit`` as rank 0 of ``config["world_size"]`` in a process of its own (it starts the others)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(FIT_WORKER.parents[2])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(name, None)  # rank 0 without a launcher: fit launches its followers
    return warm_start.popen(
        [sys.executable, str(FIT_WORKER), str(out), json.dumps(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _first_fits(root: Path) -> list[tuple[Path, list[Any]]]:
    """all_reduce and fsdp through fit for 3 epochs (started by :func:`runs`, beside its runs)."""
    return [
        (root / "all_reduce", [_fit(root / "all_reduce", strategy="all_reduce", world_size=2, max_epochs=3)]),
        (
            root / "fsdp",
            [
                _fit(
                    root / "fsdp",
                    strategy="fsdp",
                    world_size=2,
                    max_epochs=3,
                    checkpoint_dir=str(root / "fsdp-ck"),
                    every_n_steps=2,
                )
            ],
        ),
    ]


@pytest.fixture(scope="module")
def fit_runs(runs: tuple[Path, Path, Path]) -> Path:
    """Through fit (MLP 6-13-5, float64, Adam, accumulation 2, validation, 2 ranks): all_reduce
    and fsdp for 3 epochs (:func:`_first_fits`, checkpointing at epoch ends and after step 2 of
    each); then resumed from the step-2 checkpoint of epoch 1 on 2 ranks, and from the epoch-2
    checkpoint on 3 ranks with nothing left to train (:func:`_second_fits`)."""
    return runs[2]


def _second_fits(root: Path) -> list[tuple[Path, list[Any]]]:
    """The runs that resume from the fsdp fit's checkpoints (see :func:`fit_runs`)."""
    for copy in ("ck3", "ck1"):  # the run as it was after epoch 2
        shutil.copytree(
            root / "fsdp-ck", root / copy, ignore=shutil.ignore_patterns("epoch-000002-*", "epoch-000003*")
        )
        (root / copy / "latest").write_text("epoch-000002\n")
    # ... and after step 2 of epoch 1 (a step boundary inside an epoch)
    shutil.copytree(
        root / "fsdp-ck", root / "ck-step", ignore=shutil.ignore_patterns("epoch-000002*", "epoch-000003*")
    )
    (root / "ck-step" / "latest").write_text("epoch-000001-step-000002\n")
    second = {
        "resumed-step": _fit(
            root / "resumed-step",
            strategy="fsdp",
            world_size=2,
            max_epochs=3,
            checkpoint_dir=str(root / "ck-step"),
        ),
        "three": _fit(
            root / "three", strategy="fsdp", world_size=3, max_epochs=2, checkpoint_dir=str(root / "ck3")
        ),
    }
    return [(root / name, [proc]) for name, proc in second.items()]


def _params(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "params.safetensors"))


def test_fit_fsdp_equals_fit_all_reduce(fit_runs: Path) -> None:
    """Same learning curve and the same model at the end (the best epoch's, gathered whole
    into the root's ``model.module``) as all_reduce, to float64 rounding."""
    sharded, plain = _params(fit_runs / "fsdp"), _params(fit_runs / "all_reduce")
    _assert_close(sharded, plain, "fit fsdp vs fit all_reduce")
    start = fit_worker.module()
    assert max(float((p.detach() - plain[n]).abs().max()) for n, p in start.named_parameters()) > 1e-3
    curves = [json.loads((fit_runs / name / "result.json").read_text()) for name in ("fsdp", "all_reduce")]
    assert curves[0]["epoch"] == curves[1]["epoch"] == 3
    for (got_train, got_valid), (want_train, want_valid) in zip(
        curves[0]["curve"], curves[1]["curve"], strict=True
    ):
        assert got_train == pytest.approx(want_train, rel=1e-12, abs=0)
        assert got_valid == pytest.approx(want_valid, rel=1e-12, abs=0)


def test_fit_fsdp_checkpoints_are_sharded_verified_and_load_whole(fit_runs: Path) -> None:
    report = verify_checkpoint(fit_runs / "fsdp-ck")
    assert report.ok, report.problems
    assert report.path.name == "epoch-000003"
    assert [c.path.name for c in report.checkpoints] == [
        "epoch-000000-step-000002",
        "epoch-000001",
        "epoch-000001-step-000002",
        "epoch-000002",
        "epoch-000002-step-000002",
        "epoch-000003",
    ]
    names = [f.name for f in report.files]
    assert {"sharded.json", shard_file(0, 2), shard_file(1, 2)} <= set(names)
    assert not report.notes  # every file is listed by the descriptor or the index
    checkpoint = load_checkpoint(fit_runs / "fsdp-ck")  # one process: an ordinary checkpoint
    assert (
        checkpoint.state.best_model.keys()
        == checkpoint.state.model.keys()
        == _params(fit_runs / "fsdp").keys()
    )
    _assert_close(checkpoint.state.best_model, _params(fit_runs / "fsdp"), "the checkpoint's best model")
    assert set(checkpoint.state.optimizer["state"]) == {0, 1, 2, 3}
    assert sharded_model_spec(report.path) == model_spec(fit_worker.module())  # read from the index
    # lamploop inspect's model summary: the whole model's parameters, not one rank's rows.
    whole = sum(p.numel() for p in fit_worker.module().state_dict().values())
    summary = model_tensor_summary(report.path)
    assert summary is not None
    assert summary.elements == whole
    # What a resuming fsdp run of several ranks gets: the tensors stay for each rank to read its rows.
    left = load_checkpoint_leaving_shards(fit_runs / "fsdp-ck", model=fit_worker.module())
    assert isinstance(left.state.model, ShardsOnDisk)
    assert left.state.model.directory == report.path
    assert not left.state.best_model
    assert "state" not in left.state.optimizer
    with pytest.raises(CheckpointError, match="does not fit the given model"):
        load_checkpoint_leaving_shards(fit_runs / "fsdp-ck", model=nn.Linear(6, 5).double())


def test_a_resumed_fit_fsdp_equals_the_uninterrupted_one(fit_runs: Path) -> None:
    """Bitwise, from step 2 of epoch 1 (a step boundary; the best model of epoch 0 travels in
    the checkpoint's shards).  Epoch ends are resumed from below, at 3 ranks and at 1."""
    uninterrupted, resumed = _params(fit_runs / "fsdp"), _params(fit_runs / "resumed-step")
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name


def test_fit_fsdp_releases_the_callers_parameters_while_it_runs(fit_runs: Path) -> None:
    """Each rank trains its shards of a twin; the caller's module holds no parameter storage
    until the run ends (then the whole model)."""
    result = json.loads((fit_runs / "fsdp" / "result.json").read_text())
    assert result["held"] == [0, 0, 0]
    assert sum(t.numel() for t in _params(fit_runs / "fsdp").values()) == 6 * 13 + 13 + 13 * 5 + 5
    plain = json.loads((fit_runs / "all_reduce" / "result.json").read_text())
    assert plain["held"] == [6 * 13 + 13 + 13 * 5 + 5] * 3


def test_a_two_rank_fit_checkpoint_resumes_on_three_ranks_and_on_one(fit_runs: Path) -> None:
    """Resharded: the model each run ends with (nothing left to train: the checkpoint's best
    model) equals the checkpoint's, read whole; one rank trains without sharding."""
    best = read_best(fit_runs / "ck3" / "epoch-000002")
    assert best
    _assert_close(_params(fit_runs / "three"), best, "2 -> 3 ranks")
    kwargs = fit_worker.fit_kwargs(
        {"strategy": "fsdp", "max_epochs": 2, "checkpoint_dir": str(fit_runs / "ck1")}
    )
    state = lamploop.fit(**kwargs, world_size=1)
    assert state is not None
    assert state.epoch == 2
    _assert_close(dict(kwargs["model"].module.state_dict()), best, "2 -> 1 rank")


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [("precision", "fp16", "precision='fp16'"), ("averaging", lamploop.averaging.ema(0.9), "averaging")],
)
def test_fit_refuses_what_fsdp_cannot_do_before_any_rank_starts(setting: str, value: Any, named: str) -> None:
    kwargs = fit_worker.fit_kwargs({"strategy": "fsdp", "max_epochs": 1})
    never = [sys.executable, "-c", "raise SystemExit('no rank may start')"]
    with pytest.raises(ConfigurationError, match=rf"fit: {re.escape(named)}.*strategy 'fsdp'"):
        lamploop.fit(**kwargs, world_size=2, launch_command=never, **{setting: value})


def test_drive_refuses_a_checkpointer_as_checkpoint_state_under_fsdp(tmp_path: Path) -> None:
    """The root alone would write it: fsdp's checkpoints go through checkpoint_position."""
    kwargs = fit_worker.fit_kwargs({"strategy": "fsdp", "max_epochs": 1})

    async def drive() -> None:
        await lamploop.drive_distributed_training(
            nranks=2,
            device="cpu",
            control=None,
            model=kwargs["model"],
            optimizer_factory=kwargs["optimizer_factory"],
            train_batches=kwargs["train_batches"],
            validation_batches=None,
            max_epochs=1,
            checkpoint_state=lamploop.checkpoint.Checkpointer(tmp_path),
            settings=lamploop.TrainingSettings(strategy="fsdp"),
        )

    with pytest.raises(ConfigurationError, match=re.escape("checkpoint_position=checkpointer.save_position")):
        anyio.run(drive)
