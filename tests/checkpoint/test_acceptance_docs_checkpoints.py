"""Acceptance tests of checkpoints, resuming and ``lamploop inspect``, written from the docs alone.

Sources: docs/checkpoints.md, docs/how-to/resume.md, docs/cli.md, the public docstrings of
``lamploop.checkpoint`` and ``lamploop.errors``, and /work/shared/DESIGN.md section 6.  Every
reference value is computed here (hashlib, safetensors, json), not taken from lamploop.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import lamploop
from lamploop.checkpoint import (
    BEST_MODEL_FILE,
    DESCRIPTOR_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    Checkpointer,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    restore_optimizer_state,
    save_checkpoint,
    verify_checkpoint,
)
from lamploop.errors import CheckpointError, ConfigurationError, LamploopError
from lamploop.loop import epochs
from lamploop.schedules import PlateauState, reduce_lr_on_plateau
from lamploop.state import (
    LearningCurveEntry,
    LoopState,
    LoopStateWithModelAndOptimizerData,
    converter,
)

CLI_TIMEOUT = 60


# --------------------------------------------------------------------------- helpers


class Net(torch.nn.Module):
    def __init__(self, inputs: int = 5, outputs: int = 10) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def adam_state(module: torch.nn.Module, steps: int = 2) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    first = next(module.parameters())
    x = torch.randn(4, first.shape[1], generator=generator)  # the first layer's inputs
    for _ in range(steps):
        optimizer.zero_grad()
        module(x).pow(2).mean().backward()
        optimizer.step()
    return optimizer


def state_of(
    epoch: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    best: Mapping[str, torch.Tensor] | None = None,
    curve: tuple[LearningCurveEntry, ...] = (),
    **loop: Any,
) -> LoopStateWithModelAndOptimizerData:
    return LoopStateWithModelAndOptimizerData(
        loop_state=LoopState(epoch=epoch, learning_curve=curve, **loop),
        model={k: v.detach().clone() for k, v in module.state_dict().items()},
        optimizer=optimizer.state_dict(),
        best_model={} if best is None else best,
    )


def save_run(root: Path, epochs_to_save: Iterator[int] | list[int], keep_last: int | None = None) -> None:
    torch.manual_seed(0)
    module = Net()
    optimizer = adam_state(module)
    for epoch in epochs_to_save:
        with torch.no_grad():
            module.fc.bias.fill_(float(epoch))
        save_checkpoint(root, state_of(epoch, module, optimizer), keep_last=keep_last)


def descriptor(directory: Path) -> dict[str, Any]:
    return json.loads((directory / DESCRIPTOR_NAME).read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def checkpoint_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("epoch-"))


def assert_clear(error: BaseException, *, starts_with: Path, contains: str = "") -> None:
    message = str(error)
    assert isinstance(error, LamploopError)
    assert message.startswith(str(starts_with)), message
    assert contains in message, message


def tensors_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- checkpoints.md: example


def test_checkpoints_md_first_example_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    curve = (LearningCurveEntry(epoch=2, training_loss=0.5),)
    loop_state = LoopState(epoch=3, learning_curve=curve)
    state = LoopStateWithModelAndOptimizerData(
        loop_state=loop_state, model=model.state_dict(), optimizer=optimizer.state_dict()
    )
    path = save_checkpoint(tmp_path, state, schedule_state=PlateauState(0.5), keep_last=3)
    assert path == tmp_path / "epoch-000003"

    resumed = torch.nn.Linear(3, 1)
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.1)
    checkpoint = load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau(), model=resumed, restore_rng=True)
    resumed.load_state_dict(checkpoint.state.model)
    restore_optimizer_state(resumed_optimizer, checkpoint)

    assert checkpoint.path.name == "epoch-000003"
    assert checkpoint.position is None
    assert checkpoint.state.loop_state == loop_state
    assert checkpoint.schedule_state == PlateauState(factor=0.5)
    assert dict(checkpoint.state.best_model) == {}
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for _ in range(2):
        for m, opt in ((model, optimizer), (resumed, resumed_optimizer)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    assert torch.equal(model.weight, resumed.weight)
    assert torch.equal(model.bias, resumed.bias)


def test_schedule_state_raw_json_without_schedule(tmp_path: Path) -> None:
    module = Net()
    save_checkpoint(
        tmp_path,
        state_of(1, module, adam_state(module)),
        schedule_state=PlateauState(0.25, best=1.5, bad_validations=2),
    )
    raw = load_checkpoint(tmp_path).schedule_state
    assert raw == converter.unstructure(PlateauState(0.25, best=1.5, bad_validations=2))
    assert isinstance(raw, dict)
    structured = load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau()).schedule_state
    assert structured == PlateauState(0.25, best=1.5, bad_validations=2)


# --------------------------------------------------------------------------- what is on disk


def test_what_is_on_disk(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Net()
    optimizer = adam_state(module)
    best = {k: v.detach().clone() + 1 for k, v in module.state_dict().items()}
    curve = (LearningCurveEntry(epoch=0, training_loss=1.0, validation_loss=(0.5, 0.5)),)
    first = save_checkpoint(tmp_path, state_of(1, module, optimizer), keep_last=None)
    rng_before = (torch.get_rng_state().clone(), np.random.get_state()[1].copy())
    path = save_checkpoint(
        tmp_path,
        state_of(6, module, optimizer, best=best, curve=curve),
        schedule_state=PlateauState(0.5),
        keep_last=None,
    )
    assert path == tmp_path / "epoch-000006" == tmp_path / checkpoint_name(6)
    assert checkpoint_name(5, 120) == "epoch-000005-step-000120"

    # latest: one line naming the newest
    assert (tmp_path / LATEST_NAME).read_text().splitlines() == ["epoch-000006"]
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [DESCRIPTOR_NAME, MODEL_FILE, BEST_MODEL_FILE, OPTIMIZER_FILE, RNG_FILE]
    )

    d = descriptor(path)
    assert d["format_version"] == FORMAT_VERSION == 2
    assert d["lamploop_version"] == lamploop.__version__
    assert isinstance(d["saved_at_unix_ns"], int)
    assert descriptor(first)["sequence"] + 1 == d["sequence"]
    assert d["position"] is None
    assert d["rank_rngs"] == []
    assert "extras" not in d
    assert converter.structure(d["loop_state"], LoopState) == LoopState(epoch=6, learning_curve=curve)
    assert "PlateauState" in d["schedule_state_type"]
    assert d["schedule_state"] == converter.unstructure(PlateauState(0.5))

    # files: sha256 and size of each safetensors file, from the bytes on disk
    on_disk = {p.name for p in path.glob("*.safetensors")}
    assert set(d["files"]) == on_disk
    for name, record in d["files"].items():
        assert record == {"sha256": sha256(path / name), "size": (path / name).stat().st_size}

    # model and best model: the state dicts, specs in order
    sd = module.state_dict()
    on_disk_model = load_file(path / MODEL_FILE)
    assert set(on_disk_model) == set(sd)
    assert all(torch.equal(on_disk_model[k], sd[k]) for k in sd)
    assert set(load_file(path / BEST_MODEL_FILE)) == set(best)
    for k in best:
        assert torch.equal(load_file(path / BEST_MODEL_FILE)[k], best[k])
    spec = [{"name": k, "shape": list(v.shape), "dtype": "float32"} for k, v in sd.items()]
    assert d["model_spec"]["tensors"] == spec
    assert d["best_model_spec"]["tensors"] == spec

    # optimizer: $tensor references into optimizer.safetensors, $int_keys, $tuple
    stored = load_file(path / OPTIMIZER_FILE)
    listed = d["optimizer_tensors"]["tensors"]
    assert {t["name"] for t in listed} == set(stored)
    for t in listed:
        assert t["shape"] == list(stored[t["name"]].shape)
        assert t["dtype"] == str(stored[t["name"]].dtype).removeprefix("torch.")
    assert d["optimizer"]["param_groups"][0]["betas"] == {"$tuple": [0.9, 0.999]}
    int_keyed = d["optimizer"]["state"]["$int_keys"]
    live = optimizer.state_dict()["state"]
    assert sorted(int_keyed) == sorted(str(k) for k in live)
    for index, per_param in live.items():
        for key, value in per_param.items():
            ref = int_keyed[str(index)][key]
            assert set(ref) == {"$tensor"}
            assert torch.equal(stored[ref["$tensor"]], value)

    # rng.safetensors holds torch's CPU state and numpy's keys of the saving process
    rng = load_file(path / RNG_FILE)
    assert any(t.dtype == torch.uint8 and torch.equal(t, rng_before[0]) for t in rng.values())
    keys = torch.from_numpy(rng_before[1].astype(np.int64))
    assert any(
        t.numel() == keys.numel() and torch.equal(t.to(torch.int64).flatten(), keys) for t in rng.values()
    )
    assert d["rng"]["cuda_devices"] == torch.cuda.device_count()


def test_best_model_file_without_tensors_before_the_first(tmp_path: Path) -> None:
    module = Net()
    path = save_checkpoint(tmp_path, state_of(1, module, adam_state(module)))
    with safe_open(path / BEST_MODEL_FILE, framework="pt") as f:
        assert list(f.keys()) == []
    assert descriptor(path)["best_model_spec"]["tensors"] == []


def test_optimizer_state_comes_back_exactly(tmp_path: Path) -> None:
    """$tuple, $int_keys, $pairs, $float; numpy scalars come back as Python scalars."""
    optimizer = {
        "state": {0: {"step": torch.tensor(3.0), "buf": torch.arange(4.0)}, 1: {"step": 7.0}},
        "param_groups": [
            {
                "params": [0, 1],
                "betas": (0.9, 0.99),
                "nested": [(1, 2), [3, (4,)]],
                "inf": float("inf"),
                "ninf": float("-inf"),
                "nan": float("nan"),
                "dollar": {"$tensor": "not a reference", "plain": 1},
                "mixed_keys": {0: "zero", "one": 1},
                "float_keys": {1.5: "a"},
                "np": np.float64(0.25),
                "npi": np.int64(3),
                "none": None,
                "flag": True,
                "name": "adam",
            }
        ],
    }
    module_state = {"w": torch.zeros(2)}
    state = LoopStateWithModelAndOptimizerData(LoopState(epoch=2), module_state, optimizer)
    path = save_checkpoint(tmp_path, state)

    raw = descriptor(path)["optimizer"]
    group = raw["param_groups"][0]
    assert group["nan"] == {"$float": "nan"}
    assert group["betas"] == {"$tuple": [0.9, 0.99]}
    assert set(raw["state"]) == {"$int_keys"}
    assert set(group["dollar"]) == {"$pairs"}

    back = load_checkpoint(path).state.optimizer
    assert set(back["state"]) == {0, 1}
    assert torch.equal(back["state"][0]["step"], torch.tensor(3.0))
    assert torch.equal(back["state"][0]["buf"], torch.arange(4.0))
    assert back["state"][1] == {"step": 7.0}
    assert type(back["state"][1]["step"]) is float
    g = back["param_groups"][0]
    assert g["params"] == [0, 1]
    assert type(g["params"]) is list
    assert g["betas"] == (0.9, 0.99)
    assert type(g["betas"]) is tuple
    assert g["nested"] == [(1, 2), [3, (4,)]]
    assert type(g["nested"][0]) is tuple
    assert type(g["nested"][1][1]) is tuple
    assert g["inf"] == math.inf
    assert g["ninf"] == -math.inf
    assert math.isnan(g["nan"])
    assert g["dollar"] == {"$tensor": "not a reference", "plain": 1}
    assert g["mixed_keys"] == {0: "zero", "one": 1}
    assert g["float_keys"] == {1.5: "a"}
    assert g["np"] == 0.25
    assert type(g["np"]) is float
    assert g["npi"] == 3
    assert type(g["npi"]) is int
    assert g["none"] is None
    assert g["flag"] is True
    assert g["name"] == "adam"


def test_refuses_what_cannot_be_stored_without_pickle(tmp_path: Path) -> None:
    model = {"w": torch.zeros(2)}
    bad_optimizer = {"state": {}, "param_groups": [{"params": [0], "obj": object()}]}
    with pytest.raises(CheckpointError):
        save_checkpoint(
            tmp_path, LoopStateWithModelAndOptimizerData(LoopState(epoch=1), model, bad_optimizer)
        )
    good_optimizer = {"state": {}, "param_groups": []}
    with pytest.raises(CheckpointError):
        save_checkpoint(
            tmp_path,
            LoopStateWithModelAndOptimizerData(LoopState(epoch=1), {"w": [1.0, 2.0]}, good_optimizer),  # type: ignore[dict-item]
        )
    with pytest.raises(CheckpointError):
        save_checkpoint(
            tmp_path,
            LoopStateWithModelAndOptimizerData(LoopState(epoch=1), model, good_optimizer),
            schedule_state=object(),
        )
    # nothing half-written is left under a checkpoint name
    assert not tmp_path.exists() or checkpoint_dirs(tmp_path) == []


def test_tensors_saved_contiguous_on_cpu_shared_stored_separately(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    model = {
        "tied_a": base,
        "tied_b": base,  # the same storage
        "transposed": base.t(),  # not contiguous
        "half": torch.arange(3, dtype=torch.bfloat16),
        "ints": torch.arange(5, dtype=torch.int64),
    }
    state = LoopStateWithModelAndOptimizerData(LoopState(epoch=1), model, {"state": {}, "param_groups": []})
    path = save_checkpoint(tmp_path, state)
    on_disk = load_file(path / MODEL_FILE)
    assert set(on_disk) == set(model)
    back = load_checkpoint(path, model=model).state.model
    assert list(back) == list(model)
    for k, v in model.items():
        assert back[k].device.type == "cpu"
        assert back[k].dtype == v.dtype
        assert torch.equal(back[k], v)
        assert torch.equal(on_disk[k], v)
    assert back["tied_a"].data_ptr() != back["tied_b"].data_ptr()


# --------------------------------------------------------------------------- keep_last, sequence, latest


def test_keep_last_keeps_exactly_the_most_recently_saved(tmp_path: Path) -> None:
    save_run(tmp_path / "two", [1, 2, 3, 4, 5], keep_last=2)
    assert checkpoint_dirs(tmp_path / "two") == ["epoch-000004", "epoch-000005"]
    save_run(tmp_path / "all", [1, 2, 3, 4, 5], keep_last=None)
    assert checkpoint_dirs(tmp_path / "all") == [f"epoch-00000{e}" for e in range(1, 6)]
    sequences = [descriptor(tmp_path / "all" / f"epoch-00000{e}")["sequence"] for e in range(1, 6)]
    assert sequences == list(range(sequences[0], sequences[0] + 5))
    save_run(tmp_path / "one", [1, 2, 3], keep_last=1)
    assert checkpoint_dirs(tmp_path / "one") == ["epoch-000003"]
    assert (tmp_path / "one" / LATEST_NAME).read_text().strip() == "epoch-000003"


def test_keep_last_orders_by_save_not_position(tmp_path: Path) -> None:
    """A run resumed from an older checkpoint: the stale later epochs go first."""
    save_run(tmp_path, [1, 2, 3, 4, 5], keep_last=3)
    assert checkpoint_dirs(tmp_path) == ["epoch-000003", "epoch-000004", "epoch-000005"]
    save_run(tmp_path, [2], keep_last=3)  # resumed from epoch 1, saves epoch 2 again
    assert checkpoint_dirs(tmp_path) == ["epoch-000002", "epoch-000004", "epoch-000005"]
    assert (tmp_path / LATEST_NAME).read_text().strip() == "epoch-000002"
    assert load_checkpoint(tmp_path).path.name == "epoch-000002"
    save_run(tmp_path, [3, 4], keep_last=3)
    assert checkpoint_dirs(tmp_path) == ["epoch-000002", "epoch-000003", "epoch-000004"]
    assert (
        descriptor(tmp_path / "epoch-000004")["sequence"] > descriptor(tmp_path / "epoch-000002")["sequence"]
    )


def test_saving_the_same_epoch_again_replaces_it(tmp_path: Path) -> None:
    module = Net()
    optimizer = adam_state(module)
    save_checkpoint(tmp_path, state_of(2, module, optimizer))
    with torch.no_grad():
        module.fc.weight.add_(1.0)
    save_checkpoint(tmp_path, state_of(2, module, optimizer))
    assert checkpoint_dirs(tmp_path) == ["epoch-000002"]
    assert torch.equal(load_checkpoint(tmp_path).state.model["fc.weight"], module.fc.weight.detach())


def test_latest_checkpoint(tmp_path: Path) -> None:
    tmp_path.joinpath("empty").mkdir()
    assert latest_checkpoint(tmp_path / "empty") is None
    root = tmp_path / "run"
    save_run(root, [3, 1], keep_last=None)  # epoch 1 was saved last
    assert latest_checkpoint(root) == root / "epoch-000001"
    (root / LATEST_NAME).unlink()
    # without `latest`: the most recently saved complete checkpoint, not the highest epoch
    assert latest_checkpoint(root) == root / "epoch-000001"
    assert load_checkpoint(root).path == root / "epoch-000001"


def test_latest_must_hold_a_checkpoint_name(tmp_path: Path) -> None:
    save_run(tmp_path / "a", [1])
    save_run(tmp_path / "b", [1])
    (tmp_path / "b" / LATEST_NAME).write_text("../a/epoch-000001\n")
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path / "b")
    assert str(info.value).startswith(str(tmp_path / "b" / LATEST_NAME))


def test_latest_naming_a_missing_directory_falls_back(tmp_path: Path) -> None:
    """checkpoints.md, Guarantees, "Falls back": latest_checkpoint falls back the same way."""
    save_run(tmp_path, [1, 2], keep_last=None)
    (tmp_path / LATEST_NAME).write_text("epoch-000009\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch-000002"
    assert load_checkpoint(tmp_path).path == tmp_path / "epoch-000002"


# --------------------------------------------------------------------------- Checkpointer + epochs()


def test_checkpointer_with_epochs_doc_example(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 2), torch.randn(16, 1)

    async def train_epoch(lr_factor: float) -> float:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    async def nothing() -> None:
        pass

    checkpointer = Checkpointer(tmp_path, keep_last=2)
    assert checkpointer.last_path is None

    async def main() -> LoopState:
        async def checkpoint_state(loop_state: LoopState, schedule_state: object) -> None:
            data = LoopStateWithModelAndOptimizerData(loop_state, model.state_dict(), optimizer.state_dict())
            await checkpointer(data, schedule_state)

        return await epochs(
            max_epochs=4,
            train_epoch=train_epoch,
            validation_epoch=None,
            save_min_validation_loss_model=nothing,
            checkpoint_state=checkpoint_state,
        )

    final = anyio.run(main)
    checkpoint = load_checkpoint(tmp_path, model=model)
    assert checkpoint.path.name == "epoch-000004"
    assert checkpointer.last_path == tmp_path / "epoch-000004"
    assert checkpoint.state.loop_state == final
    assert [e.epoch for e in final.learning_curve] == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-000003", "epoch-000004", "latest"]
    assert torch.equal(checkpoint.state.model["weight"], model.weight.detach())


def test_checkpointer_captures_rng_at_the_call(tmp_path: Path) -> None:
    module = Net()
    data = state_of(1, module, adam_state(module))
    checkpointer = Checkpointer(tmp_path)
    torch.manual_seed(5)
    at_call = torch.get_rng_state().clone()

    async def draw() -> None:
        torch.rand(1000)  # runs while the save is under way in its worker thread

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(checkpointer, data, None)
            group.start_soon(draw)

    anyio.run(main)
    assert not torch.equal(torch.get_rng_state(), at_call)
    checkpoint = load_checkpoint(tmp_path)
    assert torch.equal(checkpoint.rng.torch_cpu, at_call)


def test_step_boundary_checkpoints(tmp_path: Path) -> None:
    from lamploop.checkpoint.rng import RngStates
    from lamploop.loop.boundary import EpochPosition

    module = Net()
    data = state_of(5, module, adam_state(module))
    position = EpochPosition(
        epoch=5,
        lr_factor=0.5,
        steps_done=120,
        last_step_examples=8,
        loss_sums=(1.5, 2.5),
        example_counts=(960, 960),
    )
    torch.manual_seed(1)
    rank1 = RngStates.capture()
    torch.manual_seed(2)
    path = save_checkpoint(tmp_path, data, position=position, rank_rngs=[rank1], keep_last=None)
    assert path.name == "epoch-000005-step-000120"
    assert (path / "rng-rank1.safetensors").is_file()
    d = descriptor(path)
    assert d["position"]["epoch"] == 5
    assert d["position"]["steps_done"] == 120
    assert d["position"]["loss_sums"] == [1.5, 2.5]
    assert d["position"]["example_counts"] == [960, 960]
    assert len(d["rank_rngs"]) == 1
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.position == position
    assert len(checkpoint.rank_rngs) == 1
    assert torch.equal(checkpoint.rank_rngs[0].torch_cpu, rank1.torch_cpu)
    report = verify_checkpoint(tmp_path)
    assert report.ok
    assert report.position == position
    assert [(c.epoch, c.steps_done) for c in report.checkpoints] == [(5, 120)]

    # step 0 of an epoch is saved as that epoch's start
    start = EpochPosition(
        epoch=6, lr_factor=1.0, steps_done=0, last_step_examples=0, loss_sums=(0.0,), example_counts=(0,)
    )
    checkpointer = Checkpointer(tmp_path, keep_last=None)
    anyio.run(
        checkpointer.save_position,
        state_of(6, module, adam_state(module)),
        None,
        start,
        [RngStates.capture()],
    )
    assert checkpointer.last_path == tmp_path / "epoch-000006"
    assert load_checkpoint(tmp_path).position is None


_SAVER = """
import sys, torch
from lamploop.checkpoint import save_checkpoint
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
model = {"w": torch.arange(6_000_000, dtype=torch.float32)}
print("ready", flush=True)
epoch = 0
while True:
    epoch += 1
    loop = LoopState(epoch=epoch)
    state = LoopStateWithModelAndOptimizerData(loop, model, {"state": {}, "param_groups": []})
    save_checkpoint(sys.argv[1], state, keep_last=2)
"""


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """Atomic: a SIGKILL while a save is under way leaves `latest` valid; the next save
    removes the leftovers of the crashed one."""
    root = tmp_path / "run"
    with subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(root)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            for _ in range(200_000):  # until a save is under way after a first complete one
                names = os.listdir(root) if root.exists() else []
                if "latest" in names and any(n.startswith(".lamploop-tmp-") for n in names):
                    break
        finally:
            proc.kill()
            proc.wait(timeout=CLI_TIMEOUT)
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".lamploop-tmp-")]
    report = verify_checkpoint(root)
    assert report.ok, report.problems
    checkpoint = load_checkpoint(root)
    assert checkpoint.path == latest_checkpoint(root)
    assert torch.equal(checkpoint.state.model["w"], torch.arange(6_000_000, dtype=torch.float32))
    epoch = checkpoint.state.loop_state.epoch
    save_checkpoint(root, state_of(epoch + 1, Net(), adam_state(Net())), keep_last=2)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".lamploop-tmp-")], leftovers
    assert load_checkpoint(root).state.loop_state.epoch == epoch + 1


def _epochs_run(root: Path, max_epochs: int, resume: bool) -> tuple[torch.nn.Module, LoopState]:
    """A tiny run with epochs(): random batch order and dropout from the global RNG, a plateau
    schedule and validation, so that the resumed run depends on every part of the checkpoint."""
    data = torch.Generator().manual_seed(3)
    x, y = torch.randn(24, 4, generator=data), torch.randn(24, 1, generator=data)
    vx, vy = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
    schedule = reduce_lr_on_plateau(patience=0, reduce_factor=0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    best: dict[str, torch.Tensor] = {}
    init_state = None
    init_schedule = None
    if resume:
        checkpoint = load_checkpoint(root, schedule=schedule, model=model, restore_rng=True)
        model.load_state_dict(checkpoint.state.model)
        restore_optimizer_state(optimizer, checkpoint)
        best = dict(checkpoint.state.best_model)
        init_state = checkpoint.state.loop_state
        init_schedule = checkpoint.schedule_state
    checkpointer = Checkpointer(root, keep_last=None)

    async def train_epoch(lr_factor: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * lr_factor
        model.train()
        total = 0.0
        for batch in torch.randperm(24).split(8):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            total += loss.item()
        return total / 3

    async def validation_epoch() -> float:
        model.eval()
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(vx), vy).item()

    async def save_best() -> None:
        best.clear()
        best.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    async def checkpoint_state(loop_state: LoopState, schedule_state: object) -> None:
        data = LoopStateWithModelAndOptimizerData(
            loop_state, model.state_dict(), optimizer.state_dict(), best_model=dict(best)
        )
        await checkpointer(data, schedule_state)

    async def main() -> LoopState:
        return await epochs(
            max_epochs=max_epochs,
            train_epoch=train_epoch,
            validation_epoch=validation_epoch,
            save_min_validation_loss_model=save_best,
            checkpoint_state=checkpoint_state,
            learning_rate_schedule=schedule,
            init_state=init_state,
            learning_rate_schedule_init_state=init_schedule,
        )

    return model, anyio.run(main)


def test_epochs_resumed_by_hand_is_bitwise_equal(tmp_path: Path) -> None:
    full_model, full_state = _epochs_run(tmp_path / "full", max_epochs=5, resume=False)
    _epochs_run(tmp_path / "cut", max_epochs=2, resume=False)
    torch.manual_seed(12345)  # a different process state before resuming
    np.random.seed(1)
    resumed_model, resumed_state = _epochs_run(tmp_path / "cut", max_epochs=5, resume=True)
    assert resumed_state == full_state
    for a, b in zip(full_model.state_dict().values(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the schedule state in the checkpoints is the same too
    assert (
        descriptor(tmp_path / "full" / "epoch-000005")["schedule_state"]
        == descriptor(tmp_path / "cut" / "epoch-000005")["schedule_state"]
    )


def test_restore_rng(tmp_path: Path) -> None:
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    np.random.standard_normal()  # leaves numpy's second Gaussian cached
    random.gauss(0.0, 1.0)  # leaves Python's gauss_next set
    module = Net()
    save_checkpoint(tmp_path, state_of(1, module, adam_state(module)))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    cached = (np.random.standard_normal(), random.gauss(0.0, 1.0))
    # restore_rng=False leaves the generators alone
    torch.manual_seed(99)
    before = torch.get_rng_state().clone()
    checkpoint = load_checkpoint(tmp_path)
    assert torch.equal(torch.get_rng_state(), before)
    load_checkpoint(tmp_path, restore_rng=True)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]
    assert (np.random.standard_normal(), random.gauss(0.0, 1.0)) == cached
    torch.rand(5)
    checkpoint.rng.restore()
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


# --------------------------------------------------------------------------- fit: resume.md


def _fit(directory: Path, max_epochs: int, *, resume: bool = True, keep_last: int | None = 3) -> tuple:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 5, generator=gen), torch.arange(48) % 3
    vx, vy = torch.randn(16, 5, generator=gen), torch.arange(16) % 3
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(5, 12), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(12, 3)
    )
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.02),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        validation_batches=lamploop.tensor_batches(vx, vy, batch_size=8),
        learning_rate_schedule=reduce_lr_on_plateau(patience=0),
        max_epochs=max_epochs,
        checkpoint_dir=directory,
        keep_last=keep_last,
        resume=resume,
        reporters=[],
    )
    return module, state


def test_fit_resumes_bitwise_and_keep_last_default(tmp_path: Path) -> None:
    full, full_state = _fit(tmp_path / "full", 4)
    # keep_last=3 is the default: the three most recently saved
    assert checkpoint_dirs(tmp_path / "full") == ["epoch-000002", "epoch-000003", "epoch-000004"]
    assert (tmp_path / "full" / LATEST_NAME).read_text().strip() == "epoch-000004"

    _, cut_state = _fit(tmp_path / "cut", 2)
    assert cut_state.epoch == 2
    resumed, resumed_state = _fit(tmp_path / "cut", 4)  # the same call finishes the run
    assert resumed_state == full_state
    assert [e.epoch for e in resumed_state.learning_curve] == [0, 1, 2, 3]
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "cut")
    assert tensors_equal(a.state.model, b.state.model)
    assert tensors_equal(a.state.best_model, b.state.best_model)
    assert a.state.best_model  # validation ran: a best model was saved

    # resume=False ignores the checkpoints and starts from epoch 0
    fresh, fresh_state = _fit(tmp_path / "fresh", 1)
    again, again_state = _fit(tmp_path / "cut", 1, resume=False)
    assert again_state.epoch == 1
    assert [e.epoch for e in again_state.learning_curve] == [0]
    assert again_state == fresh_state
    for a_, b_ in zip(fresh.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a_, b_)


def test_fit_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))

    def fit(module: torch.nn.Module, features: torch.Tensor) -> None:
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.01),
            train_batches=lamploop.tensor_batches(features, y, batch_size=8),
            max_epochs=2,
            checkpoint_dir=tmp_path,
            reporters=[],
        )

    fit(torch.nn.Linear(3, 2), x)
    with pytest.raises(CheckpointError) as info:
        fit(torch.nn.Linear(4, 2), torch.randn(16, 4))
    assert MODEL_FILE in str(info.value)
    assert "checkpoint shape (2, 3), model shape (2, 4)" in str(info.value)
    with pytest.raises(ConfigurationError):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.01),
            train_batches=lamploop.tensor_batches(x, y, batch_size=8),
            max_epochs=2,
            checkpoint_every_n_steps=2,  # needs a checkpoint_dir
            reporters=[],
        )


def test_resume_md_step_checkpoints(tmp_path: Path) -> None:
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    y = torch.arange(64) % 3

    def train(directory: Path, max_epochs: int) -> torch.nn.Module:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            train_batches=lamploop.tensor_batches(x, y, batch_size=8),
            max_epochs=max_epochs,
            checkpoint_dir=directory,
            keep_last=None,
            checkpoint_every_n_steps=3,
            reporters=[],
        )
        return module

    full, crashed = tmp_path / "full", tmp_path / "crashed"
    uninterrupted = train(full, max_epochs=2)
    assert sorted(p.name for p in full.iterdir()) == [
        "epoch-000000-step-000003",
        "epoch-000000-step-000006",
        "epoch-000001",
        "epoch-000001-step-000003",
        "epoch-000001-step-000006",
        "epoch-000002",
        "latest",
    ]
    d = descriptor(full / "epoch-000001-step-000003")
    position = d["position"]
    assert position["epoch"] == 1
    assert position["steps_done"] == 3
    assert {"lr_factor", "last_step_examples", "loss_sums", "example_counts"} <= set(position)
    assert len(position["loss_sums"]) == len(position["example_counts"]) == 1
    assert position["example_counts"] == [24]

    crashed.mkdir()
    shutil.copytree(full / "epoch-000001-step-000003", crashed / "epoch-000001-step-000003")
    checkpoint = lamploop.load_checkpoint(crashed)
    assert (checkpoint.position.epoch, checkpoint.position.steps_done) == (1, 3)
    report = verify_checkpoint(crashed)
    assert report.ok
    assert report.position is not None
    assert report.position.steps_done == 3
    resumed = train(crashed, max_epochs=2)
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- validation, fallback


@pytest.fixture
def run3(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    save_run(root, [1, 2, 3], keep_last=None)
    return root


def test_truncated_file_named_explicitly_raises(run3: Path) -> None:
    target = run3 / "epoch-000003" / OPTIMIZER_FILE
    truncate(target)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run3 / "epoch-000003")
    assert_clear(info.value, starts_with=target, contains="size mismatch")


def test_flipped_bit_named_explicitly_raises(run3: Path) -> None:
    target = run3 / "epoch-000003" / MODEL_FILE
    flip_byte(target)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run3 / "epoch-000003")
    assert_clear(info.value, starts_with=target, contains="sha256 mismatch")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "garbage-descriptor", "missing-dir"])
def test_root_falls_back_with_a_warning(run3: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    bad = run3 / "epoch-000003"
    if damage == "flip":
        flip_byte(bad / RNG_FILE, 100)
    elif damage == "truncate":
        truncate(bad / BEST_MODEL_FILE)
    elif damage == "delete":
        (bad / MODEL_FILE).unlink()
    elif damage == "garbage-descriptor":
        (bad / DESCRIPTOR_NAME).write_text("{not json")
    else:
        shutil.rmtree(bad)
    with caplog.at_level(logging.WARNING):
        checkpoint = load_checkpoint(run3, model=Net())
    assert checkpoint.path == run3 / "epoch-000002"
    assert checkpoint.state.loop_state.epoch == 2
    assert torch.equal(checkpoint.state.model["fc.bias"], torch.full((10,), 2.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("epoch-000003" in w for w in warnings), warnings
    if damage != "missing-dir":
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(bad)  # named explicitly: never substituted
        assert str(info.value).startswith(str(bad))


def test_all_invalid_raises_checkpoint_error(run3: Path) -> None:
    for e in (1, 2, 3):
        flip_byte(run3 / f"epoch-00000{e}" / MODEL_FILE)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run3)
    assert "model.safetensors" in str(info.value)


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(missing)
    assert str(missing) in str(info.value)
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError):
        verify_checkpoint(tmp_path / "empty")


def test_newer_format_version_refused(run3: Path) -> None:
    path = run3 / "epoch-000003" / DESCRIPTOR_NAME
    d = json.loads(path.read_text())
    d["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run3 / "epoch-000003")
    assert_clear(
        info.value,
        starts_with=path,
        contains=f"written by a newer lamploop: format version {FORMAT_VERSION + 1}, "
        f"this version reads {FORMAT_VERSION}",
    )


@pytest.mark.parametrize("field", ["loop_state", "files", "model_spec"])
def test_malformed_descriptor_refused(run3: Path, field: str) -> None:
    path = run3 / "epoch-000003" / DESCRIPTOR_NAME
    d = json.loads(path.read_text())
    del d[field]
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run3 / "epoch-000003")
    assert_clear(info.value, starts_with=path)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d["loop_state"].__setitem__("epoch", "three"), id="epoch-str"),
        pytest.param(lambda d: d["files"][MODEL_FILE].__setitem__("size", "big"), id="size-str"),
        pytest.param(lambda d: d["model_spec"]["tensors"][0].__setitem__("shape", "ab"), id="shape-str"),
        pytest.param(
            lambda d: d["optimizer"]["state"]["$int_keys"]["0"].__setitem__("step", {"$tensor": "nope"}),
            id="tensor-ref",
        ),
        pytest.param(lambda d: d["optimizer"]["state"].__setitem__("$int_keys", {"abc": {}}), id="int-keys"),
        pytest.param(lambda d: d["optimizer"].__setitem__("x", {"$float": "banana"}), id="float-tag"),
        pytest.param(lambda d: d["optimizer"].__setitem__("x", {"$pairs": 5}), id="pairs-tag"),
        pytest.param(lambda d: d.__setitem__("optimizer", [1, 2]), id="optimizer-list"),
        pytest.param(lambda d: d.__setitem__("position", "x"), id="position-str"),
        pytest.param(lambda d: d.__setitem__("sequence", "x"), id="sequence-str"),
        pytest.param(lambda d: d.pop("rng"), id="rng-missing"),
        pytest.param(lambda d: d.__setitem__("rank_rngs", [{"x": 1}]), id="rank-rngs"),
        pytest.param(lambda d: d.__setitem__("format_version", "2"), id="format-str"),
        pytest.param(lambda d: d.clear(), id="empty-object"),
        # "a lamploop older than extras refuses a checkpoint that has them (an unknown field)"
        pytest.param(lambda d: d.__setitem__("not_a_field", 1), id="unknown-field"),
    ],
)
def test_descriptor_damage_is_a_clear_checkpoint_error(run3: Path, mutate: Any) -> None:
    directory = run3 / "epoch-000003"
    path = directory / DESCRIPTOR_NAME
    d = json.loads(path.read_text())
    mutate(d)
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(directory, model=Net())
    message = str(info.value)
    assert message.startswith(str(directory) + os.sep), message
    report = verify_checkpoint(directory)
    assert not report.ok
    assert message in report.problems, (message, report.problems)
    assert load_checkpoint(run3).path == run3 / "epoch-000002"


def test_unrecorded_file_reported_in_load_checkpoints_words(run3: Path) -> None:
    directory = run3 / "epoch-000003"
    path = directory / DESCRIPTOR_NAME
    d = json.loads(path.read_text())
    del d["files"][OPTIMIZER_FILE]
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(directory)
    # load: ".../checkpoint.json: lists no sha256 and size for optimizer.safetensors"
    assert str(info.value).startswith(str(path))
    # verify: each problem "in the very words load_checkpoint would refuse with"
    assert str(info.value) in verify_checkpoint(directory).problems


def test_descriptor_listing_a_missing_file(run3: Path) -> None:
    directory = run3 / "epoch-000003"
    path = directory / DESCRIPTOR_NAME
    d = json.loads(path.read_text())
    d["files"]["extra-gone.safetensors"] = {"sha256": "0" * 64, "size": 8}
    path.write_text(json.dumps(d))
    report = verify_checkpoint(run3)
    assert any(p.startswith(str(directory / "extra-gone.safetensors")) for p in report.problems)
    # verify_checkpoint reports "with the checkpoint load_checkpoint would load"
    assert report.path == run3 / "epoch-000002"
    assert load_checkpoint(run3).path == report.path
    with pytest.raises(CheckpointError):
        load_checkpoint(directory)


def test_safetensors_file_lacking_listed_tensors_refused(run3: Path) -> None:
    """A file that parses but holds other tensors than listed, with a matching record."""
    from safetensors.torch import save_file

    directory = run3 / "epoch-000003"
    target = directory / MODEL_FILE
    save_file({"fc.weight": torch.zeros(10, 5)}, str(target))  # fc.bias missing
    d = descriptor(directory)
    d["files"][MODEL_FILE] = {"sha256": sha256(target), "size": target.stat().st_size}
    (directory / DESCRIPTOR_NAME).write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(directory)
    assert_clear(info.value, starts_with=target)
    assert "fc.bias" in str(info.value)


def test_model_shape_mismatch(tmp_path: Path) -> None:
    module = Net(5, 10)
    path = save_checkpoint(tmp_path, state_of(1, module, adam_state(module)))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, model=Net(4, 10))
    assert_clear(
        info.value,
        starts_with=path / MODEL_FILE,
        contains="does not fit the given model: tensor 'fc.weight': "
        "checkpoint shape (10, 5), model shape (10, 4)",
    )
    # a state dict is accepted in place of the module
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, model=Net(4, 10).state_dict())
    assert "fc.weight" in str(info.value)
    assert load_checkpoint(tmp_path, model=Net(5, 10).state_dict()).path == path


def test_model_dtype_and_name_mismatch(tmp_path: Path) -> None:
    module = Net(5, 10)
    path = save_checkpoint(tmp_path, state_of(1, module, adam_state(module)))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, model=Net(5, 10).double())
    assert_clear(info.value, starts_with=path / MODEL_FILE, contains="fc.weight")
    assert "float64" in str(info.value) or "double" in str(info.value)
    other = torch.nn.Sequential(torch.nn.Linear(5, 10))  # '0.weight', '0.bias'
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, model=other)
    assert_clear(info.value, starts_with=path / MODEL_FILE)
    assert "fc.weight" in str(info.value) or "0.weight" in str(info.value)


def test_schedule_state_that_does_not_fit_the_schedule(tmp_path: Path) -> None:
    module = Net()
    path = save_checkpoint(
        tmp_path, state_of(1, module, adam_state(module)), schedule_state=PlateauState(0.5)
    )
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, schedule=lamploop.schedules.linear(start=1.0, end=0.1, max_steps=5))
    assert str(info.value).startswith(str(path))


def test_restore_optimizer_state_refuses_misfits(tmp_path: Path) -> None:
    module = Net()
    save_checkpoint(tmp_path, state_of(1, module, adam_state(module)))
    checkpoint = load_checkpoint(tmp_path)
    fresh = Net()
    two_groups = torch.optim.Adam([{"params": [fresh.fc.weight]}, {"params": [fresh.fc.bias]}], lr=0.1)
    with pytest.raises(CheckpointError):
        restore_optimizer_state(two_groups, checkpoint)
    one_param = torch.optim.Adam([fresh.fc.weight], lr=0.1)
    with pytest.raises(CheckpointError):
        restore_optimizer_state(one_param, checkpoint)
    right = torch.optim.Adam(fresh.parameters(), lr=0.1)
    restore_optimizer_state(right, checkpoint.state)  # the LoopStateWithModelAndOptimizerData form
    restore_optimizer_state(right, checkpoint.state.optimizer)  # the state_dict form
    assert torch.equal(
        right.state_dict()["state"][0]["exp_avg"], checkpoint.state.optimizer["state"][0]["exp_avg"]
    )


# --------------------------------------------------------------------------- wrong arguments


def test_wrong_arguments_are_configuration_errors(tmp_path: Path) -> None:
    module = Net()
    state = state_of(1, module, adam_state(module))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        lambda: load_checkpoint(123),  # type: ignore[arg-type]
        lambda: load_checkpoint(tmp_path, restore_rng="yes"),  # type: ignore[arg-type]
        lambda: load_checkpoint(tmp_path, model=5),  # type: ignore[arg-type]
        lambda: load_checkpoint(tmp_path, schedule=object()),  # type: ignore[arg-type]
        lambda: save_checkpoint(tmp_path, {"epoch": 1}),  # type: ignore[arg-type]
        lambda: save_checkpoint(tmp_path, state, keep_last=0),
        lambda: save_checkpoint(tmp_path, state, keep_last=-2),
        lambda: save_checkpoint(tmp_path, state, keep_last="3"),  # type: ignore[arg-type]
        lambda: save_checkpoint(a_file, state),
        lambda: save_checkpoint(None, state),  # type: ignore[arg-type]
        lambda: Checkpointer(tmp_path, keep_last=0),
        lambda: Checkpointer(a_file),
        lambda: latest_checkpoint(a_file),
        lambda: latest_checkpoint(3.5),  # type: ignore[arg-type]
    ]
    for index, case in enumerate(cases):
        with pytest.raises(ConfigurationError):
            case()
        assert checkpoint_dirs(tmp_path) == [], index
    negative = LoopStateWithModelAndOptimizerData(LoopState(epoch=-1), {"w": torch.zeros(1)}, {})
    with pytest.raises(ConfigurationError):
        save_checkpoint(tmp_path, negative)
    assert issubclass(ConfigurationError, ValueError)


# --------------------------------------------------------------------------- verify_checkpoint


def test_verify_checkpoint_doc_example(tmp_path: Path) -> None:
    state = LoopStateWithModelAndOptimizerData(
        LoopState(epoch=1), model={"w": torch.zeros(3)}, optimizer={"state": {}, "param_groups": []}
    )
    directory = save_checkpoint(tmp_path, state)
    assert verify_checkpoint(tmp_path).ok
    (directory / MODEL_FILE).write_bytes(b"not what was saved")
    report = verify_checkpoint(tmp_path)
    assert not report.ok
    assert report.problems[0].startswith(f"{directory / MODEL_FILE}: size mismatch: ")


def test_verify_reports_every_problem_in_load_checkpoints_words(run3: Path) -> None:
    newest = run3 / "epoch-000003"
    flip_byte(newest / MODEL_FILE)
    truncate(newest / OPTIMIZER_FILE)
    flip_byte(run3 / "epoch-000001" / RNG_FILE, 50)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(newest)
    report = verify_checkpoint(run3)
    assert not report.ok
    assert report.run_directory == run3
    # the one load_checkpoint would load
    assert report.path == run3 / "epoch-000002" == load_checkpoint(run3).path
    assert report.epoch == 2
    assert [c.path.name for c in report.checkpoints] == ["epoch-000001", "epoch-000002", "epoch-000003"]
    assert [c.is_latest for c in report.checkpoints] == [False, False, True]
    assert [bool(c.problems) for c in report.checkpoints] == [True, False, True]
    assert report.loop_state is not None
    assert report.loop_state.epoch == 2
    problems = report.problems
    assert any(p.startswith(f"{newest / MODEL_FILE}: sha256 mismatch") for p in problems), problems
    assert any(p.startswith(f"{newest / OPTIMIZER_FILE}: size mismatch") for p in problems), problems
    assert any(p.startswith(str(run3 / "epoch-000001" / RNG_FILE)) for p in problems), problems
    assert str(info.value) in problems
    single = verify_checkpoint(newest)
    assert single.path == newest
    assert single.run_directory is None
    assert str(info.value) in single.problems
    assert len(single.problems) >= 2


def test_verify_notes_are_no_problems(run3: Path) -> None:
    (run3 / "epoch-000003" / "stray.txt").write_text("x")
    (run3 / LATEST_NAME).unlink()
    report = verify_checkpoint(run3)
    assert report.ok
    assert report.problems == ()
    assert any("stray.txt" in n for n in report.notes), report.notes
    assert any(LATEST_NAME in n for n in report.notes), report.notes
    assert report.path == run3 / "epoch-000003"


def test_verify_reports_a_latest_pointer_naming_nothing(run3: Path) -> None:
    (run3 / LATEST_NAME).write_text("epoch-000042\n")
    report = verify_checkpoint(run3)
    assert not report.ok
    assert any("latest" in p and "epoch-000042" in p for p in report.problems), report.problems


# --------------------------------------------------------------------------- lamploop inspect (CLI)


def _make_inspect_run(root: Path) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = adam_state(module)
    curve: list[LearningCurveEntry] = []
    losses = [(1.5, 1.25), (1.0, 0.75), (0.5, 0.25), (0.25, 0.5)]
    best_epoch, best_loss = None, None
    for epoch, (train, valid) in enumerate(losses):
        curve.append(
            LearningCurveEntry(
                epoch=epoch, training_loss=train, validation_loss=(valid, valid), learning_rate_factor=1.0
            )
        )
        if best_loss is None or valid < best_loss:
            best_epoch, best_loss = epoch, valid
        if epoch >= 1:
            best = {k: v.detach().clone() * (epoch + 1) for k, v in module.state_dict().items()}
            save_checkpoint(
                root,
                state_of(
                    epoch + 1,
                    module,
                    optimizer,
                    best=best,
                    curve=tuple(curve),
                    last_validation_loss=valid,
                    min_validation_loss=best_loss,
                    min_validation_epoch=best_epoch,
                ),
                keep_last=None,
            )


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every CLI invocation at once (each costs an interpreter start): healthy, corrupt,
    truncated, missing, no argument."""
    base = tmp_path_factory.mktemp("cli")
    for name in ("rd", "bad", "trunc"):
        _make_inspect_run(base / name)
    reference = {"sha": sha256(base / "bad" / "epoch-000004" / BEST_MODEL_FILE)}
    flip_byte(base / "bad" / "epoch-000004" / BEST_MODEL_FILE)
    reference["sha_now"] = sha256(base / "bad" / "epoch-000004" / BEST_MODEL_FILE)
    truncate(base / "trunc" / "epoch-000004" / MODEL_FILE)
    argvs = {
        "rd": ["inspect", "rd"],
        "bad": ["inspect", "bad"],
        "trunc": ["inspect", "trunc/epoch-000004"],
        "missing": ["inspect", "no-such-dir"],
        "noarg": ["inspect"],
    }
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "lamploop.cli", *argv],
            cwd=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for key, argv in argvs.items()
    }
    results: dict[str, Any] = {"base": base, **reference}
    for key, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=CLI_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[key] = subprocess.CompletedProcess(argvs[key], proc.returncode, out, err)
    return results


def _line(out: str, label: str) -> str:
    for line in out.splitlines():
        if line.startswith(label):
            return re.sub(r"\s+", " ", line[len(label) :].strip())
    raise AssertionError(f"no line {label!r} in:\n{out}")


def test_inspect_healthy_run(cli_runs: dict[str, Any]) -> None:
    run = cli_runs["rd"]
    base: Path = cli_runs["base"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert _line(out, "checkpoint ") == "rd/epoch-000004"
    assert _line(out, "run ") == "rd (3 checkpoints)"
    d = descriptor(base / "rd" / "epoch-000004")
    when = datetime.datetime.fromtimestamp(d["saved_at_unix_ns"] / 1e9, tz=datetime.UTC)
    written = _line(out, "written by ")
    assert written.startswith(f"lamploop {lamploop.__version__} (format 2), ")
    assert written.endswith(" UTC")
    stamp = datetime.datetime.strptime(written.split(", ")[-1], "%Y-%m-%d %H:%M:%S UTC").replace(
        tzinfo=datetime.UTC
    )
    assert abs((stamp - when).total_seconds()) < 1.5
    assert _line(out, "resumes at ") == "the start of epoch 4"
    assert _line(out, "epochs done ") == "4"
    assert _line(out, "last valid ") == "0.5"
    assert _line(out, "best epoch ") == "2 (validation loss 0.25)"
    # the model's tensors per top-level module: 0 -> 4*8+8 = 40, 2 -> 8*2+2 = 18
    assert _line(out, "model ").startswith("58 values in 4 tensors")
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^\s+(\w+)\s+(\d+)\s+([\d,]+)\s+[\d.]+\s*$", out, re.M)
    }
    assert (rows.get("0"), rows.get("2"), rows.get("total")) == (("2", "40"), ("2", "18"), ("4", "58")), out
    # the learning curve, the best epoch marked *
    assert re.search(r"^\s+2\*\s+0\.5\s+0\.25\s+1\s*$", out, re.M), out
    assert re.search(r"^\s+3\s+0\.25\s+0\.5\s+1\s*$", out, re.M), out
    # files with their sizes
    assert "files of epoch-000004:" in out
    for name in (MODEL_FILE, BEST_MODEL_FILE, OPTIMIZER_FILE, RNG_FILE):
        size = (base / "rd" / "epoch-000004" / name).stat().st_size
        assert re.search(rf"^\s+{re.escape(name)}\s+{size:,} bytes\s+ok \(sha256\)\s*$", out, re.M), (
            name,
            out,
        )
    size = (base / "rd" / "epoch-000004" / DESCRIPTOR_NAME).stat().st_size
    assert re.search(rf"^\s+checkpoint\.json\s+{size:,} bytes\s+ok\s*$", out, re.M), out
    assert "checkpoints in rd:" in out
    assert re.search(r"^\s+epoch-000002\s+ok\s*$", out, re.M)
    assert re.search(r"^\s+epoch-000004\s+ok \(latest, reported\)\s*$", out, re.M), out
    assert out.rstrip().endswith("ok: every file is intact")


def test_inspect_prints_format_report(cli_runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from lamploop.inspection import format_report, inspect_checkpoint

    monkeypatch.chdir(cli_runs["base"])
    report = verify_checkpoint("rd")
    assert inspect_checkpoint("rd") == report
    assert format_report(report).strip() in cli_runs["rd"].stdout


def test_inspect_corrupt_file(cli_runs: dict[str, Any]) -> None:
    run = cli_runs["bad"]
    assert run.returncode == 1
    # docs/cli.md shows the hashes as 8 digits and "…"; the full digest says the same
    sha, sha_now = cli_runs["sha"], cli_runs["sha_now"]
    pattern = (
        r"lamploop: bad/epoch-000004/best_model\.safetensors: sha256 mismatch: checkpoint\.json records "
        rf"{sha[:8]}(?:…|{sha[8:]}), the file has {sha_now[:8]}(?:…|{sha_now[8:]}) "
        r"\(the file is corrupt or was changed after saving\)"
    )
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert re.fullmatch(pattern, lines[0]), run.stderr
    assert lines[0].removeprefix("lamploop: ") in run.stdout
    # the report covers the checkpoint fit would resume from instead
    assert _line(run.stdout, "checkpoint ").startswith("bad/epoch-000003")
    assert "ok: every file is intact" not in run.stdout
    assert "Traceback" not in run.stderr


def test_inspect_truncated_checkpoint_directory(cli_runs: dict[str, Any]) -> None:
    run = cli_runs["trunc"]
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines, run.stderr
    assert all(line.startswith("lamploop: ") for line in lines), run.stderr
    assert any(
        line.startswith("lamploop: trunc/epoch-000004/model.safetensors: size mismatch") for line in lines
    )
    assert "Traceback" not in run.stderr


def test_inspect_missing_directory(cli_runs: dict[str, Any]) -> None:
    run = cli_runs["missing"]
    assert run.returncode == 1, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("lamploop: "), run.stderr
    assert "no-such-dir" in lines[0], run.stderr


def test_inspect_bad_arguments_exit_2(cli_runs: dict[str, Any]) -> None:
    run = cli_runs["noarg"]
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr
