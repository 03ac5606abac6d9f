"""The model summary: its counts against independent ones, in a fit run's output, in ``lamploop inspect``."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
import torch

import lamploop
from lamploop.cli import EXIT_OK, main
from lamploop.errors import ConfigurationError
from lamploop.inspection import format_report, inspect_checkpoint
from lamploop.reporting import ProgressReporter, RunStarted
from lamploop.summary import OWN, summarize, summarize_tensors

pytestmark = pytest.mark.timeout(60)


class Net(torch.nn.Module):
    """Nested modules, a frozen layer, a BatchNorm (buffers), a parameter of its own, a float64 head,
    and a parameter shared by two top-level modules."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Sequential(torch.nn.Linear(16, 16))
        )
        self.head = torch.nn.Linear(16, 3).double()
        self.tied = torch.nn.Linear(16, 16, bias=False)
        self.tied.weight = self.encoder[2][0].weight  # shared: counted once in the totals
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.encoder[0].requires_grad_(False)
        self.encoder[2][0].bias.requires_grad_(False)  # a partly frozen module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tied(self.encoder(x)).double()).float() * self.scale


def _numel(module: torch.nn.Module, *, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable)


def test_the_counts_are_the_parameters_counted_independently() -> None:
    net = Net()
    summary = summarize(net)
    assert summary.type == "Net"
    assert summary.total_parameters == _numel(net) == 16 * 8 + 16 + 32 + 16 * 16 + 16 + 16 * 3 + 3 + 3
    assert summary.trainable_parameters == _numel(net, trainable=True)
    assert summary.non_trainable_parameters == _numel(net, trainable=False) == 16 * 8 + 16 + 16
    assert summary.size_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert summary.size_mb == summary.size_bytes / 1e6
    rows = {layer.name: layer for layer in summary.layers}
    assert list(rows) == [OWN, "encoder", "head", "tied"]
    for name, module in net.named_children():
        assert rows[name].parameters == _numel(module), name
        assert rows[name].trainable == _numel(module, trainable=True), name
        assert rows[name].type == type(module).__name__
    assert rows[OWN].parameters == 3
    assert rows["tied"].parameters == 16 * 16  # the shared weight, in its row too
    assert [rows[n].trainable_text for n in ("encoder", "head")] == ["partly", "yes"]

    deeper = summarize(net, depth=2)
    assert [layer.name for layer in deeper.layers] == [
        OWN,
        "encoder",
        "encoder.0",
        "encoder.1",
        "encoder.2",
        "head",
        "tied",
    ]
    assert {layer.name: layer.trainable_text for layer in deeper.layers}["encoder.0"] == "no"
    assert deeper.total_parameters == summary.total_parameters
    assert summarize(net, depth=0).layers == ()
    with pytest.raises(ConfigurationError, match="depth"):
        summarize(net, depth=-1)


def test_the_table_shows_every_row_and_the_totals() -> None:
    net = Net()
    lines = summarize(net).lines()
    total, trainable = _numel(net), _numel(net, trainable=True)
    size = sum(p.numel() * p.element_size() for p in net.parameters()) / 1e6
    assert lines[0] == (
        f"model: Net, {total:,} parameters ({trainable:,} trainable, {total - trainable:,} non-trainable), "
        f"{size:.3f} MB"
    )
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    assert cells[0] == ["name", "type", "parameters", "trainable"]
    assert cells[1:] == [
        [OWN, "Net", "3", "yes"],
        ["encoder", "Sequential", f"{_numel(net.encoder):,}", "partly"],
        ["head", "Linear", "51", "yes"],
        ["tied", "Linear", "256", "yes"],
    ]


def test_a_module_without_children_is_one_line_and_lazy_parameters_are_named() -> None:
    assert summarize(torch.nn.Linear(4, 2)).lines() == [
        "model: Linear, 10 parameters (10 trainable, 0 non-trainable), 0.000 MB"
    ]
    lazy = summarize(torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Linear(3, 2)))
    assert (lazy.total_parameters, lazy.uninitialized) == (8, 2)
    assert "2 uninitialized lazy parameter tensor(s)" in lazy.heading()


def test_tensors_are_grouped_by_their_top_level_module() -> None:
    net = Net()
    state = net.state_dict()  # parameters and buffers (BatchNorm's running statistics)
    summary = summarize_tensors(state)
    assert [g.name for g in summary.groups] == [OWN, "encoder", "head", "tied"]
    groups = {g.name: g for g in summary.groups}
    assert groups[OWN].elements == 3
    for prefix in ("encoder", "head", "tied"):
        mine = {n: t for n, t in state.items() if n.startswith(prefix + ".")}
        assert groups[prefix].tensors == len(mine)
        assert groups[prefix].elements == sum(t.numel() for t in mine.values())
        assert groups[prefix].size_bytes == sum(t.numel() * t.element_size() for t in mine.values())
    assert summary.elements == sum(t.numel() for t in state.values())
    specs = lamploop.model_spec(net).tensors  # what a checkpoint records: the same summary
    assert summarize_tensors(specs) == summary
    assert [g.name for g in summarize_tensors(state, depth=2).groups][:4] == [
        OWN,
        "encoder.0",
        "encoder.1",
        "encoder.2",
    ]


def _tiny_fit(**kwargs: object) -> lamploop.LoopState | None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=1,
        **kwargs,
    )


def test_fit_logs_the_summary_after_the_start_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lamploop")
    _tiny_fit()
    messages = [r.getMessage() for r in caplog.records if r.name == "lamploop"]
    start = messages.index("training on 1 rank(s) from epoch 0 to 1")
    summary = messages[start + 1].splitlines()
    assert summary[0] == "model: Sequential, 58 parameters (58 trainable, 0 non-trainable), 0.000 MB"
    assert [re.split(r"\s{2,}", line.strip()) for line in summary[1:]] == [
        ["name", "type", "parameters", "trainable"],
        ["0", "Linear", "40", "yes"],
        ["1", "ReLU", "0", "-"],
        ["2", "Linear", "18", "yes"],
    ]
    assert messages[start + 2].startswith("epoch 0: train loss ")


def test_the_progress_reporter_prints_it_below_the_start_line() -> None:
    out = io.StringIO()
    progress = ProgressReporter(out)
    summary = summarize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()))
    progress.report(RunStarted(nranks=2, epoch=0, max_epochs=3, model_summary=summary, time=0.0))
    progress.close()
    assert out.getvalue().splitlines() == ["training on 2 rank(s) from epoch 0 to 3", *summary.lines()]


def test_a_run_without_reporters_makes_no_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    import lamploop.distributed.drive as drive

    def fail(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("summarized with nobody listening")

    monkeypatch.setattr(drive, "summarize", fail)
    assert _tiny_fit(reporters=[]) is not None


def test_inspect_shows_the_checkpoint_s_tensors_per_top_level_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tiny_fit(checkpoint_dir=tmp_path / "run", reporters=[])
    text = format_report(inspect_checkpoint(tmp_path / "run"))
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("model "))
    assert lines[at] == "model        58 values in 4 tensors (parameters and buffers), 0.000 MB"
    assert [re.split(r"\s{2,}", line.strip()) for line in lines[at + 1 : at + 5]] == [
        ["module", "tensors", "values", "MB"],
        ["0", "2", "40", "0.000"],
        ["2", "2", "18", "0.000"],
        ["total", "4", "58", "0.000"],
    ]
    assert lines[at + 5] == ""
    assert main(["inspect", str(tmp_path / "run")]) == EXIT_OK
    assert lines[at] in capsys.readouterr().out
