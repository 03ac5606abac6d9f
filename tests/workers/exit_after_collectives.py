"""Run collectives through lamploop's ``Collectives`` on a one-rank Gloo group, then exit at once.

    python exit_after_collectives.py

The group and its ``Collectives`` stay alive into the interpreter's finalization (module
globals), as they do in a program that keeps them or in a reference cycle.  A Gloo thread
that drops the last reference to a finished work then frees the Python objects of its
tensors while the interpreter finalizes, and the process aborts (status -6, "terminate
called without an active exception"): tests/sync/test_exit_after_collectives.py runs this
many times and expects status 0 every time.
"""

from __future__ import annotations

import torch

from lamploop.distributed.process_group import create_store, new_process_group
from lamploop.sync.collectives import Collectives

STORE, _ = create_store("127.0.0.1", 1, 30.0)
GROUP = new_process_group(STORE, rank=0, nranks=1, device=torch.device("cpu"), timeout=30.0, prefix="exit")
COLLECTIVES = Collectives(GROUP, rank=0, nranks=1, device=torch.device("cpu"), timeout=30.0)


def train(buckets: list[torch.Tensor], steps: int) -> None:
    """A step's collectives, each work dropped once waited for (as a training step does)."""
    for _ in range(steps):
        for bucket in buckets:
            COLLECTIVES.wait(COLLECTIVES.all_reduce([bucket]), "sum")


if __name__ == "__main__":
    # Tensors that live on, as gradient buckets do: a work that a Gloo thread frees last drops
    # its hold on their Python objects there.
    BUCKETS = [torch.ones(4) for _ in range(4)]
    train(BUCKETS, 500)
