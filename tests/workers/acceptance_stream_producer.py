"""A producer process for tests/streaming/test_acceptance_own_thread.py.

    python tests/workers/acceptance_stream_producer.py PORT NAME BASE COUNT

Sends COUNT samples to the receiver at 127.0.0.1:PORT through a ``BlockingProducer`` (the
simulation-side producer of docs/streaming.md "Which producer"), then Done.  Sample ``seq``
carries its id ``BASE + seq`` as ``x[0]`` (exact in float32 below 2**24), so that the test
can count every id it trains on.  The token is ACCEPTANCE_STREAM_TOKEN.
"""

from __future__ import annotations

import os
import sys

import torch

from lamploop.streaming.producer import BlockingProducer


def sample(ident: int) -> dict[str, torch.Tensor]:
    """Sample ``ident``: ``x = [ident, noise x3]`` (float32), ``y`` a class (int64 scalar)."""
    generator = torch.Generator().manual_seed(ident)
    x = torch.cat([torch.tensor([float(ident)]), torch.randn(3, generator=generator)])
    return {"x": x, "y": (x[1:].sum() > 0).long()}


def main() -> None:
    port, name, base, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with BlockingProducer(
        ("127.0.0.1", port),
        name=name,
        token=os.environ["ACCEPTANCE_STREAM_TOKEN"],
        reconnect_timeout=20.0,
    ) as producer:
        for seq in range(count):
            producer.send(sample(base + seq))
        producer.done()
    print(f"{name}: sent {count}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
