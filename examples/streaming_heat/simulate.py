"""One simulation process: solve the heat equation for random parameters, stream each result.

``python simulate.py HOST PORT NAME COUNT SEED`` (the token in ``LAMPLOOP_STREAM_TOKEN``):
sends ``COUNT`` samples ``{"x": parameters, "y": solution}`` to the trainer's receiver with a
:class:`~lamploop.streaming.producer.BlockingProducer`, which keeps each sample until the
trainer acknowledged it, reconnects and resends if the connection drops, and says Done.

``python simulate.py --out-dir DIR NAME COUNT SEED``: the offline baseline (``train.py
--offline``, ``benchmarks/bench_streaming.py``): the same samples, each written to a
safetensors file of its own, ``DIR/NAME-SEQ.safetensors``, for a DataLoader to read later.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

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


def write(folder: Path, name: str, count: int, seed: int) -> None:
    """The same samples as :func:`main`, each written to a file (renamed into place once whole)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for seq in range(count):
        parameters = random_parameters(rng)
        solution = solve(parameters)
        path = folder / f"{name}-{seq:06d}.safetensors"
        partial = path.with_suffix(".partial")
        x, y = torch.from_numpy(parameters).float(), torch.from_numpy(solution).float()
        save_file({"x": x, "y": y}, str(partial))
        partial.replace(path)


if __name__ == "__main__":
    if sys.argv[1] == "--out-dir":
        folder, name, count, seed = sys.argv[2:6]
        write(Path(folder), name, int(count), int(seed))
    else:
        host, port, name, count, seed = sys.argv[1:6]
        main(host, int(port), name, int(count), int(seed))
