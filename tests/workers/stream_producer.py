"""A producer of deterministic samples, for tests/streaming/test_stream_resume.py.

    python tests/workers/stream_producer.py PORT NAME COUNT [PACE_S]

Sends COUNT samples (seq 0..COUNT-1, the same ones on every start) to 127.0.0.1:PORT,
keeping every acknowledged one for a trainer restored from an older checkpoint, then
Done, one sample every PACE_S seconds (default 0.005).  The token is LAMPLOOP_STREAM_TOKEN.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from lamploop.streaming.producer import BlockingProducer


def sample(name: str, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 7919 + len(name))
    x = torch.randn(3, generator=generator)
    return {"x": x, "y": x.sum(dim=0, keepdim=True)}


def main() -> None:
    port, name, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    pace = float(sys.argv[4]) if len(sys.argv) > 4 else 0.005
    with BlockingProducer(
        ("127.0.0.1", port),
        name=name,
        token=os.environ["LAMPLOOP_STREAM_TOKEN"],
        resend_window=4,
        keep_acknowledged=count,
        reconnect_timeout=60.0,
    ) as producer:
        for seq in range(count):
            producer.send(sample(name, seq))
            time.sleep(pace)
        producer.done()
    print(f"{name}: sent {count}", flush=True)


if __name__ == "__main__":
    main()
