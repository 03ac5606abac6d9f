"""Checkpoints: round trips, bitwise resumption, atomic writes, RNG states and every refusal."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamploop.checkpoint import (
    FORMAT_VERSION,
    Checkpoint,
    Checkpointer,
    latest_checkpoint,
    load_checkpoint,
    restore_optimizer_state,
    save_checkpoint,
)
from lamploop.checkpoint import files as ckpt_files
from lamploop.checkpoint import save as ckpt_save
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.loop import ALL_EPOCHS, epochs
from lamploop.schedules import PlateauState, noop, reduce_lr_on_plateau
from lamploop.state import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData

# ------------------------------------------------------------------------------------------------
# Helpers


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Exact equality of nested state: same types (tuple is not list, int is not float), equal tensors."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: {a.shape} != {b.shape}"
        assert torch.equal(a.cpu(), b.cpu()), f"{path}: tensors differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    x, y = data()
    for i in range(steps):
        batch = slice((i * 4) % 16, (i * 4) % 16 + 4)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        optimizer.step()


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}

LOOP_STATE = LoopState(
    epoch=3,
    last_validation_loss=0.25,
    min_validation_loss=0.2,
    min_validation_epoch=1,
    learning_curve=(
        LearningCurveEntry(0, 1.5, (0.5, 0.5)),
        LearningCurveEntry(1, 0.75, (0.2, 0.1)),
        LearningCurveEntry(2, 0.5, None),
    ),
)


def full_state(
    optimizer_name: str = "adam", *, steps: int = 3, epoch: int = 3
) -> tuple[LoopStateWithModelAndOptimizerData, torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    train_steps(model, optimizer, steps)
    best = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    state = LoopStateWithModelAndOptimizerData(
        loop_state=attrs.evolve(LOOP_STATE, epoch=epoch),
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        best_model=best,
    )
    return state, model, optimizer


def flip_byte(path: pathlib.Path, offset: int = -5) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def rewrite_descriptor(directory: pathlib.Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "checkpoint.json"
    descriptor = json.loads(path.read_text())
    edit(descriptor)
    path.write_text(json.dumps(descriptor))


def reseal(directory: pathlib.Path, file: str) -> None:
    """Make the descriptor's sha256 and size agree with ``file`` as it is now."""
    raw = (directory / file).read_bytes()

    def edit(d: dict[str, Any]) -> None:
        d["files"][file] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}

    rewrite_descriptor(directory, edit)


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> pathlib.Path:
    state, _, _ = full_state()
    return save_checkpoint(tmp_path / "run", state, schedule_state=PlateauState(0.5, best=0.2))


# ------------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_restores_every_part(tmp_path: pathlib.Path) -> None:
    state, model, _ = full_state()
    schedule_state = PlateauState(factor=0.25, best=0.2, bad_validations=2)
    path = save_checkpoint(tmp_path, state, schedule_state=schedule_state)
    assert path == tmp_path / "epoch-000003"

    loaded = load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau(), model=model)

    assert loaded.path == path
    assert loaded.state.loop_state == state.loop_state
    assert loaded.schedule_state == schedule_state
    assert_tree_equal(dict(loaded.state.model), dict(state.model))
    assert_tree_equal(dict(loaded.state.best_model), dict(state.best_model))
    assert_tree_equal(loaded.state.optimizer, state.optimizer)
    assert all(t.device.type == "cpu" for t in loaded.state.model.values())


def test_without_a_schedule_the_schedule_state_is_raw_json(saved: pathlib.Path) -> None:
    loaded = load_checkpoint(saved)
    assert loaded.schedule_state == {"factor": 0.5, "best": 0.2, "bad_validations": 0}


def test_stateless_schedule_state_round_trips_as_none(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    save_checkpoint(tmp_path, state, schedule_state=None)
    assert load_checkpoint(tmp_path, schedule=noop()).schedule_state is None


def test_no_best_model_round_trips_as_empty_mapping(tmp_path: pathlib.Path) -> None:
    state, model, _ = full_state()
    state = LoopStateWithModelAndOptimizerData(state.loop_state, state.model, state.optimizer, {})
    save_checkpoint(tmp_path, state)
    assert dict(load_checkpoint(tmp_path, model=model).state.best_model) == {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resumed_training_is_bitwise_identical(tmp_path: pathlib.Path, name: str) -> None:
    state, model, optimizer = full_state(name)
    save_checkpoint(tmp_path, state)

    resumed_model = make_model(seed=123)  # other initial values, overwritten by the checkpoint
    resumed_optimizer = OPTIMIZERS[name](resumed_model.parameters())
    loaded = load_checkpoint(tmp_path, model=resumed_model)
    resumed_model.load_state_dict(loaded.state.model)
    restore_optimizer_state(resumed_optimizer, loaded)
    assert_tree_equal(resumed_optimizer.state_dict(), optimizer.state_dict())

    train_steps(model, optimizer, 4)
    train_steps(resumed_model, resumed_optimizer, 4)
    for (n, a), (_, b) in zip(model.named_parameters(), resumed_model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_adam_step_as_python_float_round_trips(tmp_path: pathlib.Path) -> None:
    """Older torch stored Adam's ``step`` as a float; both spellings must survive."""
    state, _, _ = full_state("adam")
    old_style = copy.deepcopy(dict(state.optimizer))
    for param_state in old_style["state"].values():
        param_state["step"] = float(param_state["step"])
    save_checkpoint(tmp_path, LoopStateWithModelAndOptimizerData(state.loop_state, state.model, old_style))

    loaded = load_checkpoint(tmp_path).state.optimizer
    assert_tree_equal(loaded, old_style)
    assert isinstance(loaded["state"][0]["step"], float)
    fresh = torch.optim.Adam(make_model().parameters(), lr=1e-2)
    fresh.load_state_dict(dict(loaded))


def test_tied_and_non_contiguous_tensors_are_stored(tmp_path: pathlib.Path) -> None:
    shared = torch.arange(12.0).reshape(3, 4)
    model_tensors = {"row": shared[1], "embed.weight": shared, "head.weight": shared, "half": shared[:, :2]}
    optimizer_state = {"state": {0: {"buf": shared.t()}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    state = LoopStateWithModelAndOptimizerData(LoopState(epoch=1), model_tensors, optimizer_state)
    save_checkpoint(tmp_path, state)
    loaded = load_checkpoint(tmp_path).state
    assert_tree_equal(dict(loaded.model), {k: v.contiguous() for k, v in model_tensors.items()})
    assert torch.equal(loaded.optimizer["state"][0]["buf"], shared.t())


# Values an optimizer state_dict may hold besides tensors; JSON must not turn them into others.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
_trees = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
        st.dictionaries(st.integers(0, 100), children, max_size=3),
        st.dictionaries(st.one_of(st.integers(0, 9), st.text(max_size=2)), children, max_size=3),
    ),
    max_leaves=12,
)
_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_entries = st.builds(
    LearningCurveEntry,
    epoch=st.integers(0, 10_000),
    training_loss=_finite,
    validation_loss=st.none() | st.tuples(_finite, _finite),
)
_loop_states = st.builds(
    LoopState,
    epoch=st.integers(0, 10**7),
    last_validation_loss=st.none() | _finite,
    min_validation_loss=st.none() | _finite,
    min_validation_epoch=st.none() | st.integers(0, 10_000),
    learning_curve=st.lists(_entries, max_size=4).map(tuple),
)
_plateau_states = st.builds(
    PlateauState,
    factor=_finite,
    best=st.none() | _finite,
    bad_validations=st.integers(0, 1000),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(loop_state=_loop_states, schedule_state=_plateau_states, extra=_trees)
def test_random_states_round_trip_through_json(
    tmp_path: pathlib.Path, loop_state: LoopState, schedule_state: PlateauState, extra: Any
) -> None:
    optimizer_state = {
        "state": {0: {"step": 3.0, "buf": torch.ones(2)}},
        "param_groups": [{"params": [0], "extra": extra}],
    }
    state = LoopStateWithModelAndOptimizerData(loop_state, {"w": torch.zeros(2)}, optimizer_state)
    save_checkpoint(tmp_path, state, schedule_state=schedule_state, keep_last=1)
    loaded = load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau())
    assert loaded.state.loop_state == loop_state
    assert loaded.schedule_state == schedule_state
    assert_tree_equal(loaded.state.optimizer, optimizer_state)


# ------------------------------------------------------------------------------------------------
# Atomicity, latest, keep_last


def entries(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_latest_points_at_newest_and_keep_last_prunes(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    for epoch in range(1, 6):
        save_checkpoint(tmp_path, _state_at(state, epoch), keep_last=2)
        assert (tmp_path / "latest").read_text().strip() == f"epoch-{epoch:06d}"
        assert latest_checkpoint(tmp_path) == tmp_path / f"epoch-{epoch:06d}"
    assert entries(tmp_path) == ["epoch-000004", "epoch-000005", "latest"]
    assert load_checkpoint(tmp_path).state.loop_state.epoch == 5


def _state_at(state: LoopStateWithModelAndOptimizerData, epoch: int) -> LoopStateWithModelAndOptimizerData:
    return LoopStateWithModelAndOptimizerData(
        attrs.evolve(state.loop_state, epoch=epoch), state.model, state.optimizer, state.best_model
    )


def test_keep_last_none_keeps_all(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    for epoch in range(4):
        save_checkpoint(tmp_path, _state_at(state, epoch), keep_last=None)
    assert len([n for n in entries(tmp_path) if n.startswith("epoch-")]) == 4


def test_keep_last_prunes_by_save_order_not_epoch(tmp_path: pathlib.Path) -> None:
    """Resuming from an older checkpoint: the new saves survive, stale later epochs go first."""
    state, _, _ = full_state()
    for epoch in (5, 6, 7):
        save_checkpoint(tmp_path, _state_at(state, epoch), keep_last=3)
    save_checkpoint(tmp_path, _state_at(state, 2), keep_last=3)
    save_checkpoint(tmp_path, _state_at(state, 3), keep_last=3)
    assert entries(tmp_path) == ["epoch-000002", "epoch-000003", "epoch-000007", "latest"]
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch-000003"


def test_saving_an_existing_epoch_again_replaces_it(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    save_checkpoint(tmp_path, state, schedule_state=PlateauState(1.0))
    save_checkpoint(tmp_path, state, schedule_state=PlateauState(0.5))
    assert entries(tmp_path) == ["epoch-000003", "latest"]
    assert load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau()).schedule_state == PlateauState(0.5)


def test_a_failed_save_leaves_no_temporary_and_keeps_latest(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, _, _ = full_state()
    save_checkpoint(tmp_path, _state_at(state, 1))
    calls = 0
    real_write = ckpt_save._write_tensors

    def failing_write(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            msg = "No space left on device"
            raise OSError(28, msg)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(ckpt_save, "_write_tensors", failing_write)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, _state_at(state, 2))
    assert entries(tmp_path) == ["epoch-000001", "latest"]
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch-000001"


def test_temporaries_of_dead_processes_are_removed(tmp_path: pathlib.Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = tmp_path / ckpt_files._temp_name("epoch-000009").replace(f"-{os.getpid()}-", f"-{child.pid}-")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / ckpt_files._temp_name("epoch-000008")  # this process: a save in progress, keep it
    live.mkdir()
    state, _, _ = full_state()
    save_checkpoint(tmp_path, state)
    assert not stale.exists()
    assert live.exists()


def test_latest_without_pointer_falls_back_to_newest_complete(tmp_path: pathlib.Path) -> None:
    assert latest_checkpoint(tmp_path / "nowhere") is None
    assert latest_checkpoint(tmp_path) is None
    state, _, _ = full_state()
    save_checkpoint(tmp_path, _state_at(state, 1))
    save_checkpoint(tmp_path, _state_at(state, 2))
    (tmp_path / "latest").unlink()
    (tmp_path / "epoch-000007").mkdir()  # incomplete: no descriptor
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch-000002"


def test_numpy_scalars_in_optimizer_state_come_back_as_python_scalars(tmp_path: pathlib.Path) -> None:
    optimizer_state = {"state": {}, "param_groups": [{"lr": np.float32(0.5), "k": np.int64(3), "params": []}]}
    save_checkpoint(tmp_path, LoopStateWithModelAndOptimizerData(LoopState(), {}, optimizer_state))
    group = load_checkpoint(tmp_path).state.optimizer["param_groups"][0]
    assert (type(group["lr"]), group["lr"], type(group["k"]), group["k"]) == (float, 0.5, int, 3)


def test_arguments_are_validated(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    with pytest.raises(ConfigurationError, match="keep_last"):
        save_checkpoint(tmp_path, state, keep_last=0)
    with pytest.raises(ConfigurationError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=-1)
    with pytest.raises(ConfigurationError, match="epoch must be an int >= 0"):
        save_checkpoint(tmp_path, _state_at(state, -1))
    with pytest.raises(ConfigurationError, match="LoopStateWithModelAndOptimizerData"):
        save_checkpoint(tmp_path, state.loop_state)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# RNG states


def draws() -> tuple[torch.Tensor, np.ndarray[Any, Any], list[float]]:
    return torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)]


def test_restore_rng_gives_identical_draws(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    random.gauss(0, 1)  # leaves a cached gauss_next in the Python state
    state, _, _ = full_state()
    save_checkpoint(tmp_path, state)
    expected = draws()
    draws()  # move every generator on

    checkpoint = load_checkpoint(tmp_path, restore_rng=True)
    got = draws()
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]

    draws()
    checkpoint.rng.restore()
    assert torch.equal(draws()[0], expected[0])


@pytest.mark.anyio
async def test_checkpointer_captures_rng_when_called(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    torch.manual_seed(5)
    await Checkpointer(tmp_path)(state, None)
    expected = torch.rand(4)
    load_checkpoint(tmp_path, restore_rng=True)
    assert torch.equal(torch.rand(4), expected)


def test_load_without_restore_rng_leaves_generators_alone(saved: pathlib.Path) -> None:
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    load_checkpoint(saved)
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------------------------------------
# Refusals: every message names the file and the problem


def refusal(path: pathlib.Path, **kwargs: Any) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, **kwargs)
    return str(info.value)


def test_missing_directory(tmp_path: pathlib.Path) -> None:
    message = refusal(tmp_path / "nope")
    assert str(tmp_path / "nope") in message
    assert "no such checkpoint directory" in message


def test_empty_root(tmp_path: pathlib.Path) -> None:
    assert "no checkpoint here" in refusal(tmp_path)


def test_missing_file(saved: pathlib.Path) -> None:
    (saved / "optimizer.safetensors").unlink()
    message = refusal(saved)
    assert str(saved / "optimizer.safetensors") in message
    assert "missing" in message


def test_missing_descriptor(saved: pathlib.Path) -> None:
    (saved / "checkpoint.json").unlink()
    message = refusal(saved)
    assert str(saved / "checkpoint.json") in message
    assert "missing" in message


def test_latest_naming_a_missing_directory(saved: pathlib.Path) -> None:
    """With no other checkpoint to fall back on, the refusal names the pointer and its target."""
    root = saved.parent
    (root / "latest").write_text("epoch-000099\n")
    shutil.rmtree(saved)
    message = refusal(root)
    assert str(root / "latest") in message
    assert "epoch-000099" in message
    assert "does not exist" in message


def test_truncated_safetensors(saved: pathlib.Path) -> None:
    path = saved / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    message = refusal(saved)
    assert str(path) in message
    assert "size mismatch" in message
    assert "truncated" in message


def test_one_flipped_byte(saved: pathlib.Path) -> None:
    flip_byte(saved / "best_model.safetensors")
    message = refusal(saved)
    assert str(saved / "best_model.safetensors") in message
    assert "sha256 mismatch" in message


def test_flipped_byte_in_rng_file(saved: pathlib.Path) -> None:
    flip_byte(saved / "rng.safetensors", offset=100)
    assert "rng.safetensors: sha256 mismatch" in refusal(saved)


def test_unparsable_safetensors(saved: pathlib.Path) -> None:
    (saved / "optimizer.safetensors").write_bytes(b"\xff" * 64)
    reseal(saved, "optimizer.safetensors")  # a consistent but corrupt checkpoint
    message = refusal(saved)
    assert str(saved / "optimizer.safetensors") in message
    assert "cannot be parsed as safetensors" in message


def test_tensors_missing_versus_descriptor(saved: pathlib.Path) -> None:
    path = saved / "model.safetensors"
    tensors = safetensors.torch.load_file(str(path))
    del tensors["2.bias"]
    safetensors.torch.save_file(tensors, str(path))
    reseal(saved, "model.safetensors")
    message = refusal(saved)
    assert str(path) in message
    assert "tensors missing" in message
    assert "2.bias" in message


def test_future_format_version(saved: pathlib.Path) -> None:
    rewrite_descriptor(saved, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    message = refusal(saved)
    assert str(saved / "checkpoint.json") in message
    newer = f"format version {FORMAT_VERSION + 1}, this version reads {FORMAT_VERSION}"
    assert f"written by a newer lamploop: {newer}" in message


def test_unreadable_json(saved: pathlib.Path) -> None:
    (saved / "checkpoint.json").write_text('{"format_version": 1, ')
    message = refusal(saved)
    assert str(saved / "checkpoint.json") in message
    assert "not valid JSON" in message


def test_malformed_descriptor(saved: pathlib.Path) -> None:
    rewrite_descriptor(saved, lambda d: d["loop_state"].update(epoch="three"))
    message = refusal(saved)
    assert str(saved / "checkpoint.json") in message
    assert "malformed descriptor" in message
    assert "loop_state" in message


def test_model_with_other_parameter_names(saved: pathlib.Path) -> None:
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    other.add_module("out", torch.nn.Linear(8, 2))
    message = refusal(saved, model=other)
    assert str(saved / "model.safetensors") in message
    assert "does not fit the given model" in message
    assert "2.weight" in message
    assert "out.weight" in message


def test_model_with_other_shapes(saved: pathlib.Path) -> None:
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    message = refusal(saved, model=other)
    assert str(saved / "model.safetensors") in message
    assert "tensor '0.weight': checkpoint shape (8, 4), model shape (16, 4)" in message


def test_model_with_other_dtypes(saved: pathlib.Path) -> None:
    message = refusal(saved, model=make_model().double())
    assert str(saved / "model.safetensors") in message
    assert "tensor '0.weight': checkpoint dtype float32, model dtype float64" in message


def test_schedule_state_of_another_schedule(saved: pathlib.Path) -> None:
    message = refusal(saved, schedule=noop())
    assert str(saved / "checkpoint.json") in message
    assert "PlateauState" in message
    assert "Noop" in message


def test_optimizer_of_another_shape_is_refused(saved: pathlib.Path) -> None:
    loaded = load_checkpoint(saved)
    first, last = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
    two_groups = torch.optim.Adam([{"params": first.parameters()}, {"params": last.parameters()}])
    with pytest.raises(
        CheckpointError, match=r"optimizer\.safetensors: the saved optimizer has 1 parameter groups"
    ):
        restore_optimizer_state(two_groups, loaded)


def test_values_that_need_pickle_are_refused_on_save(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    odd = {"state": {}, "param_groups": [{"params": [0], "closure": object()}]}
    with pytest.raises(CheckpointError, match=r"param_groups\.0\.closure is a object"):
        save_checkpoint(tmp_path, LoopStateWithModelAndOptimizerData(state.loop_state, state.model, odd))
    bad_model: dict[str, Any] = {**state.model, "extra": "not a tensor"}
    with pytest.raises(CheckpointError, match="'extra' is a str, not a tensor"):
        save_checkpoint(tmp_path, LoopStateWithModelAndOptimizerData(state.loop_state, bad_model, {}))
    with pytest.raises(CheckpointError, match="schedule state"):
        save_checkpoint(tmp_path, state, schedule_state=object())
    assert not tmp_path.exists() or entries(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# The epoch-loop callback


@pytest.mark.anyio
async def test_checkpointer_saves_from_the_event_loop(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for epoch in range(1, 4):
                await checkpointer(_state_at(state, epoch), PlateauState(1.0 / epoch))
            tg.cancel_scope.cancel()
    assert ticks > 0
    assert checkpointer.last_path == tmp_path / "epoch-000003"
    assert repr(checkpointer) == f"Checkpointer({str(tmp_path)!r}, keep_last=2)"
    assert entries(tmp_path) == ["epoch-000002", "epoch-000003", "latest"]
    loaded = load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau())
    assert loaded.schedule_state == PlateauState(1.0 / 3)


class _Run:
    """A tiny real training run driven by ``epochs``, with shuffling from the global torch RNG."""

    def __init__(self) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.best: dict[str, torch.Tensor] = {}
        self.x, self.y = data(seed=5)

    async def train_epoch(self, factor: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = 0.05 * factor
        order = torch.randperm(16)
        total = 0.0
        for i in range(0, 16, 4):
            batch = order[i : i + 4]
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(self.x[batch]), self.y[batch])
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach())
        return total / 4

    async def validation_epoch(self) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(self.model(self.x), self.y)) + float(torch.rand(()))

    async def save_best(self) -> None:
        self.best = {k: v.clone() for k, v in self.model.state_dict().items()}

    def with_tensors(self, loop_state: LoopState) -> LoopStateWithModelAndOptimizerData:
        return LoopStateWithModelAndOptimizerData(
            loop_state, self.model.state_dict(), self.optimizer.state_dict(), self.best
        )

    async def run(
        self, max_epochs: int, checkpointer: Checkpointer | None, resume: Checkpoint | None
    ) -> LoopState:
        async def checkpoint_state(loop_state: LoopState, schedule_state: Any) -> None:
            if checkpointer is not None:
                await checkpointer(self.with_tensors(loop_state), schedule_state)

        if resume is not None:
            self.model.load_state_dict(resume.state.model)
            restore_optimizer_state(self.optimizer, resume)
            self.best = dict(resume.state.best_model)
            resume.rng.restore()
        return await epochs(
            max_epochs=max_epochs,
            train_epoch=self.train_epoch,
            validation_epoch=self.validation_epoch,
            save_min_validation_loss_model=self.save_best,
            checkpoint_state=checkpoint_state,
            return_min_validation_loss_model=ALL_EPOCHS,
            learning_rate_schedule=reduce_lr_on_plateau(patience=0, reduce_factor=0.5),
            init_state=None if resume is None else resume.state.loop_state,
            learning_rate_schedule_init_state=None if resume is None else resume.schedule_state,
            validation_loss_exponential_smoothing_factor=0.5,
        )


@pytest.mark.anyio
async def test_resuming_with_epochs_matches_an_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(11)
    uninterrupted = _Run()
    expected = await uninterrupted.run(6, None, None)

    torch.manual_seed(11)
    await _Run().run(3, Checkpointer(tmp_path), None)
    torch.manual_seed(999)  # the resumed process starts from another RNG state
    resumed = _Run()
    checkpoint = load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau(), model=resumed.model)
    assert checkpoint.state.loop_state.epoch == 3
    got = await resumed.run(6, None, checkpoint)

    assert got == expected
    for (name, a), (_, b) in zip(
        uninterrupted.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert_tree_equal(resumed.best, uninterrupted.best)


def test_checkpoint_json_is_plain_json_without_tensors(saved: pathlib.Path) -> None:
    descriptor = json.loads((saved / "checkpoint.json").read_text())
    assert descriptor["format_version"] == FORMAT_VERSION
    assert set(descriptor["files"]) == {
        "model.safetensors",
        "best_model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
    }
    assert [t["name"] for t in descriptor["model_spec"]["tensors"]] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    assert descriptor["optimizer"]["state"]["$int_keys"]["0"]["exp_avg"] == {"$tensor": "state.0.exp_avg"}
    assert descriptor["optimizer"]["param_groups"][0]["betas"] == {"$tuple": [0.9, 0.999]}
