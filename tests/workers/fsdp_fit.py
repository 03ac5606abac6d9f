"""``lamploop.fit`` with a strategy on N ranks, for tests/sync/test_fsdp.py.

    python tests/workers/fsdp_fit.py OUT_DIR CONFIG_JSON

``CONFIG_JSON``: ``{"strategy", "world_size", "max_epochs", "checkpoint_dir" (or null),
"every_n_steps", "device" (optional)}``.
Without a launcher this process is rank 0 and ``fit`` starts ranks 1..N-1 with the same
command line; rank 0 writes ``OUT_DIR/params.safetensors`` (its model after the run) and
``OUT_DIR/result.json`` (the learning curve, and how many elements the module's parameters
held at each epoch's end).  An MLP 6-13-5 in float64 (odd sizes: uneven
shards), 90 training examples in batches of 8 (uneven streams over 2 and 3 ranks), Adam.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import lamploop
from lamploop.distributed.launch import launch_env


def data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """90 training and 24 validation examples."""
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(114, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (114,), generator=generator)
    return (x[:90], y[:90]), (x[90:], y[90:])


def module() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).double()


def fit_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    (x, y), (xv, yv) = data()
    return {
        "model": lamploop.SupervisedModel(module()),
        "optimizer_factory": lambda params: torch.optim.Adam(params, lr=0.03),
        "train_batches": lamploop.tensor_batches(x, y, batch_size=8, seed=4),
        "validation_batches": lamploop.tensor_batches(xv, yv, batch_size=8, shuffle=False),
        "max_epochs": config["max_epochs"],
        "accumulate_gradient_over_n_batches": 2,
        "strategy": config["strategy"],
        "checkpoint_dir": config.get("checkpoint_dir"),
        "keep_last": None,
        "checkpoint_every_n_steps": config.get("every_n_steps"),
        "device": config.get("device", "cpu"),
        "reporters": [],
    }


def main(out: Path, config_json: str) -> int:
    config = json.loads(config_json)
    extra: dict[str, Any] = {"world_size": config["world_size"]}
    if launch_env() is None and config["world_size"] > 1:
        extra["launch_command"] = [sys.executable, str(Path(__file__).resolve()), str(out), config_json]
    kwargs = fit_kwargs(config)
    module = kwargs["model"].module
    held: list[int] = []  # the elements the caller's module holds at each epoch's end (rank 0)
    kwargs["on_epoch"] = lambda _: held.append(sum(p.numel() for p in module.parameters()))
    state = lamploop.fit(**kwargs, **extra)
    if state is None:
        return 0
    params = {k: v.contiguous() for k, v in kwargs["model"].module.state_dict().items()}
    save_file(params, str(out / "params.safetensors"))
    curve = [[e.training_loss, list(e.validation_loss or ())] for e in state.learning_curve]
    (out / "result.json").write_text(json.dumps({"epoch": state.epoch, "curve": curve, "held": held}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
