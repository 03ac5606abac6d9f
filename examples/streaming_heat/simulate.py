"""One simulation process: solve the heat equation for random parameters, stream each result.

``python simulate.py HOST PORT NAME COUNT SEED`` (the token in ``LAMPLOOP_STREAM_TOKEN``):
sends ``COUNT`` samples ``{"x": parameters, "y": solution}`` to the trainer's receiver with a
:class:`~lamploop.streaming.producer.BlockingProducer`, which keeps each sample until the
trainer acknowledged it, reconnects and resends if the connection drops, and says Done.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heat import random_parameters, solve

from lamploop.streaming.producer import BlockingProducer


def main(host: str, port: int, name: str, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    token = os.environ["LAMPLOOP_STREAM_TOKEN"]
    with BlockingProducer((host, port), name=name, token=token) as producer:
        for _ in range(count):
            parameters = random_parameters(rng)
            solution = solve(parameters)
            producer.send(
                {
                    "x": torch.from_numpy(parameters).float(),
                    "y": torch.from_numpy(solution).float(),
                }
            )


if __name__ == "__main__":
    host, port, name, count, seed = sys.argv[1:6]
    main(host, int(port), name, int(count), int(seed))
