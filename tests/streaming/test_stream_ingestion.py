"""Ingestion metrics: a real receiver and producer, sampled for the reporters while samples flow."""

from __future__ import annotations

import secrets
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import torch

from lamploop.reporting import LoggingReporter, PrometheusReporter, TensorBoardReporter
from lamploop.reporting.events import IngestionSampled
from lamploop.streaming import FiroBuffer
from lamploop.streaming.ingestion import report_ingestion
from lamploop.streaming.producer import AsyncProducer
from lamploop.streaming.receiver import SampleReceiver

SAMPLES = 400


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def report(self, event: Any) -> None:
        self.events.append(event)


def test_ingestion_is_sampled_to_the_reporters_while_samples_flow(tmp_path: Path) -> None:
    recorder = Recorder()
    prometheus = PrometheusReporter(0)
    board = TensorBoardReporter(tmp_path / "tb")
    scraped: list[str] = []

    async def main() -> None:
        token = secrets.token_hex(16)
        buffer = FiroBuffer(capacity=64, watermark=16, seed=0, max_reads=2)
        reporters = [recorder, prometheus, board, LoggingReporter()]
        with anyio.fail_after(60):
            async with (
                SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver,
                anyio.create_task_group() as tg,
            ):
                # It returns after its first sample of the drained buffer.
                tg.start_soon(lambda: report_ingestion(receiver, buffer, reporters, interval=0.05))

                async def produce() -> None:
                    async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                        for i in range(SAMPLES):
                            await producer.send({"x": torch.full((256,), float(i))})
                    await receiver.wait_all_done()
                    buffer.close()

                tg.start_soon(produce)
                async for _ in buffer:  # a slow reader: the buffer fills, puts wait
                    await anyio.sleep(0.0005)
            page = await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(prometheus.url).read())
            scraped.append(page.decode())

    try:
        anyio.run(main)
    finally:
        prometheus.close()
        board.close()
    samples = [e for e in recorder.events if isinstance(e, IngestionSampled)]
    assert len(samples) >= 3
    assert [e.samples for e in samples] == sorted(e.samples for e in samples)
    assert samples[-1].samples == SAMPLES
    assert samples[-1].closed
    assert samples[-1].reads == 2 * SAMPLES  # every sample read max_reads times
    assert all(0 <= e.fill <= e.capacity == 64 for e in samples)
    assert any(e.samples_per_second > 0 and e.bytes_per_second > 1024 * e.samples_per_second for e in samples)
    assert any(e.put_seconds_mean > 0 for e in samples)  # the full buffer made puts wait
    assert any(sum(e.seen_histogram.values()) == e.fill and e.fill > 0 for e in samples)
    assert 'lamploop_ingest_samples{rank="0"} 400.0' in scraped[0]
    assert 'lamploop_buffer_reads{rank="0"} 800.0' in scraped[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    fills = accumulator.Scalars("ingest/buffer_fill")
    assert len(fills) == len(samples)
    assert all(0.0 <= s.value <= 1.0 for s in fills)
    assert accumulator.Scalars("ingest/samples_per_second")[-1].step == SAMPLES
