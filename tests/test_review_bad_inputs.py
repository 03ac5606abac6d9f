"""Bad inputs to the public API that used to end in a raw Python or torch error from deep
inside (or were taken silently): each now gets a lamploop error that names the argument and
the call, before anything trains where it can be checked then.

Every case is a call, the error class it must raise and a pattern its message must match;
the calls run in-process on tiny models (one rank, or two CPU replicas in threads).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lamploop
from lamploop.errors import CheckpointError, ConfigurationError, LamploopError

torch.manual_seed(0)
X, Y = torch.randn(16, 4), torch.randint(0, 2, (16,))


def _module() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2)


def _model(**changes: Any) -> lamploop.SupervisedModel:
    module = changes.pop("module") if "module" in changes else _module()
    return lamploop.SupervisedModel(module, **changes)


def _batches() -> lamploop.BatchStreamFactory:
    return lamploop.tensor_batches(X, Y, batch_size=8)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _fit(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "max_epochs": 1,
        "reporters": [],
    }
    kwargs.update(changes)
    return lamploop.fit(**kwargs)


def _loss(make: Callable[[torch.Tensor, torch.Tensor], Any]) -> lamploop.SupervisedModel:
    return _model(loss=make)


def _sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="sum")


async def _train(factor: float) -> float:
    return 1.0


async def _valid() -> float:
    return 1.0


async def _saved() -> None:
    return None


def _epochs(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "max_epochs": 2,
        "train_epoch": _train,
        "validation_epoch": _valid,
        "save_min_validation_loss_model": _saved,
    }
    kwargs.update(changes)
    return anyio.run(lambda: lamploop.epochs(**kwargs))


def _returning(value: Any) -> Callable[..., Any]:
    async def effect(*_: Any) -> Any:
        return value

    return effect


def _one_epoch(**changes: Any) -> object:
    async def batches() -> Any:
        yield X[:8], Y[:8]

    kwargs: dict[str, Any] = {"model": _model(), "batches": batches(), "step_optimizer": lambda: None}
    kwargs.update(changes)
    return anyio.run(lambda: lamploop.one_epoch(**kwargs))


def _drive(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "nranks": 1,
        "device": "cpu",
        "control": None,
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "validation_batches": None,
        "max_epochs": 1,
    }
    kwargs.update(changes)
    return anyio.run(lambda: lamploop.drive_distributed_training(**kwargs))


def _follow(**changes: Any) -> object:
    async def follow() -> None:
        root, (follower,) = lamploop.local_control(2)
        async with root, follower:
            kwargs: dict[str, Any] = {
                "rank": 1,
                "nranks": 2,
                "device": "cpu",
                "control": follower,
                "model": _model(),
                "train_batches": _batches(),
                "validation_batches": None,
            }
            kwargs.update(changes)
            await lamploop.follow_distributed_training(**kwargs)

    return anyio.run(follow)


def _drive_with_the_followers_end() -> object:
    async def drive() -> None:
        root, (follower,) = lamploop.local_control(2)
        async with root, follower:
            await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=follower,  # type: ignore[arg-type]
                model=_model(),
                optimizer_factory=_sgd,
                train_batches=_batches(),
                validation_batches=None,
                max_epochs=1,
            )

    return anyio.run(drive)


def _local(replicas: Any = None, **changes: Any) -> object:
    if replicas is None:
        replicas = [(_model(), _batches(), None), (_model(), _batches(), None)]
    return anyio.run(lambda: lamploop.local_data_parallel_training_loop(replicas, _sgd, 1, **changes))


def _state(model: dict[str, torch.Tensor] | torch.nn.Module | None = None) -> Any:
    return lamploop.LoopStateWithModelAndOptimizerData(
        loop_state=lamploop.LoopState(),
        model=_module().state_dict() if model is None else model,  # type: ignore[arg-type]
        optimizer={},
        best_model={},
    )


def _a_file(tmp_path: Path) -> Path:
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    return file


def _saved_checkpoint(tmp_path: Path) -> Path:
    return lamploop.save_checkpoint(tmp_path / "run", _state())


Case = tuple[Callable[[Path], object], type[LamploopError], str]

CASES: dict[str, Case] = {
    # fit: keywords used only later (after an epoch, by a second rank, at the first checkpoint)
    "fit on_epoch not callable": (
        lambda _: _fit(on_epoch=5),
        ConfigurationError,
        "fit: on_epoch must be None or a function, got int",
    ),
    "fit checkpoint_dir an int": (
        lambda _: _fit(checkpoint_dir=5),
        ConfigurationError,
        "fit: checkpoint_dir must be a str or a pathlib.Path, got int",
    ),
    "fit checkpoint_dir a file": (
        lambda tmp: _fit(checkpoint_dir=_a_file(tmp)),
        ConfigurationError,
        "fit: checkpoint_dir '.*a-file' is a file, not a directory",
    ),
    "fit resume a str": (
        lambda _: _fit(resume="yes"),
        ConfigurationError,
        "fit: resume must be True or False, got 'yes'",
    ),
    "fit launch_command a str": (
        lambda _: _fit(launch_command="python train.py"),
        ConfigurationError,
        r"fit: launch_command must be None or a list of str \(argv",
    ),
    "fit heartbeat_interval 0 (one rank)": (
        lambda _: _fit(heartbeat_interval=0),
        ConfigurationError,
        "fit: heartbeat_interval must be a positive number of seconds, got 0",
    ),
    "fit heartbeat_interval above the timeout": (
        lambda _: _fit(heartbeat_interval=5.0),
        ConfigurationError,
        "fit: heartbeat_timeout=4.0 must exceed heartbeat_interval=5.0",
    ),
    "fit return_min_validation_loss_model a str": (
        lambda _: _fit(validation_batches=_batches(), return_min_validation_loss_model="all"),
        ConfigurationError,
        "return_min_validation_loss_model must be a container of epochs .* got str 'all'",
    ),
    "fit a module without parameters": (
        lambda _: _fit(model=_model(module=torch.nn.ReLU())),
        ConfigurationError,
        r"fit: the model's module \(ReLU\) has no parameters to train",
    ),
    # SupervisedModel: checked when made
    "SupervisedModel module a str": (
        lambda _: lamploop.SupervisedModel("net"),  # type: ignore[arg-type]
        ConfigurationError,
        "SupervisedModel: module must be a torch.nn.Module, got str",
    ),
    "SupervisedModel loss not callable": (
        lambda _: _model(loss=5),
        ConfigurationError,
        "SupervisedModel: loss must be a function .* got int",
    ),
    "SupervisedModel metrics not a mapping": (
        lambda _: _model(metrics=5),
        ConfigurationError,
        "SupervisedModel: metrics must be a mapping of names to metrics .* got int",
    ),
    "SupervisedModel a metric not callable": (
        lambda _: _model(metrics={"accuracy": 5}),
        ConfigurationError,
        r"SupervisedModel: metrics\['accuracy'\] must be a function",
    ),
    # what a loss returns
    "loss sum per example": (
        lambda _: _fit(model=_loss(lambda o, t: (F.cross_entropy(o, t, reduction="none"), len(t)))),
        ConfigurationError,
        r"SupervisedModel: the loss <lambda> returned a loss sum that is a tensor of shape \(8,\)",
    ),
    "loss sum of shape (1,)": (
        lambda _: _fit(model=_loss(lambda o, t: (_sum(o, t).reshape(1), len(t)))),
        ConfigurationError,
        r"returned a loss sum that is a tensor of shape \(1,\)",
    ),
    "loss sum a float": (
        lambda _: _fit(model=_loss(lambda o, t: (_sum(o, t).item(), len(t)))),
        ConfigurationError,
        "returned a loss sum that is float",
    ),
    "example count a str": (
        lambda _: _fit(model=_loss(lambda o, t: (_sum(o, t), "8"))),
        ConfigurationError,
        "returned an example count that is str",
    ),
    "loss sum detached": (
        lambda _: _fit(model=_loss(lambda o, t: (_sum(o, t).detach(), len(t)))),
        ConfigurationError,
        "epoch 0, batch 0: the loss sum does not depend on any parameter that requires grad",
    ),
    "every parameter frozen": (
        lambda _: _fit(model=_model(module=_module().requires_grad_(False))),
        ConfigurationError,
        "epoch 0, batch 0: the loss sum does not depend on any parameter that requires grad",
    ),
    # epochs
    "epochs train_epoch not async": (
        lambda _: _epochs(train_epoch=lambda factor: 1.0),
        ConfigurationError,
        "epochs: train_epoch returned float in epoch 0, not an awaitable",
    ),
    "epochs train_epoch returns None": (
        lambda _: _epochs(train_epoch=_returning(None)),
        ConfigurationError,
        "epochs: the training loss of epoch 0 is None, not a number",
    ),
    "epochs validation_epoch returns a vector": (
        lambda _: _epochs(validation_epoch=_returning(torch.ones(2))),
        ConfigurationError,
        r"epochs: the validation loss of epoch 0 is a tensor of shape \(2,\), not a number",
    ),
    "epochs train_epoch None": (
        lambda _: _epochs(train_epoch=None),
        ConfigurationError,
        "epochs: train_epoch must be a function, got NoneType",
    ),
    "epochs save_min_validation_loss_model None": (
        lambda _: _epochs(save_min_validation_loss_model=None),
        ConfigurationError,
        "epochs: save_min_validation_loss_model must be a function, got NoneType",
    ),
    "epochs checkpoint_state not callable": (
        lambda _: _epochs(checkpoint_state=5),
        ConfigurationError,
        "epochs: checkpoint_state must be None or a function, got int",
    ),
    "epochs on_end not callable": (
        lambda _: _epochs(on_end=5),
        ConfigurationError,
        "epochs: on_end must be None or a function, got int",
    ),
    "epochs init_state with tensors": (
        lambda _: _epochs(init_state=_state()),
        ConfigurationError,
        "epochs: init_state must be a lamploop.LoopState or None, got "
        "LoopStateWithModelAndOptimizerData; pass its .loop_state",
    ),
    "epochs init_state.epoch a str": (
        lambda _: _epochs(init_state=lamploop.LoopState(epoch="1")),  # type: ignore[arg-type]
        ConfigurationError,
        "epochs: init_state.epoch must be an int >= 0, got '1'",
    ),
    "epochs return_min_validation_loss_model None": (
        lambda _: _epochs(return_min_validation_loss_model=None),
        ConfigurationError,
        "epochs: return_min_validation_loss_model must be a container of epochs",
    ),
    "epochs schedule state of another type": (
        lambda _: _epochs(
            learning_rate_schedule=lamploop.reduce_lr_on_plateau(), learning_rate_schedule_init_state=5
        ),
        ConfigurationError,
        "epochs: learning_rate_schedule_init_state is int, but the schedule ReduceLrOnPlateau keeps a "
        "PlateauState",
    ),
    # one_epoch
    "one_epoch a bare module": (
        lambda _: _one_epoch(model=_module()),
        ConfigurationError,
        r"one_epoch: model is a torch.nn.Module \(Linear\)",
    ),
    "one_epoch step_optimizer an optimizer": (
        lambda _: _one_epoch(step_optimizer=_sgd(_module().parameters())),
        ConfigurationError,
        "one_epoch: step_optimizer is an optimizer; pass its step method",
    ),
    "one_epoch step_optimizer not callable": (
        lambda _: _one_epoch(step_optimizer=5),
        ConfigurationError,
        "one_epoch: step_optimizer must be None or a function, got int",
    ),
    "one_epoch before_step not callable": (
        lambda _: _one_epoch(before_step=5),
        ConfigurationError,
        "one_epoch: before_step must be None or a function, got int",
    ),
    "one_epoch after_step not callable": (
        lambda _: _one_epoch(after_step="print"),
        ConfigurationError,
        "one_epoch: after_step must be None or a function, got str",
    ),
    "one_epoch forward_only a str": (
        lambda _: _one_epoch(forward_only="yes"),
        ConfigurationError,
        "one_epoch: forward_only must be True or False, got 'yes'",
    ),
    "one_epoch device that does not parse": (
        lambda _: _one_epoch(device="cpuz"),
        ConfigurationError,
        "one_epoch: device 'cpuz' is not a device torch knows",
    ),
    "one_epoch channel not a channel": (
        lambda _: _one_epoch(channel=5),
        ConfigurationError,
        "one_epoch: channel must be None .* or a TensorChannel .* got int",
    ),
    "one_epoch epoch a str": (
        lambda _: _one_epoch(epoch="0"),
        ConfigurationError,
        "one_epoch: epoch must be an int >= 0, got '0'",
    ),
    # drive_distributed_training / follow_distributed_training
    "drive a bare module": (
        lambda _: _drive(model=_module()),
        ConfigurationError,
        r"drive_distributed_training: model is a torch.nn.Module \(Linear\)",
    ),
    "drive tensors as validation_batches": (
        lambda _: _drive(validation_batches=X),
        ConfigurationError,
        "drive_distributed_training: validation_batches must be a batch factory .* got Tensor",
    ),
    "drive init_state a LoopState": (
        lambda _: _drive(init_state=lamploop.LoopState()),
        ConfigurationError,
        "drive_distributed_training: init_state must be a lamploop.LoopStateWithModelAndOptimizerData "
        "or None, got LoopState",
    ),
    "drive init_state a whole Checkpoint": (
        lambda tmp: _drive(
            init_state=lamploop.load_checkpoint(lamploop.save_checkpoint(tmp / "run", _state()))
        ),
        ConfigurationError,
        r"drive_distributed_training: init_state must be .* got Checkpoint; pass its \.state",
    ),
    "drive init_state of another model": (
        lambda _: _drive(init_state=_state({"weight": torch.zeros(3)})),
        ConfigurationError,
        "drive_distributed_training: init_state.model does not fit the model",
    ),
    "drive checkpoint_state not callable": (
        lambda _: _drive(checkpoint_state=5),
        ConfigurationError,
        "drive_distributed_training: checkpoint_state must be None or a function, got int",
    ),
    "drive reporters an int": (
        lambda _: _drive(reporters=5),
        ConfigurationError,
        "drive_distributed_training: reporters must be a list of reporters, got int",
    ),
    "drive control an int": (
        lambda _: _drive(nranks=2, control=5),
        ConfigurationError,
        r"drive_distributed_training: control must be a ControlRoot .* got int",
    ),
    "drive control the follower's end": (
        lambda _: _drive_with_the_followers_end(),
        ConfigurationError,
        r"drive_distributed_training: control must be a ControlRoot .* got LocalControlFollower; the root",
    ),
    "follow a bare module": (
        lambda _: _follow(model=_module()),
        ConfigurationError,
        r"follow_distributed_training \(rank 1\): model is a torch.nn.Module",
    ),
    "follow control an int": (
        lambda _: _follow(control=5),
        ConfigurationError,
        r"follow_distributed_training \(rank 1\): control must be a ControlFollower .* got int",
    ),
    # local_data_parallel_training_loop
    "local models without streams": (
        lambda _: _local([_model(), _model()]),
        ConfigurationError,
        r"local_data_parallel_training_loop: models_with_data_streams\[0\] must be a \(model, "
        "train_batches, validation_batches\\) triple .* got SupervisedModel",
    ),
    "local pairs instead of triples": (
        lambda _: _local([(_model(), _batches()), (_model(), _batches())]),
        ConfigurationError,
        r"models_with_data_streams\[0\] must be .* got a 2-tuple",
    ),
    "local a bare module": (
        lambda _: _local([(_model(), _batches(), None), (_module(), _batches(), None)]),
        ConfigurationError,
        r"local_data_parallel_training_loop: models_with_data_streams\[1\]: model is a torch.nn.Module",
    ),
    "local tensors as train_batches": (
        lambda _: _local([(_model(), X, None), (_model(), X, None)]),
        ConfigurationError,
        r"models_with_data_streams\[0\]: train_batches must be a batch factory .* got Tensor",
    ),
    "local one module for two replicas": (
        lambda _: (lambda m: _local([(m, _batches(), None), (m, _batches(), None)]))(_model()),
        ConfigurationError,
        r"models_with_data_streams\[0\] and \[1\] share one module",
    ),
    "local init_state a LoopState": (
        lambda _: _local(init_state=lamploop.LoopState()),
        ConfigurationError,
        "local_data_parallel_training_loop: init_state must be a lamploop.LoopStateWithModelAndOptimizerData",
    ),
    "local checkpoint_state not callable": (
        lambda _: _local(checkpoint_state=5),
        ConfigurationError,
        "local_data_parallel_training_loop: checkpoint_state must be None or a function, got int",
    ),
    # batch streams
    "tensor_batches batch_size a str": (
        lambda _: lamploop.tensor_batches(X, Y, batch_size="8"),  # type: ignore[arg-type]
        ConfigurationError,
        "tensor_batches: batch_size must be an int >= 1, got '8'",
    ),
    "tensor_batches batch_size a float": (
        lambda _: lamploop.tensor_batches(X, Y, batch_size=2.5),  # type: ignore[arg-type]
        ConfigurationError,
        "tensor_batches: batch_size must be an int >= 1, got 2.5",
    ),
    "tensor_batches seed a str": (
        lambda _: lamploop.tensor_batches(X, Y, batch_size=8, seed="a"),  # type: ignore[arg-type]
        ConfigurationError,
        "tensor_batches: seed must be an int >= 0, got 'a'",
    ),
    "tensor_batches features a list": (
        lambda _: lamploop.tensor_batches(X.tolist(), Y, batch_size=8),  # type: ignore[arg-type]
        ConfigurationError,
        "tensor_batches: features must be a tensor with a batch dimension, got list",
    ),
    "tensor_batches a 0-dim target": (
        lambda _: lamploop.tensor_batches(X, torch.tensor(1), batch_size=8),
        ConfigurationError,
        "tensor_batches: target must be a tensor with a batch dimension, got a 0-dim tensor",
    ),
    "tensor_batches shuffle a str": (
        lambda _: lamploop.tensor_batches(X, Y, batch_size=8, shuffle="no"),  # type: ignore[arg-type]
        ConfigurationError,
        "tensor_batches: shuffle must be True or False, got 'no'",
    ),
    "BatchContext epoch a str": (
        lambda _: lamploop.BatchContext(epoch="0"),  # type: ignore[arg-type]
        ConfigurationError,
        "BatchContext: epoch must be an int, got '0'",
    ),
    "dataloader_batches seed a str": (
        lambda _: lamploop.dataloader_batches(DataLoader(TensorDataset(X, Y)), seed="a"),  # type: ignore[arg-type]
        ConfigurationError,
        "dataloader_batches: seed must be an int >= 0, got 'a'",
    ),
    "iterable_batches given the batches": (
        lambda _: lamploop.iterable_batches([(X, Y)]),  # type: ignore[arg-type]
        ConfigurationError,
        "iterable_batches: make must be a function of the batch context .* got list",
    ),
    # checkpoints
    "save_checkpoint directory an int": (
        lambda _: lamploop.save_checkpoint(5, _state()),  # type: ignore[arg-type]
        ConfigurationError,
        "save_checkpoint: directory must be a str or a pathlib.Path, got int",
    ),
    "save_checkpoint into a file": (
        lambda tmp: lamploop.save_checkpoint(_a_file(tmp), _state()),
        ConfigurationError,
        "save_checkpoint: directory '.*a-file' is a file, not a directory",
    ),
    "save_checkpoint a module as the model": (
        lambda tmp: lamploop.save_checkpoint(tmp, _state(_module())),
        CheckpointError,
        r"model state dict: expected a mapping of names to tensors \(pass module.state_dict\(\)\), "
        "got Linear",
    ),
    "latest_checkpoint directory an int": (
        lambda _: lamploop.latest_checkpoint(5),  # type: ignore[arg-type]
        ConfigurationError,
        "latest_checkpoint: directory must be a str or a pathlib.Path, got int",
    ),
    "load_checkpoint path an int": (
        lambda _: lamploop.load_checkpoint(5),  # type: ignore[arg-type]
        ConfigurationError,
        "load_checkpoint: path must be a str or a pathlib.Path, got int",
    ),
    "load_checkpoint schedule not a schedule": (
        lambda tmp: lamploop.load_checkpoint(_saved_checkpoint(tmp), schedule=5),  # type: ignore[arg-type]
        ConfigurationError,
        "load_checkpoint: schedule must be None or a learning-rate schedule .* got int",
    ),
    "load_checkpoint model an int": (
        lambda tmp: lamploop.load_checkpoint(_saved_checkpoint(tmp), model=5),  # type: ignore[arg-type]
        ConfigurationError,
        "load_checkpoint: model must be None, a torch.nn.Module or a state dict, got int",
    ),
    "load_checkpoint restore_rng a str": (
        lambda tmp: lamploop.load_checkpoint(_saved_checkpoint(tmp), restore_rng="yes"),  # type: ignore[arg-type]
        ConfigurationError,
        "load_checkpoint: restore_rng must be True or False, got 'yes'",
    ),
    "Checkpointer directory an int": (
        lambda _: lamploop.Checkpointer(5),  # type: ignore[arg-type]
        ConfigurationError,
        "Checkpointer: directory must be a str or a pathlib.Path, got int",
    ),
    "Checkpointer directory a file": (
        lambda tmp: lamploop.Checkpointer(_a_file(tmp)),
        ConfigurationError,
        "Checkpointer: directory '.*a-file' is a file, not a directory",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_gets_a_lamploop_error_naming_it(case: str, tmp_path: Path) -> None:
    call, error, pattern = CASES[case]
    with pytest.raises(LamploopError) as info:
        call(tmp_path)
    assert type(info.value) is error, f"{case}: {type(info.value).__name__}: {info.value}"
    assert re.search(pattern, str(info.value)), f"{case}: {info.value}"


def test_the_checks_leave_good_inputs_alone(tmp_path: Path) -> None:
    """The same calls with the inputs put right train: the checks refuse only what is wrong."""
    metric = lamploop.metrics.accuracy
    state = _fit(
        model=_model(metrics={"accuracy": metric}),
        validation_batches=_batches(),
        checkpoint_dir=tmp_path / "run",
        resume=True,
        on_epoch=lambda state: None,
        launch_command=["python", tmp_path / "train.py"],
        return_min_validation_loss_model=range(5),
    )
    assert isinstance(state, lamploop.LoopState)
    assert state.epoch == 1
    checkpoint = lamploop.load_checkpoint(tmp_path / "run", model=_module(), restore_rng=False)
    assert checkpoint.state.loop_state.epoch == 1
    loss = _one_epoch(forward_only=True, step_optimizer=None, model=_model(module=torch.nn.Flatten()))
    assert isinstance(loss, float)
    assert loss > 0
    assert isinstance(_local(), lamploop.LoopState)
