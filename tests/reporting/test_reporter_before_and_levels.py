"""Two reporter details a user meets: the level of LoggingReporter's checkpoint lines, and
PrometheusReporter.url before the reporter has started.

- docs/observability.md: ``LoggingReporter`` writes "one line per epoch" at its ``level``;
  a line per checkpoint goes one level below it (``DEBUG`` under the default ``INFO``, so the
  default still shows one line per epoch), not at ``DEBUG`` whatever ``level`` says.
- ``PrometheusReporter`` binds its port at the run's first event (or ``start()``); before
  that its ``url`` raises a ConfigurationError saying so (it showed a ``None`` port).
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import lamploop
from lamploop.errors import ConfigurationError
from lamploop.reporting import LoggingReporter, PrometheusReporter, RunStarted


class Records(logging.Handler):
    """Every record of the logger it is added to, at any level."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def levels_of(self, prefix: str) -> set[int]:
        return {r.levelno for r in self.records if r.getMessage().startswith(prefix)}


@pytest.fixture
def records() -> Iterator[tuple[logging.Logger, Records]]:
    logger = logging.getLogger("tests.reporting.levels")
    handler = Records()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, handler
    finally:
        logger.removeHandler(handler)


def _fit_with(reporter: LoggingReporter, checkpoints: Path) -> None:
    """Two epochs of a real one-rank run that checkpoints after each, reported to ``reporter``."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, generator=generator), torch.randint(0, 2, (32,), generator=generator)
    torch.manual_seed(0)
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=2,
        checkpoint_dir=checkpoints,
        device="cpu",
        reporters=[reporter],
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("level", "checkpoint_level"),
    [
        (logging.INFO, logging.DEBUG),  # the default: one line per epoch at INFO
        (logging.WARNING, logging.INFO),
        (logging.ERROR, logging.WARNING),
        (logging.DEBUG, logging.DEBUG),  # never below DEBUG, where a logger would drop them
        (25, 15),
    ],
)
def test_checkpoint_lines_go_one_level_below_the_reporters_level(
    records: tuple[logging.Logger, Records], tmp_path: Path, level: int, checkpoint_level: int
) -> None:
    logger, handler = records
    _fit_with(LoggingReporter(logger, level=level), tmp_path / "checkpoints")
    assert handler.levels_of("epoch ") == {level}
    assert handler.levels_of("training on ") == {level}
    checkpoint_lines = [r for r in handler.records if r.getMessage().startswith("checkpoint of epoch")]
    # One after each epoch, at the position the next run resumes from (the next epoch's start).
    assert [r.getMessage() for r in checkpoint_lines] == [
        f"checkpoint of epoch {epoch} step 0 in {tmp_path / 'checkpoints' / f'epoch-{epoch:06d}'}"
        for epoch in (1, 2)
    ]
    assert {r.levelno for r in checkpoint_lines} == {checkpoint_level}


def test_prometheus_url_before_start_says_the_reporter_has_not_started() -> None:
    reporter = PrometheusReporter(port=0)
    try:
        assert reporter.port is None
        with pytest.raises(
            ConfigurationError, match=r"PrometheusReporter\.url: the reporter has not started yet"
        ):
            _ = reporter.url
        assert "not started" in repr(reporter)
        assert "None" not in repr(reporter)
        reporter.report(RunStarted(nranks=1, epoch=0, max_epochs=1))  # the first event starts it
        assert reporter.port is not None
        url = reporter.url
        assert url == f"http://127.0.0.1:{reporter.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert b"lamploop_steps_total" in response.read()
    finally:
        reporter.close()
    assert reporter.url == url  # where it served, also once closed (docs/observability.md uses it)


def test_prometheus_url_before_start_names_a_fixed_port_too() -> None:
    reporter = PrometheusReporter(port=9, host="::1")
    with pytest.raises(
        ConfigurationError, match=r"port 9 on ::1 is bound at the run's first event, or by start\(\)"
    ):
        _ = reporter.url
