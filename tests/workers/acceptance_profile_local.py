"""`local_data_parallel_training_loop` with `TrainingSettings(profile=...)`: two CPU replicas in one process.

Usage: ``python acceptance_profile_local.py OUT_DIR ACTIVE``; prints one JSON line, for each trace
file written, its name and its ``ProfilerStep#N`` spans (docs/observability.md: one trace per rank).
Run as a separate process because a failure here may be a crash of torch's profiler.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import torch

import lamploop
from lamploop.distributed import local_data_parallel_training_loop


def main() -> None:
    """Train 2 epochs of 4 steps per replica under a profile window of ``ACTIVE`` recorded steps."""
    out_dir, active = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    batches = lamploop.tensor_batches(x, y, batch_size=8)
    replicas = [(lamploop.SupervisedModel(torch.nn.Linear(4, 2)), batches, None) for _ in range(2)]
    settings = lamploop.TrainingSettings(
        profile=lamploop.Profile(out_dir=out_dir, wait=1, warmup=1, active=active)
    )
    anyio.run(
        lambda: local_data_parallel_training_loop(
            replicas, lambda params: torch.optim.SGD(params, lr=0.1), 2, settings=settings
        )
    )
    spans = {
        trace.name: sorted(
            event["name"]
            for event in json.loads(trace.read_text())["traceEvents"]
            if str(event.get("name", "")).startswith("ProfilerStep#")
        )
        for trace in sorted(out_dir.glob("*.pt.trace.json"))
    }
    print(json.dumps(spans), flush=True)


if __name__ == "__main__":
    main()
