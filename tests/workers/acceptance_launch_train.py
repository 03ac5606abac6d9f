"""One rank of tests/distributed/test_acceptance_docs_launch.py: ``lamploop.fit`` under a launcher.

Run by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...) or by the test with Slurm's
variables (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``...), as docs/distributed.md's
"Running it" shows: the script only calls ``lamploop.fit(...)``; the launcher's variables decide
the rank.

    python acceptance_launch_train.py --out DIR --checkpoint-dir DIR [--max-epochs N]
        [--kill-rank R --kill-epoch E --kill-after-batches B]

Every rank writes to ``--out``:

- ``pid-<rank>-<restart>`` at start: its pid (the test kills what is left in a finally);
- ``rank<rank>-restart<restart>.json`` when ``fit`` returns or raises: the launcher's variables,
  ``fit``'s return (the loop state's epoch, or ``None``), the epochs and ranks the training
  stream factory was asked for, the checkpoint ``latest`` named before ``fit`` started, and the
  final parameters as ``float.hex`` strings (bitwise comparisons) and floats.

``<restart>`` is ``TORCHELASTIC_RESTART_COUNT`` (0 outside torchrun).  With ``--kill-*`` the rank
``R`` SIGKILLs itself in epoch ``E`` after making ``B`` of its batches, on the first attempt only
(restart count 0), so that torchrun's ``--max-restarts`` restarts the job.

The data, the model and the optimizer are tiny and float64; the batch order is a pure function of
(epoch, rank), as docs/distributed.md and lamploop.batches require.  The test's float64 reference
rebuilds the same batches with :func:`batches_of_epoch`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

N_EXAMPLES = 24
N_FEATURES = 3
BATCH_SIZE = 3
LEARNING_RATE = 0.05
MOMENTUM = 0.9


def _write(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all: a rank killed mid-write (torchrun stops the others)
    leaves no half file for the test to read."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    os.replace(part, path)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set, float64, the same in every process."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(N_EXAMPLES, N_FEATURES, generator=generator, dtype=torch.float64)
    w = torch.tensor([[1.5], [-2.0], [0.5]], dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(N_EXAMPLES, 1, generator=generator, dtype=torch.float64)
    return x, y


def batches_of_epoch(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every batch of one epoch, in order; batch ``i`` belongs to rank ``i % nranks``."""
    x, y = data()
    order = torch.randperm(N_EXAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))
    return [
        (x[order[i : i + BATCH_SIZE]], y[order[i : i + BATCH_SIZE]]) for i in range(0, N_EXAMPLES, BATCH_SIZE)
    ]


def initial_module() -> torch.nn.Module:
    """The model every run starts from (seeded: the same in every process)."""
    torch.manual_seed(7)
    return torch.nn.Linear(N_FEATURES, 1).to(torch.float64)


def parameters(module: torch.nn.Module) -> dict[str, list[float]]:
    return {name: t.detach().flatten().tolist() for name, t in module.state_dict().items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-epoch", type=int, default=None)
    parser.add_argument("--kill-after-batches", type=int, default=1)
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    env_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
    _write(out / f"pid-{env_rank}-{restart}", str(os.getpid()))

    import lamploop

    latest_before = lamploop.latest_checkpoint(args.checkpoint_dir)
    requested: list[dict[str, int]] = []

    def make(ctx: lamploop.BatchContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        requested.append({"epoch": ctx.epoch, "rank": ctx.rank, "nranks": ctx.nranks})
        mine = batches_of_epoch(ctx.epoch)[ctx.rank :: ctx.nranks]
        for made, batch in enumerate(mine):
            if (
                restart == 0
                and ctx.rank == args.kill_rank
                and ctx.epoch == args.kill_epoch
                and made == args.kill_after_batches
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    module = initial_module()
    result: dict[str, Any] = {
        "pid": os.getpid(),
        "restart": restart,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT")
            or k.startswith("SLURM_")
        },
        "latest_before": None if latest_before is None else Path(latest_before).name,
        "requested": requested,
    }
    try:
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module, loss=lamploop.mse_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM),
            train_batches=lamploop.iterable_batches(make),
            max_epochs=args.max_epochs,
            checkpoint_dir=args.checkpoint_dir,
            device="cpu",
        )
    except BaseException as error:  # the test reads what happened
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
        _write(out / f"rank{env_rank}-restart{restart}.json", json.dumps(result))
        print(result["error"], file=sys.stderr, flush=True)
        return 1
    result["returned"] = None if state is None else {"epoch": state.epoch}
    result["hex"] = {name: [float(v).hex() for v in values] for name, values in parameters(module).items()}
    result["params"] = parameters(module)
    _write(out / f"rank{env_rank}-restart{restart}.json", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
