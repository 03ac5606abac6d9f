"""One rank of tests/test_acceptance_hostile_r5.py: ``fit(world_size=2)`` run from a JSON config.

``python hostile_r5_worker.py CONFIG.json``: the test starts rank 0; ``fit`` starts rank 1 with
this same command line (``launch_command``) and ``LAMPLOOP_RANK=1`` set. Every rank writes
``OUT/rank<r>.json`` (its pid, how its ``fit`` ended: the error's type, message, ``rank`` and
``how``) and rank 0 the trained parameters to ``OUT/model.safetensors``. Config keys: ``out``,
``n``, ``batch``, ``dims``, ``epochs``, ``strategy``, ``optimizer`` ("sgd" or "adam"), ``lr``,
``checkpoint_dir``, ``fit`` (more keywords), ``ranks`` (per rank: ``dims``, ``fit``, ``env``
overrides) and ``hang`` (``{"rank", "epoch", "batch"}``: that rank writes ``OUT/hang.json``
(its pid) inside that batch's forward and then computes for 60 s, for the test to SIGKILL).
The data and model are the test's (``data``, ``module``), so the test builds its reference
from the same numbers.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import lamploop


def data(n: int, dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, dims[0], generator=generator, dtype=torch.float64)
    y = torch.randint(0, dims[-1], (n,), generator=generator)
    return x, y


def module(dims: list[int]) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        layers: list[torch.nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers[:-1]).double()


def dealt(x: torch.Tensor, y: torch.Tensor, batch: int) -> Any:
    """Batch ``i`` (rows ``[i*batch, (i+1)*batch)``) goes to rank ``i % nranks``, in order."""
    count = math.ceil(len(x) / batch)

    def factory(context: lamploop.BatchContext) -> Any:
        async def batches() -> Any:
            for i in range(context.rank, count, context.nranks):
                yield x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]

        return batches()

    return factory


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("LAMPLOOP_RANK", "0"))
    mine = config.get("ranks", {}).get(str(rank), {})
    os.environ.update(mine.get("env", {}))
    out = Path(config["out"])
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "ok": False}
    dims = mine.get("dims", config["dims"])
    x, y = data(config["n"], config["dims"])
    hang = config.get("hang")
    net = module(dims)

    def loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.nn.functional.cross_entropy(output, target, reduction="sum"), len(target)

    if hang is not None and hang["rank"] == rank:
        seen = {"batches": 0}
        inner = net.forward

        def forward(features: torch.Tensor) -> torch.Tensor:
            epoch, index = divmod(seen["batches"], hang["per_epoch"])
            seen["batches"] += 1
            if (epoch, index) == (hang["epoch"], hang["batch"]):
                (out / "hang.json").write_text(json.dumps({"pid": os.getpid()}))
                time.sleep(60)
            return inner(features)

        net.forward = forward  # type: ignore[method-assign]

    lr = config.get("lr", 0.1)
    if config.get("optimizer", "sgd") == "adam":
        factory: Any = lambda params: torch.optim.Adam(params, lr=lr)  # noqa: E731
    else:
        factory = lambda params: torch.optim.SGD(params, lr=lr)  # noqa: E731
    keywords = dict(config.get("fit", {}))
    keywords.update(mine.get("fit", {}))
    if config.get("checkpoint_dir"):
        keywords["checkpoint_dir"] = config["checkpoint_dir"]
    try:
        state = lamploop.fit(
            model=lamploop.SupervisedModel(net, loss=loss),
            optimizer_factory=factory,
            train_batches=dealt(x, y, config["batch"]),
            max_epochs=config["epochs"],
            device="cpu",
            world_size=2,
            strategy=config.get("strategy", "auto"),
            launch_command=[sys.executable, str(Path(__file__).resolve()), sys.argv[1]],
            reporters=[],
            **keywords,
        )
    except BaseException as error:
        record.update(
            error_type=type(error).__name__,
            message=str(error),
            error_rank=getattr(error, "rank", None),
            how=getattr(error, "how", None),
        )
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        raise
    record["ok"] = True
    if state is not None:
        record["losses"] = [entry.training_loss for entry in state.learning_curve]
        record["epoch"] = state.epoch
        save_file(
            {k: v.detach().contiguous() for k, v in net.state_dict().items()}, out / "model.safetensors"
        )
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
