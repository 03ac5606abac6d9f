"""Online training from streaming producers (work in progress: see docs/streaming.md once it lands).

Samples (:class:`~lamploop.streaming.sample.Sample`) arrive from producers, wait in a
buffer, and batches are drawn from the buffer while more arrive.
"""

from lamploop.streaming.sample import Sample, SampleSink

__all__ = ["Sample", "SampleSink"]
