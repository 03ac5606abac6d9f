"""``lamploop inspect``: the report on real checkpoints of a short ``fit`` run, and every bad file named."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lamploop
from lamploop.cli import EXIT_FAILED, EXIT_OK, main
from lamploop.inspection import format_report, inspect_checkpoint, read_loop_state
from lamploop.state import LoopState

pytestmark = pytest.mark.timeout(120)

STEPS_PER_EPOCH = 6  # 96 examples, 16 per batch


def train(root: Path | None, *, epochs: int = 3, validate: bool = True) -> LoopState:
    """A real ``fit`` of a tiny classifier on random tensors: validation with smoothing, an accuracy
    metric, a learning-rate schedule that changes, a checkpoint after every epoch and after step 4
    of each epoch (all kept)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    x_valid = torch.randn(32, 4, generator=generator)
    y_valid = (x_valid.sum(dim=1) > 0).long()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, metrics={"accuracy": lamploop.accuracy}),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.2),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16, seed=0),
        validation_batches=lamploop.tensor_batches(x_valid, y_valid, batch_size=32, shuffle=False)
        if validate
        else None,
        validation_loss_exponential_smoothing_factor=0.5,
        learning_rate_schedule=lamploop.step_after(2, 0.5),
        max_epochs=epochs,
        checkpoint_dir=root,
        keep_last=None,
        checkpoint_every_n_steps=4 if root is not None else None,
        reporters=[],
    )
    assert state is not None
    return state


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoopState]:
    root = tmp_path_factory.mktemp("inspect") / "run"
    return root, train(root)


@pytest.fixture
def run(trained: tuple[Path, LoopState], tmp_path: Path) -> Path:
    """A copy of the trained run directory, free to damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    return copy


def _table(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("learning curve"))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_the_report_is_the_latest_checkpoint_s_state_and_every_file_checks(
    trained: tuple[Path, LoopState],
) -> None:
    root, state = trained
    report = inspect_checkpoint(root)
    assert report.ok, report.problems
    assert report.path == root / "epoch-000003"
    assert report.run_directory == root
    assert report.loop_state == state
    assert report.epoch == 3
    assert report.best_epoch == state.min_validation_epoch is not None
    assert report.position is None
    descriptor = json.loads((report.path / "checkpoint.json").read_text())
    assert report.lamploop_version == descriptor["lamploop_version"]
    assert report.format_version == descriptor["format_version"] == 2
    # Every file, with its size on disk and (for the tensor files) a passed sha256 check.
    on_disk = {p.name: p.stat().st_size for p in report.path.iterdir()}
    assert {f.name: f.size for f in report.files} == on_disk
    assert report.files[0].name == "checkpoint.json"
    assert all(f.ok and f.sha256_ok for f in report.files[1:])
    # Every checkpoint of the run: the epoch ends and the step-4 boundaries, all valid.
    names = [c.path.name for c in report.checkpoints]
    assert names == [
        "epoch-000000-step-000004",
        "epoch-000001",
        "epoch-000001-step-000004",
        "epoch-000002",
        "epoch-000002-step-000004",
        "epoch-000003",
    ]
    assert [c.is_latest for c in report.checkpoints] == [False] * 5 + [True]
    assert all(c.ok for c in report.checkpoints)

    text = format_report(report)
    assert str(report.path) in text
    assert f"lamploop {report.lamploop_version}" in text
    assert f"best epoch   {state.min_validation_epoch}" in text
    assert text.rstrip().endswith("ok: every file is intact")
    for f in report.files:
        assert re.search(rf"^  {re.escape(f.name)} +{f.size:,} bytes  ok", text, re.MULTILINE), f.name


def test_the_learning_curve_table_holds_the_loop_state_s_values(trained: tuple[Path, LoopState]) -> None:
    root, state = trained
    rows = _table(format_report(inspect_checkpoint(root)))
    header, body = rows[0], rows[1:]
    assert header == [
        "epoch",
        "train loss",
        "valid raw",
        "valid smoothed",
        "lr factor",
        "train accuracy",
        "valid accuracy",
        "valid accuracy smoothed",
    ]
    assert len(body) == len(state.learning_curve) == 3
    for row, entry in zip(body, state.learning_curve, strict=True):
        best = entry.epoch == state.min_validation_epoch
        assert row[0] == f"{entry.epoch}{'*' if best else ''}"
        assert entry.validation_loss is not None
        assert entry.learning_rate_factor is not None
        expected = [
            entry.training_loss,
            entry.validation_loss[1],
            entry.validation_loss[0],
            entry.learning_rate_factor,
            entry.training_metrics["accuracy"],
            entry.validation_metrics["accuracy"][1],
            entry.validation_metrics["accuracy"][0],
        ]
        assert [float(cell) for cell in row[1:]] == pytest.approx(expected, rel=1e-5)
    assert sum(row[0].endswith("*") for row in body) == 1
    # The schedule halved the factor after 2 epochs: the column shows it.
    assert [float(row[4]) for row in body] == [1.0, 1.0, 0.5]


def test_a_step_boundary_checkpoint_reports_its_position(trained: tuple[Path, LoopState]) -> None:
    root, state = trained
    report = inspect_checkpoint(root / "epoch-000001-step-000004")
    assert report.ok, report.problems
    assert report.run_directory is None
    assert [c.path for c in report.checkpoints] == [report.path]
    assert report.position is not None
    assert (report.position.epoch, report.position.steps_done) == (1, 4)
    assert report.loop_state is not None
    assert report.loop_state.learning_curve == state.learning_curve[:1]
    assert "resumes at   epoch 1 after step 4 (a step-boundary checkpoint)" in format_report(report)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("file", "damage", "problem"),
    [
        ("model.safetensors", _flip_a_byte, "sha256 mismatch"),
        ("checkpoint.json", _truncate, "not valid JSON"),
        ("optimizer.safetensors", _delete, "missing (listed in checkpoint.json)"),
    ],
)
def test_a_damaged_file_is_named_and_the_status_is_1(
    run: Path, file: str, damage: Callable[[Path], None], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = run / "epoch-000003" / file
    damage(bad)
    status = main(["inspect", str(run)])
    out, err = capsys.readouterr()
    assert status == EXIT_FAILED
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lamploop: {bad}: {problem}")
    # The report falls back to the newest valid checkpoint, as loading would, and lists the bad one.
    report = inspect_checkpoint(run)
    assert report.path == run / "epoch-000002-step-000004"
    assert [c.path.name for c in report.checkpoints if not c.ok] == ["epoch-000003"]
    assert "(the latest valid one: 'latest' names epoch-000003, which is bad)" in out
    assert re.search(r"^  epoch-000003 +BAD: 1 problem \(latest\)$", out, re.MULTILINE)
    assert f"1 problem:\n  {bad}: {problem}" in out


def test_the_damaged_checkpoint_itself_shows_each_file_s_status(run: Path) -> None:
    checkpoint = run / "epoch-000003"
    _flip_a_byte(checkpoint / "model.safetensors")
    _truncate(checkpoint / "best_model.safetensors")
    _delete(checkpoint / "rng.safetensors")
    report = inspect_checkpoint(checkpoint)
    assert not report.ok
    by_name = {f.name: f for f in report.files}
    assert by_name["model.safetensors"].sha256_ok is False
    assert by_name["best_model.safetensors"].problem is not None
    assert "truncated" in by_name["best_model.safetensors"].problem
    assert by_name["rng.safetensors"].size is None
    assert by_name["optimizer.safetensors"].ok
    assert by_name["optimizer.safetensors"].sha256_ok
    # Every bad file, not just the first.
    assert [p.split(": ", 1)[0] for p in report.problems] == [
        str(checkpoint / "model.safetensors"),
        str(checkpoint / "best_model.safetensors"),
        str(checkpoint / "rng.safetensors"),
    ]
    text = format_report(report)
    assert re.search(r"^  rng\.safetensors +missing  BAD: missing", text, re.MULTILINE)
    assert re.search(r"^  optimizer\.safetensors +[\d,]+ bytes  ok \(sha256\)$", text, re.MULTILINE)
    assert "3 problems:" in text


def test_an_unreadable_descriptor_leaves_the_other_files_unchecked_and_names_only_it(run: Path) -> None:
    checkpoint = run / "epoch-000003"
    _truncate(checkpoint / "checkpoint.json")
    report = inspect_checkpoint(checkpoint)
    assert report.loop_state is None
    assert report.learning_curve == ()
    problem = report.files[0].problem
    assert problem is not None
    assert problem.startswith("not valid JSON")
    assert report.problems == (f"{checkpoint / 'checkpoint.json'}: {problem}",)
    assert all(f.note == "not checked: checkpoint.json is unreadable" for f in report.files[1:])
    assert "written by   unknown: checkpoint.json is unreadable" in format_report(report)


def test_a_latest_pointer_naming_nothing_is_a_problem(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "latest").write_text("epoch-000099\n")
    assert main(["inspect", str(run)]) == EXIT_FAILED
    _, err = capsys.readouterr()
    assert f"{run / 'latest'}: names epoch-000099" in err
    report = inspect_checkpoint(run)
    assert report.path == run / "epoch-000003"  # the most recently saved, as loading would


def test_an_unlisted_file_and_a_missing_latest_pointer_are_notes_not_problems(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "latest").unlink()
    (run / "epoch-000003" / "notes.txt").write_text("mine")
    assert main(["inspect", str(run)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert err == ""
    report = inspect_checkpoint(run)
    assert report.ok
    assert report.path == run / "epoch-000003"  # the most recently saved
    assert report.notes == (
        f"{run / 'latest'}: missing; the most recently saved checkpoint counts as the latest",
        f"{run / 'epoch-000003' / 'notes.txt'}: not listed in checkpoint.json (not read when loading)",
    )
    assert "notes:\n" in out
    assert re.search(r"^  notes\.txt +4 bytes  not listed in checkpoint\.json", out, re.MULTILINE)


def test_a_descriptor_listing_a_path_outside_the_checkpoint_is_refused(run: Path) -> None:
    descriptor = run / "epoch-000003" / "checkpoint.json"
    document = json.loads(descriptor.read_text())
    document["files"]["../latest"] = {"sha256": "0" * 64, "size": 1}
    descriptor.write_text(json.dumps(document))
    report = inspect_checkpoint(run / "epoch-000003")
    assert report.problems == (
        f"{descriptor}: lists '../latest', which is not a file name inside the checkpoint directory",
    )


def test_a_good_checkpoint_exits_0_and_a_missing_one_1(
    trained: tuple[Path, LoopState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(trained[0])]) == EXIT_OK
    out, err = capsys.readouterr()
    assert err == ""
    assert out == format_report(inspect_checkpoint(trained[0]))
    assert main(["inspect", str(tmp_path / "nothing")]) == EXIT_FAILED
    _, err = capsys.readouterr()
    assert err == f"lamploop: CheckpointError: {tmp_path / 'nothing'}: no such checkpoint directory\n"
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == EXIT_FAILED
    assert "no checkpoint here" in capsys.readouterr().err


def test_read_loop_state_reads_the_descriptor_only(run: Path, trained: tuple[Path, LoopState]) -> None:
    assert read_loop_state(run) == trained[1]
    # The tensors are not read: a corrupt model file does not matter for the curve.
    _flip_a_byte(run / "epoch-000003" / "model.safetensors")
    assert read_loop_state(run) == trained[1]
    # An unreadable descriptor falls back to the newest readable one.
    _truncate(run / "epoch-000003" / "checkpoint.json")
    assert read_loop_state(run).learning_curve == trained[1].learning_curve[:2]


def test_inspect_in_a_real_process_names_the_corrupt_file(run: Path) -> None:
    bad = run / "epoch-000003" / "optimizer.safetensors"
    _flip_a_byte(bad)
    result = subprocess.run(
        [sys.executable, "-m", "lamploop.cli", "inspect", str(run)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == EXIT_FAILED, result.stderr
    assert result.stderr.startswith(f"lamploop: {bad}: sha256 mismatch"), result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "checkpoint   " in result.stdout
    assert f"1 problem:\n  {bad}: sha256 mismatch" in result.stdout


def test_a_metrics_file_in_the_run_directory_shows_where_the_steps_time_went(
    trained: tuple[Path, LoopState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lamploop.reporting import EpochFinished, MetricsFileReporter, StepBreakdown

    root, state = trained
    run = tmp_path / "run"
    shutil.copytree(root, run)
    rows = MetricsFileReporter(run / "metrics.csv")
    for epoch, data_wait in ((0, 0.25), (1, 0.5)):
        breakdown = StepBreakdown(
            steps=6,
            seconds=1.0,
            data_wait=data_wait,
            forward_backward=0.25,
            optimizer=0.125,
            checkpoint=0.0625,
        )
        done = LoopState(epoch=epoch + 1, learning_curve=state.learning_curve[: epoch + 1])
        rows.report(EpochFinished(done, seconds=1.5, steps=6, examples=96, step_breakdown=breakdown))
    rows.close()

    assert main(["inspect", str(run)]) == EXIT_OK  # the metrics file is no problem of the run's
    text = capsys.readouterr().out
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("where the training steps' time went"))
    assert str(run / "metrics.csv") in lines[start]
    table = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1 : start + 4]]
    assert table == [
        [
            "epoch",
            "steps",
            "ms/step",
            "data wait",
            "fwd+bwd",
            "comm wait",
            "optimizer",
            "checkpoint",
            "other",
        ],
        ["0", "6", "166.667", "25.0%", "25.0%", "0.0%", "12.5%", "6.2%", "31.2%"],
        ["1", "6", "166.667", "50.0%", "25.0%", "0.0%", "12.5%", "6.2%", "6.2%"],
    ]
    # Without a breakdown in any metrics file, no such section.
    assert "where the training steps' time went" not in format_report(inspect_checkpoint(root))
