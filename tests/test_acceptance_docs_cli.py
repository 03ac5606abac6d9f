"""Acceptance tests of the ``lamploop`` command, written from the documentation alone.

Sources: docs/cli.md (every subcommand, its options, "Exit statuses", "Configurations in your
own scripts"), README.md, docs/getting-started.md, docs/observability.md ("Progress without a
sync per step", "Where the time goes", "From the command line"), the public docstrings of
``lamploop.cli``, ``lamploop.demo``, ``lamploop.inspection``, ``lamploop.plotting``,
``lamploop.lr_find``, ``lamploop.loop.profiler``, ``lamploop.loop.step_timing`` and
``lamploop.reporting``, and ``lamploop <command> --help``.

The command runs as a real process (the ``lamploop`` console script beside this Python),
with small settings, in temporary directories. Its cold start costs about a second of CPU, so
every run starts once, in the background, as soon as the module's first test runs
(``cli_runs``): the in-process tests run meanwhile, and the CLI tests wait for the runs they
read. What a run prints is checked against what is on disk, read here directly (the
checkpoint's ``checkpoint.json``, its safetensors files with the ``safetensors`` library, a
sha256 computed here) and against values computed here (parameter counts, the validation
accuracy of the best model, the learning-rate grid of the range test).
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lamploop
from lamploop.errors import ConfigurationError

LAMPLOOP = Path(sys.executable).parent / "lamploop"
RUN_TIMEOUT = 150  # seconds for one command; each takes a few
TEST_TIMEOUT = 240  # a test may wait for the background runs to reach its own

pytestmark = pytest.mark.timeout(TEST_TIMEOUT)


# --------------------------------------------------------------------------------------------
# Running the command


@attrs.frozen
class Run:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONWARNINGS", None)
    return env


def run_cli(cwd: Path, *args: str) -> Run:
    start = time.monotonic()
    done = subprocess.run(
        [str(LAMPLOOP), *args],
        cwd=cwd,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    return Run(tuple(args), done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def run_and_stop(cwd: Path, sig: signal.Signals, after_line: str, *args: str) -> tuple[Run, list[str]]:
    """Start the command, send ``sig`` once it printed a line starting with ``after_line``.

    SIGINT goes to the command's whole process group, as Ctrl-C on a terminal does; SIGTERM to
    the command alone, as a scheduler's does."""
    start = time.monotonic()
    process = subprocess.Popen(
        [str(LAMPLOOP), *args],
        cwd=cwd,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if line.startswith(after_line):
                break
        if process.poll() is None:  # else it ended by itself: the test reads how
            if sig == signal.SIGINT:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        out, err = process.communicate(timeout=RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    run = Run(tuple(args), process.returncode, "".join(seen) + out, err, time.monotonic() - start)
    return run, seen


class Background:
    """The module's command runs, each started once on a small pool of threads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="lamploop-cli")
        self.futures: dict[str, Future[Any]] = {}

    def submit(self, name: str, function: Callable[..., Any], *args: Any) -> None:
        self.futures[name] = self.pool.submit(function, *args)

    def __getitem__(self, name: str) -> Any:
        return self.futures[name].result(timeout=TEST_TIMEOUT)


def _demo(root: Path) -> Run:
    # docs/cli.md's own example: `lamploop demo --epochs 3 --out rd | cat`
    return run_cli(root, "demo", "--epochs", "3", "--out", "rd")


def _interrupted(root: Path) -> dict[str, Any]:
    """A 2-rank demo stopped by SIGINT after its first epoch, then resumed with --epochs 3."""
    stopped, _ = run_and_stop(root, signal.SIGINT, "epoch 0:", "demo", "--out", "sigint", "--epochs", "40")
    shutil.copytree(root / "sigint", root / "sigint-as-stopped")
    resumed = run_cli(root, "demo", "--resume", "sigint", "--epochs", "3")
    return {"stopped": stopped, "resumed": resumed}


def _terminated(root: Path) -> dict[str, Any]:
    """A 1-rank demo stopped by SIGTERM after its second epoch, then asked for fewer epochs."""
    stopped, _ = run_and_stop(
        root, signal.SIGTERM, "epoch 1:", "demo", "--out", "sigterm", "--epochs", "40", "--world-size", "1"
    )
    before = sorted(p.name for p in (root / "sigterm").iterdir())
    nothing = run_cli(root, "demo", "--resume", "sigterm", "--epochs", "1")
    after = sorted(p.name for p in (root / "sigterm").iterdir())
    return {"stopped": stopped, "nothing": nothing, "before": before, "after": after}


def _lr_find_default(root: Path) -> Run:
    (root / "lrf").mkdir()
    return run_cli(root / "lrf", "lr-find", "-o", "lr.png")


def _copy_run(root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(root / "rd", target)
    return target


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def _inspect_damaged(root: Path, demo: Future[Any]) -> Run:
    """Two bad files in a copy of the demo's run directory: a byte of the latest checkpoint's
    ``best_model.safetensors`` flipped (cli.md's example), and in the one before, a model file
    rewritten with another tensor shape whose recorded sha256 and size were updated to match
    (only a full load finds that)."""
    from safetensors.torch import load_file, save_file

    demo.result()
    run_dir = _copy_run(root, "damaged")
    _flip_byte(run_dir / "epoch-000003" / "best_model.safetensors")
    checkpoint = run_dir / "epoch-000002"
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["0.weight"] = torch.zeros(3, 3)
    save_file(tensors, checkpoint / "model.safetensors")
    data = (checkpoint / "model.safetensors").read_bytes()
    descriptor = json.loads((checkpoint / "checkpoint.json").read_text())
    descriptor["files"]["model.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (checkpoint / "checkpoint.json").write_text(json.dumps(descriptor))
    return run_cli(root, "inspect", "damaged")


def _after_demo(root: Path, demo: Future[Any], *args: str) -> Run:
    demo.result()
    return run_cli(root, *args)


@pytest.fixture(scope="module", autouse=True)
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every command run of the module, started at once in the background."""
    root = tmp_path_factory.mktemp("cli")
    runs = Background(root)
    # the longest chains first: the pool takes them in this order
    runs.submit("interrupted", _interrupted, root)
    runs.submit("demo", _demo, root)
    demo = runs.futures["demo"]
    runs.submit("terminated", _terminated, root)
    runs.submit("lr-find", _lr_find_default, root)
    small = ("--hidden-sizes", "16,8")
    diverging = ("--optimizer", "sgd", "--min-lr", "1e20", "--max-lr", "1e30", "--num-steps", "10", *small)
    runs.submit("lr-find diverges at once", run_cli, root, "lr-find", *diverging)
    runs.submit("inspect rd", _after_demo, root, demo, "inspect", "rd")
    runs.submit("plot rd", _after_demo, root, demo, "plot", "rd", "-o", "curve.png", "--title", "acceptance")
    runs.submit("inspect damaged", _inspect_damaged, root, demo)
    runs.submit("refuse --resume", _after_demo, root, demo, "demo", "--resume", "rd", "--batch-size", "64")
    refused = ("demo", "--out", "rd", "--batch-size", "64", "--seed", "3")
    runs.submit("refuse --out", _after_demo, root, demo, *refused)
    runs.submit("plot into a missing folder", _after_demo, root, demo, "plot", "rd", "-o", "nodir/curve.png")
    for name, args in BAD_ARGUMENTS.items():
        runs.submit(name, run_cli, root, *args)
    for name, (args, _) in REFUSED_SETTINGS.items():
        runs.submit(name, run_cli, root, *args)
    runs.submit("inspect missing", run_cli, root, "inspect", "no-such-run")
    runs.submit("version", run_cli, root, "--version")
    negative = ("--out", "negative-lr", "--epochs", "1", "--world-size", "1", "--learning-rate", "-1")
    runs.submit("demo negative learning rate", run_cli, root, "demo", *negative)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=False)


BAD_ARGUMENTS = {
    "demo --epochs abc": ("demo", "--out", "never", "--epochs", "abc"),
    "lr-find --optimizer rmsprop": ("lr-find", "--optimizer", "rmsprop"),
}
"""Bad command-line arguments (exit 2), with the option each names."""

BAD_ARGUMENT_NAMES = {
    "demo --epochs abc": "--epochs",
    "lr-find --optimizer rmsprop": "--optimizer",
}

REFUSED_SETTINGS = {
    "demo --epochs 0": (("demo", "--out", "zero-epochs", "--epochs", "0"), "epochs"),
    "lr-find --min-lr above --max-lr": (("lr-find", "--min-lr", "10", "--max-lr", "1"), "min_lr"),
}
"""Settings that parse but are refused (exit 1, one line naming the setting)."""


def assert_one_line_error(run: Run, status: int, *words: str) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == status, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("lamploop: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# --------------------------------------------------------------------------------------------
# Reading what is on disk, independently of lamploop


def descriptor(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "checkpoint.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def safetensors_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each tensor's shape and bytes per element, read with the safetensors library."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            tensor = f.get_tensor(name)
            out[name] = (tuple(tensor.shape), tensor.element_size())
    return out


def png_size(path: Path) -> tuple[int, int]:
    """The width and height of a PNG, after checking its signature and every chunk's CRC."""
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, kinds = 8, []
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 4], "big")
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        crc = int.from_bytes(data[offset + 8 + length : offset + 12 + length], "big")
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        kinds.append(kind)
        offset += 12 + length
    assert kinds[0] == b"IHDR", kinds
    assert kinds[-1] == b"IEND", kinds
    assert b"IDAT" in kinds, kinds
    header_start = 16
    return (
        int.from_bytes(data[header_start : header_start + 4], "big"),
        int.from_bytes(data[header_start + 4 : header_start + 8], "big"),
    )


def mlp(hidden_sizes: tuple[int, ...]) -> torch.nn.Sequential:
    """docs/cli.md's model table: Linear, ReLU, Linear, ReLU, Linear (64 pixels, 10 digits)."""
    sizes = (64, *hidden_sizes, 10)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


# --------------------------------------------------------------------------------------------
# In-process tests first: they run while the commands run in the background.


@attrs.frozen(kw_only=True)
class RunConfig:
    epochs: int = 10
    learning_rate: float = 1e-3
    hidden_sizes: tuple[int, ...] = (128, 64)


def test_save_config_and_load_config_round_trip_with_kind_and_version(tmp_path: Path) -> None:
    """cli.md: "`lamploop.demo.save_config(config, directory)` writes any attrs configuration
    class as `config.json` (with its kind and a version), and `load_config(directory, cls)`
    reads it back strictly"."""
    from lamploop.demo import load_config, save_config

    path = save_config(RunConfig(epochs=20, hidden_sizes=(7, 5)), tmp_path / "made")
    assert path == tmp_path / "made" / "config.json"
    saved = json.loads(path.read_text())
    assert saved["kind"] == "RunConfig"
    assert isinstance(saved["version"], int)
    assert load_config(tmp_path / "made", RunConfig) == RunConfig(epochs=20, hidden_sizes=(7, 5))


def test_load_config_docs_example_rejects_a_string_for_an_int(tmp_path: Path) -> None:
    """cli.md: "a wrong type is a `ConfigurationError` naming the field and the file"."""
    from lamploop.demo import load_config, save_config

    save_config(RunConfig(epochs=20), tmp_path)
    path = tmp_path / "config.json"
    path.write_text(path.read_text().replace('"epochs": 20', '"epochs": "20"'))
    with pytest.raises(ConfigurationError) as raised:
        load_config(tmp_path, RunConfig)
    assert "epochs" in str(raised.value)
    assert "config.json" in str(raised.value)


def _edit_config(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    from lamploop.demo import save_config

    path = save_config(RunConfig(epochs=20), directory)
    saved = json.loads(path.read_text())
    edit(saved["config"])
    path.write_text(json.dumps(saved))


def test_load_config_rejects_an_unknown_key(tmp_path: Path) -> None:
    """cli.md: "an unknown key ... is a `ConfigurationError` naming the field and the file"."""
    from lamploop.demo import load_config

    _edit_config(tmp_path, lambda config: config.update(dropout=0.1))
    with pytest.raises(ConfigurationError, match=r"config\.json.*dropout"):
        load_config(tmp_path, RunConfig)


def test_load_config_rejects_a_missing_key(tmp_path: Path) -> None:
    """cli.md: "an unknown key, a missing one or a wrong type is a `ConfigurationError` naming
    the field and the file"."""
    from lamploop.demo import load_config

    _edit_config(tmp_path, lambda config: config.pop("learning_rate"))
    with pytest.raises(ConfigurationError, match=r"config\.json.*learning_rate"):
        load_config(tmp_path, RunConfig)


def test_load_config_rejects_a_wrong_element_type_and_another_kind(tmp_path: Path) -> None:
    """cli.md: "a wrong type is a `ConfigurationError` naming the field and the file"; the
    file records its kind, so another class's file is refused."""
    from lamploop.demo import DemoConfig, load_config

    _edit_config(tmp_path, lambda config: config.update(hidden_sizes=[128, "64"]))
    with pytest.raises(ConfigurationError, match=r"config\.json.*hidden_sizes"):
        load_config(tmp_path, RunConfig)
    _edit_config(tmp_path, lambda config: None)
    with pytest.raises(ConfigurationError, match=r"config\.json"):
        load_config(tmp_path, DemoConfig)


def test_describe_step_breakdown_formats_the_shares() -> None:
    """observability.md: "The log line and the progress line of each epoch end with the shares
    (`per step 3.21 ms: data wait 4%, forward+backward 80%, ...`)" (the docstring's example)."""
    from lamploop.reporting import StepBreakdown
    from lamploop.reporting.logging_reporter import describe_step_breakdown

    two_steps = StepBreakdown(steps=2, seconds=0.01, data_wait=0.001, forward_backward=0.008)
    assert describe_step_breakdown(two_steps) == (
        "per step 5.00 ms: data wait 10%, forward+backward 80%, communication wait 0%, "
        "optimizer 0%, checkpoint 0%, other 10%"
    )


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def report(self, event: Any) -> None:
        self.events.append(event)


BATCHES_PER_EPOCH = 10
BATCH_DELAY = 0.08


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-epoch fit whose stream sleeps before each batch, with every kind of listener."""
    from lamploop.reporting import LoggingReporter, MetricsFileReporter

    directory = tmp_path_factory.mktemp("slow") / "run"
    torch.manual_seed(0)
    x = torch.randn(BATCHES_PER_EPOCH * 16, 8)
    y = (x.sum(dim=1) > 0).long()

    def factory(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            for i in range(BATCHES_PER_EPOCH):
                await anyio.sleep(BATCH_DELAY)  # a producer that cannot keep up
                yield x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]

        return stream()

    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    first_loss = torch.nn.functional.cross_entropy(module(x[:16]), y[:16]).item()
    recorder = Recorder()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("lamploop")
    handler, level = Keep(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=factory,
            max_epochs=2,
            checkpoint_dir=directory,
            reporters=[recorder, LoggingReporter(), MetricsFileReporter(directory / "metrics.csv")],
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {
        "events": recorder.events,
        "lines": [record.getMessage() for record in records],
        "directory": directory,
        "first_loss": first_loss,
    }


def test_progress_is_sampled_after_each_epochs_first_step_and_every_half_second(
    slow_run: dict[str, Any],
) -> None:
    """observability.md: "Every 0.5 s (and after each epoch's first step) the sampler makes one
    `ProgressSampled` event"; the sample's loss is "the mean training loss per example over the
    steps since the previous sample"."""
    from lamploop.reporting import EpochStarted, ProgressSampled

    events = slow_run["events"]
    samples = [e for e in events if isinstance(e, ProgressSampled)]
    for epoch in (0, 1):
        mine = [s for s in samples if s.epoch == epoch]
        assert mine, f"no sample in epoch {epoch}"
        assert (mine[0].steps_done, mine[0].steps) == (1, 1)
        # 9 more steps of >= 80 ms: at least one more sample, half a second or more after the last
        assert len(mine) >= 2
        for before, after in itertools.pairwise(mine):
            assert after.time - before.time >= 0.45
            assert after.steps_done - before.steps_done == after.steps
        assert all(s.communication_seconds_per_step == 0.0 for s in mine)  # one rank
    assert samples[0].loss == pytest.approx(slow_run["first_loss"], rel=1e-6)
    assert samples[0].examples == 16
    assert samples[0].total_steps == 1
    totals = [s.total_steps for s in samples]
    assert totals == sorted(totals)
    starts = [i for i, e in enumerate(events) if isinstance(e, EpochStarted)]
    assert len(starts) == 2


def test_step_breakdown_reaches_events_log_lines_and_the_metrics_file(slow_run: dict[str, Any]) -> None:
    """observability.md: "the root's training pass splits the wall time of every optimizer step
    into five parts, summed per epoch, and `EpochFinished.step_breakdown` carries them"; "The
    log line ... of each epoch end[s] with the shares"; "`MetricsFileReporter` writes the
    seconds as the columns `step_seconds`, `data_wait_seconds`, ...". A stream that sleeps
    shows as data wait."""
    from lamploop.reporting import EpochFinished
    from lamploop.reporting.logging_reporter import describe_step_breakdown

    finished = [e for e in slow_run["events"] if isinstance(e, EpochFinished)]
    assert len(finished) == 2
    with (slow_run["directory"] / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    for event, row in zip(finished, rows, strict=True):
        breakdown = event.step_breakdown
        assert breakdown is not None
        assert breakdown.steps == event.steps == BATCHES_PER_EPOCH
        parts = [
            breakdown.data_wait,
            breakdown.forward_backward,
            breakdown.communication_wait,
            breakdown.optimizer,
            breakdown.checkpoint,
        ]
        assert all(part >= 0 for part in parts)
        assert sum(parts) <= breakdown.seconds + 1e-9
        assert breakdown.communication_wait == 0.0  # "0 on one rank"
        assert breakdown.data_wait >= BATCHES_PER_EPOCH * BATCH_DELAY * 0.95
        assert breakdown.data_wait / breakdown.seconds > 0.5
        described = describe_step_breakdown(breakdown)
        (line,) = [
            m for m in slow_run["lines"] if m.startswith(f"epoch {event.state.learning_curve[-1].epoch}:")
        ]
        assert line.endswith(described + ")"), (line, described)
        for column, value in [
            ("step_seconds", breakdown.seconds),
            ("data_wait_seconds", breakdown.data_wait),
            ("forward_backward_seconds", breakdown.forward_backward),
            ("communication_wait_seconds", breakdown.communication_wait),
            ("optimizer_seconds", breakdown.optimizer),
            ("checkpoint_seconds", breakdown.checkpoint),
        ]:
            assert float(row[column]) == pytest.approx(value, rel=1e-9, abs=1e-12), column


@pytest.mark.timeout(60)
def test_inspect_shows_the_step_breakdown_of_a_metrics_file_in_the_run_directory(
    slow_run: dict[str, Any],
) -> None:
    """observability.md: "`lamploop inspect` shows them per epoch when such a file lies in the
    run directory (write it into `checkpoint_dir`)"; lamploop.inspection: "the mean time per
    step, then each part's share of the steps' time"."""
    directory = slow_run["directory"]
    run = run_cli(directory.parent, "inspect", directory.name)
    assert run.returncode == 0, run.stderr
    with (directory / "metrics.csv").open() as f:
        rows = {int(row["epoch"]): row for row in csv.DictReader(f)}
    table = run.stdout.split("where the training steps' time went", 1)
    assert len(table) == 2, run.stdout
    pattern = re.compile(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)" + r"\s+([\d.]+)%" * 6 + r"\s*$")
    found = {}
    for line in table[1].splitlines()[2:]:  # the title's end, the column names
        match = pattern.match(line)
        if match is None:
            break
        found[int(match[1])] = [float(v) for v in match.groups()[1:]]
    assert sorted(found) == [0, 1], table[1]
    parts = ["data_wait", "forward_backward", "communication_wait", "optimizer", "checkpoint"]
    for epoch, row in rows.items():
        steps, ms_per_step, *shares = found[epoch]
        seconds = float(row["step_seconds"])
        assert steps == int(row["steps"])
        assert ms_per_step == pytest.approx(seconds / steps * 1000, abs=0.0006)
        expected = [float(row[f"{part}_seconds"]) / seconds * 100 for part in parts]
        expected.append(100 - sum(expected))
        assert shares == pytest.approx(expected, abs=0.051 * 2)


def _profiled_fit(out_dir: Path, profile_arguments: dict[str, int]) -> list[list[int]]:
    """Two epochs of 8 steps profiled as asked; the ProfilerStep numbers of each trace file."""
    torch.manual_seed(0)
    x, y = torch.randn(128, 8), torch.randint(0, 2, (128,))
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),  # 8 steps per epoch
        max_epochs=2,
        reporters=[],
        profile=lamploop.Profile(out_dir=out_dir, **profile_arguments),
    )
    traces = sorted(out_dir.iterdir(), key=lambda p: int(p.name.split(".")[1]))
    assert all(re.fullmatch(r"rank0\.\d+\.pt\.trace\.json", p.name) for p in traces), traces
    return [
        sorted(
            int(event["name"].removeprefix("ProfilerStep#"))
            for event in json.loads(trace.read_text())["traceEvents"]
            if event.get("name", "").startswith("ProfilerStep#")
        )
        for trace in traces
    ]


def test_profile_skip_first_and_repeat_windows(tmp_path: Path) -> None:
    """observability.md: "`Profile(...)` skips `skip_first` steps once, then, `repeat` times,
    leaves the profiler off for `wait` steps, on but discarded for `warmup` steps ..., and
    records `active` steps. Steps are counted across epochs. After each window every rank writes
    `<out_dir>/rank<R>.<number>.pt.trace.json`"."""
    windows = _profiled_fit(
        tmp_path / "traces", {"skip_first": 3, "wait": 2, "warmup": 1, "active": 2, "repeat": 2}
    )
    # steps 0-2 skipped; window 1: wait 3-4, warm-up 5, active 6-7; window 2: 8-9, 10, 11-12
    assert windows == [[6, 7], [11, 12]]


def test_profile_window_cut_by_the_end_of_the_run(tmp_path: Path) -> None:
    """observability.md: "a run that ends inside a window writes what the window recorded, and
    its last span then runs from the last step to the run's end (after 16 steps,
    `ProfilerStep#16` holds the epoch's end, not a step)"."""
    windows = _profiled_fit(tmp_path / "traces", {"skip_first": 10, "wait": 1, "warmup": 1, "active": 20})
    assert windows == [[12, 13, 14, 15, 16]]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        pytest.param({"active": 0}, "Profile: active must be an int >= 1, got 0", id="active-0"),
        pytest.param({"wait": -1}, "wait", id="wait-negative"),
        pytest.param({"warmup": 1.5}, "warmup", id="warmup-float"),
        pytest.param({"repeat": -1}, "repeat", id="repeat-negative"),
        pytest.param({"skip_first": "2"}, "skip_first", id="skip_first-str"),
        pytest.param({"record_shapes": 1}, "record_shapes", id="record_shapes-int"),
    ],
)
def test_profile_bad_value_is_a_configuration_error_naming_it(
    tmp_path: Path, arguments: dict[str, Any], expected: str
) -> None:
    """observability.md: "A bad value is a `ConfigurationError` that names it (`Profile: active
    must be an int >= 1, got 0`)"."""
    with pytest.raises(ConfigurationError) as raised:
        lamploop.Profile(out_dir=tmp_path / "traces", **arguments)
    assert expected in str(raised.value)
    (file := tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigurationError, match="out_dir"):
        lamploop.Profile(out_dir=file)


def test_local_data_parallel_refuses_profile(tmp_path: Path) -> None:
    """observability.md: "`local_data_parallel_training_loop`, whose replicas are threads of one
    process, refuses `profile` with a `ConfigurationError`"."""
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))

    async def train() -> Any:
        return await lamploop.local_data_parallel_training_loop(
            [
                (
                    lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
                    lamploop.tensor_batches(x, y, batch_size=8),
                    None,
                )
            ],
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            max_epochs=1,
            settings=lamploop.TrainingSettings(profile=lamploop.Profile(out_dir=tmp_path / "traces")),
        )

    with pytest.raises(ConfigurationError, match="profile"):
        anyio.run(train)
    assert not (tmp_path / "traces").exists()


# --------------------------------------------------------------------------------------------
# lamploop --version, and bad command lines


def test_version_prints_the_package_version(cli_runs: Background) -> None:
    """cli.md: "lamploop --version"."""
    run = cli_runs["version"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"lamploop {lamploop.__version__}"


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS), ids=lambda name: name.replace(" ", "_"))
def test_bad_command_line_arguments_exit_2(cli_runs: Background, name: str) -> None:
    """cli.md, "Exit statuses": "2 | bad command-line arguments"."""
    run = cli_runs[name]
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "error:" in last, last
    assert BAD_ARGUMENT_NAMES[name] in last, last
    assert run.stdout == ""


@pytest.mark.parametrize("name", list(REFUSED_SETTINGS), ids=lambda name: name.replace(" ", "_"))
def test_refused_settings_exit_1_with_one_line(cli_runs: Background, name: str) -> None:
    """cli.md, "Exit statuses": "1 | ... a setting is refused ...; one line on stderr says why"."""
    _, word = REFUSED_SETTINGS[name]
    assert_one_line_error(cli_runs[name], 1, word)


def test_demo_negative_learning_rate_is_refused_in_one_line(cli_runs: Background) -> None:
    """cli.md, "Exit statuses": "1 | ... a setting is refused ...; one line on stderr says why"."""
    assert_one_line_error(cli_runs["demo negative learning rate"], 1, "learning")


# --------------------------------------------------------------------------------------------
# lamploop demo


EPOCH_LINE = re.compile(
    r"^epoch (\d+): train loss (\d+\.\d{4}), validation loss (\d+\.\d{4}) "
    r"\(([\d.]+) s, (\d+) examples/s; per step ([\d.]+) ms: data wait (\d+)%, forward\+backward (\d+)%, "
    r"communication wait (\d+)%, optimizer (\d+)%, checkpoint (\d+)%, other (\d+)%\)$"
)


def test_demo_in_a_pipe_prints_the_documented_lines_and_nothing_else(cli_runs: Background) -> None:
    """cli.md: "In a pipe it prints the same lines with the breakdown of each epoch's time per
    step, and nothing else" (the example of `lamploop demo --epochs 3 --out rd | cat`)."""
    run = cli_runs["demo"]
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    lines = run.stdout.splitlines()
    module = mlp((128, 64))
    count = sum(p.numel() for p in module.parameters())
    assert count == 17_226
    assert lines[0] == "training on 2 rank(s) from epoch 0 to 3"
    assert lines[1] == (
        f"model: Sequential, {count:,} parameters ({count:,} trainable, 0 non-trainable), "
        f"{count * 4 / 1e6:.3f} MB"
    )
    assert lines[2].split() == ["name", "type", "parameters", "trainable"]
    for i, (line, layer) in enumerate(zip(lines[3:8], module, strict=True)):
        n = sum(p.numel() for p in layer.parameters())
        assert line.split() == [str(i), type(layer).__name__, f"{n:,}", "yes" if n else "-"]
    epochs = [EPOCH_LINE.match(line) for line in lines[8:11]]
    assert all(epochs), lines[8:11]
    assert [int(m[1]) for m in epochs if m] == [0, 1, 2]
    for match in epochs:
        assert match is not None
        shares = [int(v) for v in match.groups()[6:]]
        assert 97 <= sum(shares) <= 103, shares  # six shares, each rounded
    assert re.fullmatch(r"finished after epoch 2 \([\d.]+ s\)", lines[11]), lines[11]
    assert re.fullmatch(
        r"best epoch \d+ \(validation loss \d+\.\d{4}\); validation accuracy \d\.\d{4}; checkpoints in rd/",
        lines[12],
    ), lines[12]
    assert len(lines) == 13, lines[13:]
    assert "smoothed" not in run.stdout  # the default smoothing factor 1.0 changes nothing


def test_demo_losses_and_best_epoch_match_the_checkpoint(cli_runs: Background) -> None:
    """cli.md: the epoch lines and "best epoch 2 (validation loss 0.8836)"; "with the default
    `validation_loss_exponential_smoothing_factor=1.0` the best model is selected by the raw
    validation loss itself"."""
    run = cli_runs["demo"]
    rd = cli_runs.root / "rd"
    assert (rd / "latest").read_text().strip() == "epoch-000003"
    state = descriptor(rd / "epoch-000003")["loop_state"]
    curve = state["learning_curve"]
    assert [entry["epoch"] for entry in curve] == [0, 1, 2]
    for match, entry in zip(
        [EPOCH_LINE.match(line) for line in run.stdout.splitlines()[8:11]], curve, strict=True
    ):
        assert match is not None
        assert match[2] == f"{entry['training_loss']:.4f}"
        assert match[3] == f"{entry['validation_loss'][1]:.4f}"
    raw = [entry["validation_loss"][1] for entry in curve]
    best = raw.index(min(raw))
    assert state["min_validation_epoch"] == best
    assert f"best epoch {best} (validation loss {min(raw):.4f});" in run.stdout


def test_demo_validation_accuracy_is_the_best_models(cli_runs: Background) -> None:
    """README: "the final validation accuracy"; cli.md: "best epoch 2 (validation loss 0.8836);
    validation accuracy 0.8417". Recomputed here from `best_model.safetensors` on the 20 %
    split of scikit-learn's digits (`lamploop.demo.digits_data`: "80/20 split of the 1797
    digits, pixels scaled to [0, 1]")."""
    from safetensors.torch import load_file
    from sklearn.datasets import load_digits

    from lamploop.demo import digits_data

    x_train, y_train, x_valid, y_valid = digits_data(seed=0)
    assert len(x_train) + len(x_valid) == 1797
    assert abs(len(x_valid) - 0.2 * 1797) <= 1
    digits = load_digits()
    split = sorted(map(tuple, torch.cat([x_train, x_valid]).double().tolist()))
    assert split == sorted(map(tuple, (digits.data / 16).tolist()))  # a partition of the digits
    assert sorted(torch.cat([y_train, y_valid]).tolist()) == sorted(digits.target.tolist())
    module = mlp((128, 64))
    module.load_state_dict(load_file(cli_runs.root / "rd" / "epoch-000003" / "best_model.safetensors"))
    with torch.no_grad():
        output = module(x_valid)
    accuracy = (output.argmax(dim=1) == y_valid).double().mean().item()
    loss = torch.nn.functional.cross_entropy(output, y_valid).item()
    run = cli_runs["demo"]
    match = re.search(r"validation loss (\d+\.\d+)\); validation accuracy (\d\.\d{4});", run.stdout)
    assert match is not None
    assert match[2] == f"{accuracy:.4f}"
    assert float(match[1]) == pytest.approx(loss, abs=1e-4)


def test_demo_saves_its_settings_as_config_json(cli_runs: Background) -> None:
    """cli.md: "Its settings are saved beside the checkpoints as `config.json` (a
    `lamploop.demo.DemoConfig`)"; `--help`: defaults batch size 32, world size 2, seed 0,
    learning rate 0.001, hidden sizes 128,64."""
    from lamploop.demo import DemoConfig, load_config

    cli_runs["demo"]
    cli_runs["refuse --resume"]  # a refused run leaves the settings as they were
    cli_runs["refuse --out"]
    rd = cli_runs.root / "rd"
    assert load_config(rd, DemoConfig) == DemoConfig(
        epochs=3, batch_size=32, world_size=2, seed=0, learning_rate=0.001, hidden_sizes=(128, 64)
    )
    assert sorted(p.name for p in rd.iterdir()) == [
        "config.json",
        "epoch-000001",
        "epoch-000002",
        "epoch-000003",
        "latest",
    ]


def test_demo_refuses_a_flag_that_disagrees_with_the_saved_settings(cli_runs: Background) -> None:
    """cli.md: "A flag that disagrees with them is refused, naming the field:
    `lamploop: ConfigurationError: batch_size: the checkpoint in rd was trained with 32, the
    command line says 64`"."""
    line = assert_one_line_error(cli_runs["refuse --resume"], 1)
    assert line == (
        "lamploop: ConfigurationError: batch_size: the checkpoint in rd was trained with 32, "
        "the command line says 64"
    )
    assert cli_runs["refuse --resume"].stdout == ""


def test_demo_run_again_in_the_same_directory_refuses_disagreeing_flags_too(cli_runs: Background) -> None:
    """cli.md: "Run it again in the same directory, or `lamploop demo --resume DIR` ..., and it
    resumes ... with those settings. A flag that disagrees with them is refused, naming the
    field"; lamploop.demo.resolve_config: "the message names every field"."""
    line = assert_one_line_error(cli_runs["refuse --out"], 1, "ConfigurationError")
    assert "batch_size: the checkpoint in rd was trained with 32, the command line says 64" in line
    assert "seed: the checkpoint in rd was trained with 0, the command line says 3" in line


STOP_LINE = re.compile(
    r"^lamploop: stopped by (SIGINT|SIGTERM) at epoch (\d+) after step (\d+); a checkpoint was written there$"
)


def test_sigint_stops_every_rank_with_status_130_and_a_checkpoint_at_the_step(cli_runs: Background) -> None:
    """cli.md: "Ctrl-C (SIGINT) ... stops every rank after the step in progress, writes a
    checkpoint there and says one line: `lamploop: stopped by SIGINT at epoch 2 after step 17; a
    checkpoint was written there`"; "130 | stopped by SIGINT (Ctrl-C)"."""
    stopped = cli_runs["interrupted"]["stopped"]
    assert stopped.returncode == 130, (stopped.returncode, stopped.stderr)
    lines = stopped.stderr.strip().splitlines()
    assert len(lines) == 1, stopped.stderr
    match = STOP_LINE.match(lines[0])
    assert match is not None, lines[0]
    assert match[1] == "SIGINT"
    epoch, step = int(match[2]), int(match[3])
    # the signal came after epoch 0's line: in epoch 1, or 2 on a slow machine, long before 40
    assert epoch in (1, 2)
    as_stopped = cli_runs.root / "sigint-as-stopped"
    name = (as_stopped / "latest").read_text().strip()
    assert name == (f"epoch-{epoch:06d}-step-{step:06d}" if step else f"epoch-{epoch:06d}")
    assert (as_stopped / name / "checkpoint.json").is_file()
    report = lamploop.checkpoint.verify_checkpoint(as_stopped)
    assert report.ok, report.problems
    assert report.path.name == name


def test_a_run_stopped_by_sigint_resumes_at_that_step_and_equals_an_uninterrupted_run(
    cli_runs: Background,
) -> None:
    """cli.md: "the next run resumes at that step"; "`--epochs` may change: ... lower it to end a
    run sooner than planned"; README: "a resumed run is bitwise equal to an uninterrupted one on
    CPU" (compared here with `lamploop demo --epochs 3`, the same settings never stopped)."""
    from safetensors.torch import load_file

    stop = STOP_LINE.match(cli_runs["interrupted"]["stopped"].stderr.strip())
    assert stop is not None
    epoch = int(stop[2])
    resumed = cli_runs["interrupted"]["resumed"]
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == f"training on 2 rank(s) from epoch {epoch} to 3"
    trained = [line.split(":")[0] for line in resumed.stdout.splitlines() if EPOCH_LINE.match(line)]
    assert trained == [f"epoch {e}" for e in range(epoch, 3)]
    cli_runs["demo"]
    resumed_at = cli_runs.root / "sigint" / "epoch-000003"
    uninterrupted = cli_runs.root / "rd" / "epoch-000003"
    assert descriptor(resumed_at)["loop_state"] == descriptor(uninterrupted)["loop_state"]
    for name in ("model.safetensors", "best_model.safetensors", "optimizer.safetensors"):
        a, b = load_file(resumed_at / name), load_file(uninterrupted / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a), name


def test_sigterm_exits_143_and_a_lowered_epochs_trains_nothing(cli_runs: Background) -> None:
    """cli.md: "143 | stopped by SIGTERM, likewise"; "a run already past it says so and trains
    nothing: `nothing to train: the run is at epoch 4 and max_epochs is 2 (raise max_epochs,
    ...)`"."""
    result = cli_runs["terminated"]
    stopped = result["stopped"]
    assert stopped.returncode == 143, (stopped.returncode, stopped.stderr)
    match = STOP_LINE.match(stopped.stderr.strip())
    assert match is not None, stopped.stderr
    assert match[1] == "SIGTERM"
    epoch = int(match[2])
    nothing = result["nothing"]
    assert nothing.returncode == 0, nothing.stderr
    assert "Traceback" not in nothing.stderr
    assert (
        f"nothing to train: the run is at epoch {epoch} and max_epochs is 1 (raise max_epochs"
        in nothing.stdout
    )
    assert not EPOCH_LINE.search(nothing.stdout)
    assert result["after"] == result["before"]


# --------------------------------------------------------------------------------------------
# lamploop inspect


def _section(text: str, title: str) -> list[str]:
    """The lines after the line starting with ``title``, up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    out = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        out.append(line)
    return out


def test_inspect_header_matches_checkpoint_json(cli_runs: Background) -> None:
    """cli.md: "prints its loop state" (`checkpoint`, `run ... (3 checkpoints)`, `written by
    lamploop 0.2.0 (format 2), <UTC time>`, `resumes at the start of epoch 4`, `epochs done`,
    `last valid`, `best epoch`)."""
    run = cli_runs["inspect rd"]
    assert run.returncode == 0, run.stderr
    checkpoint = cli_runs.root / "rd" / "epoch-000003"
    d = descriptor(checkpoint)
    state = d["loop_state"]
    saved = datetime.datetime.fromtimestamp(d["saved_at_unix_ns"] // 10**9, tz=datetime.timezone.utc)
    header = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in _section("\n" + run.stdout, ""))
    assert header == {
        "checkpoint": "rd/epoch-000003",
        "run": "rd (3 checkpoints)",
        "written by": f"lamploop {d['lamploop_version']} (format {d['format_version']}), "
        + saved.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "resumes at": "the start of epoch 3",
        "epochs done": "3",
        "last valid": f"{state['last_validation_loss']:.6g}",
        "best epoch": f"{state['min_validation_epoch']} (validation loss {state['min_validation_loss']:.6g})",
    }
    assert d["lamploop_version"] == lamploop.__version__


def test_inspect_model_table_matches_the_safetensors_file(cli_runs: Background) -> None:
    """cli.md: "its model's tensors per top-level module (... parameters and buffers alike ...)":
    `model 17,226 values in 6 tensors (parameters and buffers), 0.069 MB` and a row per module.
    Compared with `model.safetensors` read with the safetensors library."""
    run = cli_runs["inspect rd"]
    shapes = safetensors_shapes(cli_runs.root / "rd" / "epoch-000003" / "model.safetensors")
    per_module: dict[str, list[int]] = {}
    for name, (shape, size) in shapes.items():
        values = math.prod(shape)
        entry = per_module.setdefault(name.split(".")[0], [0, 0, 0])
        entry[0] += 1
        entry[1] += values
        entry[2] += values * size
    values = sum(e[1] for e in per_module.values())
    total_bytes = sum(e[2] for e in per_module.values())
    assert values == 17_226
    line = next(line for line in run.stdout.splitlines() if line.startswith("model "))
    assert line.split(None, 1)[1] == (
        f"{values:,} values in {len(shapes)} tensors (parameters and buffers), {total_bytes / 1e6:.3f} MB"
    )
    rows = _section(run.stdout, "model ")
    assert rows[0].split() == ["module", "tensors", "values", "MB"]
    expected = [
        [module, str(n), f"{v:,}", f"{b / 1e6:.3f}"] for module, (n, v, b) in sorted(per_module.items())
    ]
    expected.append(["total", str(len(shapes)), f"{values:,}", f"{total_bytes / 1e6:.3f}"])
    assert [row.split() for row in rows[1:]] == expected


def test_inspect_learning_curve_marks_the_best_epoch(cli_runs: Background) -> None:
    """cli.md: "learning curve (the best epoch marked `*`)"."""
    run = cli_runs["inspect rd"]
    state = descriptor(cli_runs.root / "rd" / "epoch-000003")["loop_state"]
    rows = _section(run.stdout, "learning curve (* marks the best epoch):")
    assert rows[0].split() == ["epoch", "train", "loss", "valid", "loss", "lr", "factor"]
    expected = [
        [
            f"{e['epoch']}{'*' if e['epoch'] == state['min_validation_epoch'] else ''}",
            f"{e['training_loss']:.6g}",
            f"{e['validation_loss'][1]:.6g}",
            f"{e['learning_rate_factor']:g}",
        ]
        for e in state["learning_curve"]
    ]
    assert [row.split() for row in rows[1:]] == expected


def test_inspect_files_sizes_and_sha256_match_the_disk(cli_runs: Background) -> None:
    """cli.md: "Checks every file of a checkpoint, or of every checkpoint of a run directory
    (sizes and sha256 against `checkpoint.json` ...)" and lists them (`model.safetensors
    69,360 bytes ok (sha256)`), then the run's checkpoints, then `ok: every file is intact`."""
    run = cli_runs["inspect rd"]
    rd = cli_runs.root / "rd"
    checkpoint = rd / "epoch-000003"
    recorded = descriptor(checkpoint)["files"]
    rows = _section(run.stdout, "files of epoch-000003:")
    listed = {}
    for row in rows:
        match = re.fullmatch(r"\s+(\S+)\s+([\d,]+) bytes\s+(.+)", row)
        assert match is not None, row
        listed[match[1]] = (int(match[2].replace(",", "")), match[3])
    assert set(listed) == {p.name for p in checkpoint.iterdir()}
    assert listed["checkpoint.json"] == ((checkpoint / "checkpoint.json").stat().st_size, "ok")
    for name, (size, verdict) in listed.items():
        assert size == (checkpoint / name).stat().st_size
        if name != "checkpoint.json":
            assert recorded[name] == {"sha256": sha256(checkpoint / name), "size": size}
            assert verdict == "ok (sha256)"
    checkpoints = _section(run.stdout, "checkpoints in rd:")
    assert [row.split(None, 1) for row in checkpoints] == [
        ["epoch-000001", "ok"],
        ["epoch-000002", "ok"],
        ["epoch-000003", "ok (latest, reported)"],
    ]
    assert run.stdout.rstrip().splitlines()[-1] == "ok: every file is intact"
    assert run.stderr == ""


def test_inspect_text_is_format_report_of_verify_checkpoint(
    cli_runs: Background, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cli.md: "In Python: `lamploop.checkpoint.verify_checkpoint(path)` gives the report as data
    (`lamploop.inspection.inspect_checkpoint` is the same function), and
    `lamploop.inspection.format_report` the text."""
    import lamploop.checkpoint
    import lamploop.inspection

    run = cli_runs["inspect rd"]
    monkeypatch.chdir(cli_runs.root)
    report = lamploop.checkpoint.verify_checkpoint("rd")
    assert report.ok
    assert report.problems == ()
    assert lamploop.inspection.inspect_checkpoint("rd") == report
    assert lamploop.inspection.format_report(report).rstrip("\n") == run.stdout.rstrip("\n")


def test_inspect_names_each_bad_file_exits_1_and_reports_the_checkpoint_fit_would_load(
    cli_runs: Background,
) -> None:
    """cli.md: "A bad file is named, on stdout in the report and on stderr, one line per problem,
    and the exit status is 1 (after a byte of `best_model.safetensors` was flipped): `lamploop:
    rd/epoch-000004/best_model.safetensors: sha256 mismatch: checkpoint.json records 5db114b6…,
    the file has 880b09be… (...)`. The report then covers the checkpoint `fit` would resume from
    instead"; "(sizes and sha256 against `checkpoint.json`, then a full load of the one `fit`
    would resume from)": here the one before the latest has a model file of the recorded sha256
    and size but another tensor shape, so `fit` would resume from the first."""
    run = cli_runs["inspect damaged"]
    assert "Traceback" not in run.stderr
    assert run.returncode == 1, run.stderr
    lines = sorted(run.stderr.strip().splitlines())
    assert len(lines) == 2, run.stderr
    reshaped, flipped = lines
    bad = cli_runs.root / "damaged" / "epoch-000003" / "best_model.safetensors"
    recorded = descriptor(bad.parent)["files"]["best_model.safetensors"]["sha256"]
    match = re.fullmatch(
        r"lamploop: damaged/epoch-000003/best_model\.safetensors: sha256 mismatch: checkpoint\.json "
        r"records ([0-9a-f]{8})[0-9a-f…]*, the file has ([0-9a-f]{8})[0-9a-f…]* \(.*\)",
        flipped,
    )
    assert match is not None, flipped
    assert (match[1], match[2]) == (recorded[:8], sha256(bad)[:8])
    assert reshaped.startswith("lamploop: damaged/epoch-000002/model.safetensors: "), reshaped
    assert "0.weight" in reshaped
    assert "shape" in reshaped
    for line in lines:
        assert line.removeprefix("lamploop: ") in run.stdout
    assert run.stdout.splitlines()[0].split()[:2] == ["checkpoint", "damaged/epoch-000001"]
    assert "ok: every file is intact" not in run.stdout


@pytest.mark.parametrize(
    "damage",
    ["truncated", "missing"],
)
def test_verify_checkpoint_names_a_truncated_or_missing_file(
    cli_runs: Background, tmp_path: Path, damage: str
) -> None:
    """cli.md: "Checks every file ... (sizes and sha256 against `checkpoint.json` ...)";
    lamploop.inspection: "`report.problems` names each bad file (a size or sha256 mismatch, a
    missing file ...)"; each "starts with the path of the file at fault"."""
    cli_runs["demo"]
    run_dir = tmp_path / "run"
    shutil.copytree(cli_runs.root / "rd", run_dir)
    bad = run_dir / "epoch-000003" / "optimizer.safetensors"
    if damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:100])
    else:
        bad.unlink()
    report = lamploop.checkpoint.verify_checkpoint(run_dir)
    assert not report.ok
    assert len(report.problems) == 1
    assert report.problems[0].startswith(str(bad))
    assert ("size" if damage == "truncated" else "missing") in report.problems[0]
    assert report.path == run_dir / "epoch-000002"


def test_inspect_of_a_missing_checkpoint_exits_1_naming_it(cli_runs: Background) -> None:
    """cli.md, "Exit statuses": "1 | ... a checkpoint is bad or missing (`inspect`) ...; one line
    on stderr says why"."""
    run = cli_runs["inspect missing"]
    assert_one_line_error(run, 1, "no-such-run")
    assert run.stdout == ""


# --------------------------------------------------------------------------------------------
# lamploop plot


def test_plot_writes_a_png_of_the_documented_size_with_the_best_epoch_in_magenta(
    cli_runs: Background,
) -> None:
    """cli.md: "Draws the learning curve with matplotlib: ... the best epoch as a magenta line and
    star"; lamploop.plotting: "the PNG is `figsize[0] * dpi` by `figsize[1] * dpi` pixels (960 x
    600 by default)"."""
    from PIL import Image

    from lamploop.plotting import BEST_EPOCH_COLOR

    run = cli_runs["plot rd"]
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    png = cli_runs.root / "curve.png"
    assert png_size(png) == (960, 600)
    with Image.open(png) as image:
        image.load()
        colors = image.convert("RGB").getcolors(1 << 20)
    assert colors is not None
    assert len(colors) > 20  # a drawing, not a blank canvas
    magenta = tuple(int(BEST_EPOCH_COLOR.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4))
    assert magenta == (255, 0, 255)
    assert sum(n for n, color in colors if color == magenta) > 20


def test_plot_into_a_missing_folder_gives_one_line_not_a_traceback(cli_runs: Background) -> None:
    """cli.md, "Exit statuses": "1 | training failed ...; one line on stderr says why"; lamploop.cli:
    "`plot` could not read the checkpoint or has no matplotlib" is 1."""
    run = cli_runs["plot into a missing folder"]
    if run.returncode == 0:
        assert (cli_runs.root / "nodir" / "curve.png").is_file()
    else:
        assert_one_line_error(run, 1, "nodir")


# --------------------------------------------------------------------------------------------
# lamploop lr-find

LR_HEADER = re.compile(
    r"^learning-rate range test \((adam|sgd), batch size (\d+)\): (\d+) steps from (\S+) to (\S+), "
    r"(the whole range|stopped there: the loss diverged)$"
)
LR_SUGGESTION = re.compile(
    r"^suggested learning rate: (\S+) \(the lowest smoothed loss was at (\S+); a tenth of that\)$"
)


def _grid(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    """lamploop.lr_find: "step `i` of `n` at `min_lr * (max_lr / min_lr) ** (i / (n - 1))`"."""
    return [min_lr * (max_lr / min_lr) ** (i / (num_steps - 1)) for i in range(num_steps)]


def _same_3_digits(printed: str, value: float) -> bool:
    return float(printed) == pytest.approx(float(f"{value:.3g}"), rel=1e-9)


def _check_range_test(stdout: str, optimizer: str, min_lr: float, max_lr: float, num_steps: int) -> float:
    lines = stdout.splitlines()
    header = LR_HEADER.match(lines[0])
    assert header is not None, lines[0]
    assert header[1] == optimizer
    assert header[2] == "32"
    steps = int(header[3])
    assert 2 <= steps <= num_steps
    grid = _grid(min_lr, max_lr, num_steps)[:steps]
    assert _same_3_digits(header[4], grid[0])
    assert _same_3_digits(header[5], grid[-1])
    if header[6] == "the whole range":
        assert steps == num_steps
    suggestion = LR_SUGGESTION.match(lines[1])
    assert suggestion is not None, lines[1]
    lowest = float(suggestion[2])
    assert any(_same_3_digits(suggestion[2], lr) for lr in grid), (lowest, grid)  # a rate it swept
    assert grid[0] * 0.999 <= lowest <= grid[-1] * 1.001
    assert float(suggestion[1]) * 10 == pytest.approx(lowest, rel=1e-9)  # "divided by 10"
    return float(suggestion[1])


def test_lr_find_default_run_follows_the_documented_rule_and_writes_only_the_plot(
    cli_runs: Background,
) -> None:
    """cli.md: "the learning rate grows from `--min-lr` (1e-7) to `--max-lr` (10) over
    `--num-steps` (100) steps, the test stops when the loss diverges, and the suggestion is the
    rate at the lowest smoothed loss divided by 10. With Adam it also says the `lamploop demo`
    flags to train with it. `-o` draws the losses and the suggestion into a PNG"; "Nothing is
    written but the plot"."""
    run = cli_runs["lr-find"]
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    suggestion = _check_range_test(run.stdout, "adam", 1e-7, 10.0, 100)
    lines = run.stdout.splitlines()
    assert lines[2] == f"try: lamploop demo --learning-rate {lines[1].split()[3]}"
    assert float(lines[2].split()[-1]) == suggestion
    assert lines[3:] == ["wrote lr.png"]
    folder = cli_runs.root / "lrf"
    assert [p.name for p in folder.iterdir()] == ["lr.png"]
    width, height = png_size(folder / "lr.png")
    assert 300 <= width <= 4000
    assert 200 <= height <= 4000


def test_lr_find_without_a_suggestion_exits_1(cli_runs: Background) -> None:
    """cli.md, "Exit statuses": "1 | ... or `lr-find` has no suggestion (the loss diverged at its
    first steps); one line on stderr says why"; "with Adam, the demo's optimizer, or plain SGD
    (`--optimizer sgd`)" (SGD from 1e20: the loss is not finite after the first step)."""
    run = cli_runs["lr-find diverges at once"]
    line = assert_one_line_error(run, 1, "suggestion")
    assert "suggested learning rate" not in run.stdout
    assert "try:" not in run.stdout
    header = LR_HEADER.match(run.stdout.splitlines()[0])
    assert header is not None, run.stdout
    assert header[1] == "sgd"
    assert _same_3_digits(header[4], 1e20)
    assert header[6] == "stopped there: the loss diverged", line
