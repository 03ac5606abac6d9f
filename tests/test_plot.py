"""``lamploop plot``: a PNG of the learning curve of a real ``fit`` run, read back pixel by pixel."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_inspect import train

from lamploop import errors
from lamploop.cli import EXIT_FAILED, EXIT_OK, main
from lamploop.errors import ConfigurationError
from lamploop.plotting import BEST_EPOCH_COLOR, plot_learning_curve
from lamploop.state import LearningCurveEntry, LoopState

pytest.importorskip("matplotlib")
from matplotlib.colors import to_rgb
from matplotlib.image import imread

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoopState]:
    root = tmp_path_factory.mktemp("plot") / "run"
    return root, train(root, epochs=4)


def _pixels(path: Path) -> np.ndarray:
    image = imread(path)
    assert image.dtype == np.float32
    return np.asarray(np.round(image[..., :3] * 255), dtype=np.uint8)


def _colours(pixels: np.ndarray) -> set[tuple[int, int, int]]:
    return {tuple(int(c) for c in p) for p in pixels.reshape(-1, 3)}  # type: ignore[misc]


def _count(pixels: np.ndarray, colour: str) -> int:
    rgb = np.array([round(c * 255) for c in to_rgb(colour)], dtype=np.uint8)
    return int(np.all(pixels == rgb, axis=-1).sum())


def test_the_png_has_the_configured_size_many_colours_and_the_best_epoch_marked(
    trained: tuple[Path, LoopState], tmp_path: Path
) -> None:
    _, state = trained
    assert state.min_validation_epoch is not None
    out = plot_learning_curve(state, tmp_path / "curve.png", title="tiny", figsize=(6, 4), dpi=100)
    assert out == tmp_path / "curve.png"
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    pixels = _pixels(out)
    assert pixels.shape == (400, 600, 3)
    assert len(_colours(pixels)) > 100  # lines, text, antialiasing: not a blank canvas
    assert _count(pixels, "white") < 0.95 * 400 * 600
    # The star and the vertical line of the best epoch: a colour nothing else uses.
    assert _count(pixels, BEST_EPOCH_COLOR) > 50
    # Nothing but the figure: no temporary file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]


def test_without_validation_there_is_no_best_epoch_marker(tmp_path: Path) -> None:
    state = train(None, epochs=2, validate=False)
    assert state.min_validation_epoch is None
    assert all(e.validation_loss is None for e in state.learning_curve)
    pixels = _pixels(plot_learning_curve(state, tmp_path / "curve.png", figsize=(6, 4), dpi=100))
    assert pixels.shape == (400, 600, 3)
    assert len(_colours(pixels)) > 100
    assert _count(pixels, BEST_EPOCH_COLOR) == 0


def test_the_learning_rate_factor_gets_a_second_axis_when_recorded(trained: tuple[Path, LoopState]) -> None:
    from matplotlib.figure import Figure

    from lamploop.plotting import _draw

    _, state = trained
    with_factors = Figure()
    _draw(with_factors, state, "t")
    assert [a.get_ylabel() for a in with_factors.axes] == ["loss", "learning-rate factor"]
    (factor_line,) = with_factors.axes[1].get_lines()
    assert list(factor_line.get_ydata()) == [e.learning_rate_factor for e in state.learning_curve]
    without_factors = [LearningCurveEntry(e.epoch, e.training_loss) for e in state.learning_curve]
    old_entries = LoopState(epoch=2, learning_curve=without_factors)
    without = Figure()
    _draw(without, old_entries, "t")
    assert [a.get_ylabel() for a in without.axes] == ["loss"]
    labels = [t.get_text() for t in with_factors.axes[1].get_legend().get_texts()]
    best = state.min_validation_epoch
    assert labels[:3] == ["training loss", "validation loss (raw)", "validation loss (smoothed)"]
    assert labels[3].startswith(f"best epoch {best} ")
    assert labels[4] == "learning-rate factor"


def test_plot_from_a_run_directory_and_the_command(
    trained: tuple[Path, LoopState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = trained
    out = tmp_path / "curve.png"
    out.write_bytes(b"an older figure")  # replaced whole
    assert main(["plot", str(root), "-o", str(out)]) == EXIT_OK
    assert capsys.readouterr().out == f"wrote {out}\n"
    pixels = _pixels(out)
    assert pixels.shape == (600, 960, 3)  # the default: 8 x 5 inches at 120 dpi
    assert _count(pixels, BEST_EPOCH_COLOR) > 50
    # A checkpoint directory works as well, with a title of one's own.
    assert main(["plot", str(root / "epoch-000002"), "-o", str(out), "--title", "two epochs"]) == EXIT_OK
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]


def test_plot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "nothing"), "-o", str(tmp_path / "c.png")]) == EXIT_FAILED
    assert capsys.readouterr().err == (
        f"lamploop: CheckpointError: {tmp_path / 'nothing'}: no such checkpoint directory\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])  # no -o
    assert exit_info.value.code == 2
    assert not (tmp_path / "c.png").exists()


def test_without_matplotlib_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    state = LoopState()
    with pytest.raises(ConfigurationError, match=r'pip install "lamploop\[plot\]"') as info:
        plot_learning_curve(state, tmp_path / "c.png")
    assert isinstance(info.value, errors.MissingDependencyError)
    assert not (tmp_path / "c.png").exists()
    run = tmp_path / "run"
    train(run, epochs=1)
    assert main(["plot", str(run), "-o", str(tmp_path / "c.png")]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert 'install it with: pip install "lamploop[plot]"' in err
