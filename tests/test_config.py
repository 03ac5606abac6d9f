"""Run configurations: ``config.json`` beside the checkpoints, and ``lamploop demo --resume DIR``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import attrs
import pytest

from lamploop.checkpoint import load_checkpoint
from lamploop.cli import EXIT_FAILED, EXIT_OK, main
from lamploop.demo import CONFIG_NAME, DemoConfig, load_config, resolve_config, run_demo, save_config
from lamploop.errors import ConfigurationError

pytest.importorskip("sklearn")

pytestmark = pytest.mark.timeout(120)

# A small, quick demo run: one rank, big batches, a narrow MLP.
FLAGS = ["--world-size", "1", "--batch-size", "128", "--seed", "3", "--hidden-sizes", "16"]
SAVED = DemoConfig(epochs=2, batch_size=128, world_size=1, seed=3, hidden_sizes=(16,))


def _edit(directory: Path, **changes: object) -> None:
    path = directory / CONFIG_NAME
    document = json.loads(path.read_text())
    document["config"].update(changes)
    path.write_text(json.dumps(document))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    config = DemoConfig(
        epochs=7, batch_size=64, world_size=3, seed=11, learning_rate=0.25, hidden_sizes=[8, 4]
    )
    path = save_config(config, tmp_path / "run")
    assert path == tmp_path / "run" / CONFIG_NAME
    assert load_config(tmp_path / "run", DemoConfig) == config
    assert load_config(tmp_path / "run", DemoConfig).hidden_sizes == (8, 4)
    document = json.loads(path.read_text())
    assert document["kind"] == "DemoConfig"
    assert document["version"] == DemoConfig.config_version == 1
    assert document["config"] == {
        "epochs": 7,
        "batch_size": 64,
        "world_size": 3,
        "seed": 11,
        "learning_rate": 0.25,
        "hidden_sizes": [8, 4],
    }
    # Written atomically: the file replaced whole, no temporary left behind.
    save_config(attrs.evolve(config, epochs=8), tmp_path / "run")
    assert load_config(tmp_path / "run", DemoConfig).epochs == 8
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [CONFIG_NAME]


def test_a_field_that_is_absent_is_refused_not_defaulted(tmp_path: Path) -> None:
    """docs/cli.md: "an unknown key, a missing one or a wrong type is a ConfigurationError naming
    the field and the file" (a default in its place could resume with another setting)."""
    save_config(DemoConfig(epochs=3, learning_rate=0.01), tmp_path)
    path = tmp_path / CONFIG_NAME
    document = json.loads(path.read_text())
    del document["config"]["learning_rate"]
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigurationError) as info:
        load_config(tmp_path, DemoConfig)
    assert str(info.value).startswith(str(path))
    assert "missing key learning_rate" in str(info.value)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"learning_rate": -1.0}, "learning_rate must be a positive finite number, got -1.0"),
        ({"learning_rate": float("nan")}, "learning_rate must be a positive finite number, got nan"),
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"hidden_sizes": (16, 0)}, "hidden_sizes[1] must be an int >= 1, got 0"),
    ],
    ids=["negative-lr", "nan-lr", "batch-size", "world-size", "hidden-size"],
)
def test_a_setting_that_cannot_train_is_refused_when_made(given: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        DemoConfig(**given)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_sise": 64}, "unknown field batch_sise"),
        ({"batch_size": "64"}, "batch_size: expected an integer, got '64' (str)"),
        ({"epochs": 2.0}, "epochs: expected an integer, got 2.0 (float)"),
        ({"learning_rate": True}, "learning_rate: expected a number, got True (bool)"),
        ({"hidden_sizes": [16, "8"]}, "hidden_sizes[1]: expected an integer, got '8' (str)"),
        ({"hidden_sizes": 16}, "hidden_sizes: expected a list, got 16 (int)"),
    ],
)
def test_an_unknown_key_or_a_wrong_type_is_named_with_the_file(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    save_config(DemoConfig(), tmp_path)
    _edit(tmp_path, **changes)
    with pytest.raises(ConfigurationError) as info:
        load_config(tmp_path, DemoConfig)
    assert str(info.value) == f"{tmp_path / CONFIG_NAME}: {message}"


def test_the_kind_version_and_shape_of_the_file_are_checked(tmp_path: Path) -> None:
    path = tmp_path / CONFIG_NAME
    with pytest.raises(ConfigurationError, match=f"^{path}: missing$"):
        load_config(tmp_path, DemoConfig)

    @attrs.frozen
    class OtherConfig:
        epochs: int = 1

    save_config(OtherConfig(), tmp_path)
    with pytest.raises(
        ConfigurationError, match=r"kind: holds a '.*OtherConfig' configuration, expected 'DemoConfig'"
    ):
        load_config(tmp_path, DemoConfig)
    save_config(DemoConfig(), tmp_path)
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "version": 2}))
    with pytest.raises(
        ConfigurationError, match=r"version: DemoConfig version 2 was written by a newer lamploop"
    ):
        load_config(tmp_path, DemoConfig)
    path.write_text(json.dumps({**document, "extra": 1}))
    with pytest.raises(ConfigurationError, match=f"^{path}: unknown key extra "):
        load_config(tmp_path, DemoConfig)
    path.write_text(json.dumps(document)[:40])
    with pytest.raises(ConfigurationError, match=f"^{path}: not valid JSON"):
        load_config(tmp_path, DemoConfig)


def test_resolve_config_without_checkpoints_takes_what_is_given(tmp_path: Path) -> None:
    # A config whose run never wrote a checkpoint: nothing was trained that could disagree.
    save_config(DemoConfig(batch_size=64), tmp_path)
    assert resolve_config(tmp_path, DemoConfig, {"batch_size": 32}) == DemoConfig(batch_size=32)
    with pytest.raises(ConfigurationError, match="missing: nothing to resume"):
        resolve_config(tmp_path / "elsewhere", DemoConfig, {}, resume=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-epoch demo run, as ``lamploop demo --out DIR --epochs 2 ...`` leaves it."""
    out = tmp_path_factory.mktemp("demo") / "run"
    assert main(["demo", "--out", str(out), "--epochs", "2", *FLAGS]) == EXIT_OK
    return out


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def test_the_demo_saves_its_config_beside_the_checkpoints(trained: Path) -> None:
    assert load_config(trained, DemoConfig) == SAVED
    assert load_checkpoint(trained).state.loop_state.epoch == 2


def test_resume_needs_no_other_flag_and_ends_as_the_uninterrupted_run(
    trained: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = load_checkpoint(trained / "epoch-000002").state.loop_state
    # As if the run had been stopped during its last epoch, before that epoch's checkpoint.
    shutil.rmtree(run / "epoch-000002")
    (run / "latest").write_text("epoch-000001\n")
    capsys.readouterr()
    assert main(["demo", "--resume", str(run)]) == EXIT_OK
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("epoch")] == ["epoch 1"]
    # With the saved batch size, seed, width and rank count: the very same curve.
    assert load_checkpoint(run).state.loop_state == full


def test_resume_may_raise_the_epochs_to_train_longer(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--resume", str(run), "--epochs", "3"]) == EXIT_OK
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("epoch")] == ["epoch 2"]
    state = load_checkpoint(run).state.loop_state
    assert state.epoch == 3
    assert len(state.learning_curve) == 3
    assert load_config(run, DemoConfig) == attrs.evolve(SAVED, epochs=3)
    # Then --resume alone goes on to the raised count: there is nothing left to train.
    assert main(["demo", "--resume", str(run)]) == EXIT_OK
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert load_checkpoint(run).state.loop_state.epoch == 3


@pytest.mark.parametrize(
    ("flags", "field", "saved", "given"),
    [
        (["--batch-size", "64"], "batch_size", "128", "64"),
        (["--seed", "0"], "seed", "3", "0"),
        (["--world-size", "2"], "world_size", "1", "2"),
        (["--hidden-sizes", "16,16"], "hidden_sizes", "16", "16,16"),
        (["--learning-rate", "0.01"], "learning_rate", "0.001", "0.01"),
    ],
)
@pytest.mark.parametrize("where", ["--resume", "--out"])
def test_a_flag_that_disagrees_with_the_saved_config_is_refused_naming_the_field(
    run: Path,
    capsys: pytest.CaptureFixture[str],
    where: str,
    flags: list[str],
    field: str,
    saved: str,
    given: str,
) -> None:
    latest = (run / "latest").read_text()
    capsys.readouterr()
    assert main(["demo", where, str(run), *flags]) == EXIT_FAILED
    out, err = capsys.readouterr()
    assert err == (
        f"lamploop: ConfigurationError: {field}: the checkpoint in {run} was trained with {saved}, "
        f"the command line says {given}\n"
    )
    assert out == ""  # nothing trained
    assert (run / "latest").read_text() == latest
    assert load_config(run, DemoConfig) == SAVED


def test_several_disagreements_are_refused_together(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo", "--out", str(run), "--epochs", "1", "--batch-size", "64", "--seed", "5"]) == EXIT_FAILED
    )
    err = capsys.readouterr().err
    assert err == (
        f"lamploop: ConfigurationError: batch_size: the checkpoint in {run} was trained with 128, "
        f"the command line says 64; seed: the checkpoint in {run} was trained with 3, "
        "the command line says 5\n"
    )


def test_fewer_epochs_end_a_run_sooner_and_say_there_is_nothing_left(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latest = (run / "latest").read_text()
    assert main(["demo", "--resume", str(run), "--epochs", "1"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "nothing to train: the run is at epoch 2 and max_epochs is 1" in out
    assert "lamploop demo --epochs N" in out
    assert not [line for line in out.splitlines() if line.startswith("epoch")]
    assert (run / "latest").read_text() == latest
    assert load_config(run, DemoConfig) == attrs.evolve(SAVED, epochs=1)


def test_the_demo_refuses_zero_epochs_and_a_file_for_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--out", str(tmp_path / "run"), "--epochs", "0"]) == EXIT_FAILED
    assert capsys.readouterr().err == "lamploop: ConfigurationError: epochs must be an int >= 1, got 0\n"
    assert not (tmp_path / "run").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    assert main(["demo", "--out", str(a_file), "--epochs", "1"]) == EXIT_FAILED
    assert capsys.readouterr().err == (
        f"lamploop: ConfigurationError: --out {a_file}: exists and is not a directory; "
        "name a directory for the run\n"
    )
    assert a_file.read_text() == "mine\n"


def test_run_demo_s_arguments_are_checked_too(run: Path) -> None:
    with pytest.raises(
        ConfigurationError, match=r"^batch_size: .* was trained with 128, run_demo's argument says 32$"
    ):
        run_demo(epochs=2, out=run, batch_size=32, seed=3, world_size=1, hidden_sizes=(16,))
    # The same arguments as the saved run: it resumes (nothing left to train at epoch 2).
    assert run_demo(epochs=2, out=run, batch_size=128, seed=3, world_size=1, hidden_sizes=(16,)) is not None


def test_resume_without_a_config_and_resume_with_out_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--resume", str(tmp_path)]) == EXIT_FAILED
    assert capsys.readouterr().err == (
        f"lamploop: ConfigurationError: {tmp_path / CONFIG_NAME}: missing: nothing to resume in {tmp_path} "
        f"(a run writes {CONFIG_NAME} beside its checkpoints)\n"
    )
    with pytest.raises(SystemExit) as info:
        main(["demo", "--resume", str(tmp_path), "--out", str(tmp_path)])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["demo", "--hidden-sizes", "16,x"])
    assert info.value.code == 2


def test_checkpoints_without_a_config_get_one_only_once_they_resume(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / CONFIG_NAME).unlink()  # as a directory written before config.json existed
    # A model the checkpoint does not fit: refused, and no config records it.
    wider = ["--world-size", "1", "--batch-size", "128", "--seed", "3", "--hidden-sizes", "32"]
    assert main(["demo", "--out", str(run), "--epochs", "3", *wider]) == EXIT_FAILED
    assert "does not fit the given model" in capsys.readouterr().err
    assert not (run / CONFIG_NAME).exists()
    assert main(["demo", "--out", str(run), "--epochs", "3", *FLAGS]) == EXIT_OK
    assert load_config(run, DemoConfig) == attrs.evolve(SAVED, epochs=3)
    assert load_checkpoint(run).state.loop_state.epoch == 3
