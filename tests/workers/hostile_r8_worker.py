"""One pipeline rank for tests/test_acceptance_hostile_r8.py.

    python tests/workers/hostile_r8_worker.py CONFIG_JSON

``CONFIG_JSON`` is a path to a JSON object: ``out`` (the result file this process writes),
``rank``, ``world_size``, ``port``, ``timeout``, ``join_timeout`` (the arguments of
``open_pipeline_group``) and ``train`` (whether to train a tiny 2-stage model for one epoch
inside the block).  The result is ``{"ok": true, ...}`` or the error's class names and message,
with ``elapsed``: the seconds from the call of ``open_pipeline_group`` to the end.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Path(config["out"])
    Path(str(out) + ".started").write_text(str(time.time()))
    import anyio
    import torch

    import lamploop
    from lamploop.pipeline import PipelineSpec, open_pipeline_group, train_pipeline

    started = time.monotonic()
    result: dict[str, object]
    try:
        with open_pipeline_group(
            rank=config["rank"],
            world_size=config["world_size"],
            host="127.0.0.1",
            port=config["port"],
            timeout=config["timeout"],
            join_timeout=config["join_timeout"],
        ):
            Path(str(out) + ".joined").write_text(str(time.monotonic() - started))
            epoch = None
            if config.get("train"):
                torch.manual_seed(0)
                model = torch.nn.Sequential(
                    torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
                ).double()
                generator = torch.Generator().manual_seed(1)
                x = torch.randn(16, 3, generator=generator, dtype=torch.float64)
                y = torch.randint(0, 2, (16,), generator=generator)
                state = anyio.run(
                    partial(
                        train_pipeline,
                        model=model,
                        spec=PipelineSpec(boundaries=(2,), n_microbatches=2),
                        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
                        max_epochs=1,
                    )
                )
                epoch = state.epoch
        result = {"ok": True, "epoch": epoch}
    except BaseException as error:  # the result is what the test looks at
        result = {
            "ok": False,
            "classes": [cls.__name__ for cls in type(error).__mro__],
            "message": str(error),
        }
    result["elapsed"] = time.monotonic() - started
    out.write_text(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
