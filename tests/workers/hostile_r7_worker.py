"""A user's training script for tests/test_acceptance_hostile_r7.py, with a fault where the config says.

    python tests/workers/hostile_r7_worker.py CONFIG_JSON

``CONFIG_JSON`` is a path to a JSON object (the same for every rank: ``fit(world_size=2)`` runs
this same command line again for rank 1, with ``LAMPLOOP_RANK=1``):

- ``out``: the folder this process writes to;
- ``world_size``: what the script passes to ``fit`` (``null``: leave it out);
- ``epochs``, ``delay`` (seconds each training batch waits, on every rank), ``rows``,
  ``checkpoint_dir`` (or ``null``), ``every_n_steps``, ``heartbeat_timeout``;
- ``mode``: ``"local"`` runs the two ranks' models as replicas of
  ``local_data_parallel_training_loop`` in this one process instead (``result-local.json``);
- ``fit_calls``: how many times the script calls ``fit`` in a row (a second call with
  ``max_epochs`` one more);
- ``ranks``: per rank (its key the rank as a string), what this rank does differently:
  ``before_fit``: ``"import_crash"`` (raises before lamploop is imported); ``fault``:
  ``{"kind": K, "epoch": E, "batch": B}`` with ``K`` one of ``sigkill``, ``sigstop``,
  ``raise``, ``empty``, ``nan``, ``marker`` (touch ``marker-<rank>`` and go on), struck when
  the rank makes its ``B``-th training batch of epoch ``E``; ``fit``: keywords that replace
  the script's own (``accumulate``, ``strategy``, ``hidden``, ``validation``: false for none,
  ``world_size``, ``freeze``: the name of a parameter this rank freezes).

The rank is ``LAMPLOOP_RANK``, else ``RANK``, else ``SLURM_PROCID``, else 0 (for the file names
only: lamploop decides the real one).  Each process writes ``pid-<rank>-<pid>`` at its start and,
per ``fit`` call, ``result-<rank>-<call>.json``: ``{"ok": true, "returned": ...}`` (the loop
state's epoch or ``null``, the final parameters as ``float.hex`` strings) or the error's classes,
message and attributes.  An error is raised on, as a user's script lets it (status 1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
OUT = Path(CONFIG["out"])
RANK = os.environ.get("LAMPLOOP_RANK") or os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
MINE: dict[str, Any] = CONFIG.get("ranks", {}).get(RANK, {})


def _write(path: Path, text: str) -> None:
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    os.replace(part, path)


_write(OUT / f"pid-{RANK}-{os.getpid()}", str(os.getpid()))

if MINE.get("before_fit") == "import_crash":
    raise ImportError("hostile_r7: this script's own import failed on purpose")

import anyio  # noqa: E402
import torch  # noqa: E402

import lamploop  # noqa: E402
from lamploop.batches import BatchContext  # noqa: E402

FEATURES = 3


def data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]], dtype=torch.float64)
    return x, y


def module(hidden: int) -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).to(torch.float64)


def train_factory(rows: int, delay: float, fault: dict[str, Any] | None) -> Any:
    x, y = data(rows)
    plain = lamploop.tensor_batches(x, y, batch_size=3)

    def factory(context: BatchContext) -> Any:
        async def stream() -> AsyncIterator[Any]:
            index = 0
            async for features, target in plain(context):
                if fault is not None and context.epoch == fault["epoch"] and index == fault["batch"]:
                    kind = fault["kind"]
                    _write(OUT / f"struck-{RANK}", kind)
                    if kind == "sigkill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif kind == "sigstop":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    elif kind == "raise":
                        raise RuntimeError(f"hostile_r7: the stream of rank {RANK} broke on purpose")
                    elif kind == "empty":
                        features, target = features[:0], target[:0]
                    elif kind == "nan":
                        features = torch.full_like(features, float("nan"))
                    elif kind == "marker":
                        _write(OUT / f"marker-{RANK}", "")
                if delay:
                    await anyio.sleep(delay)
                yield features, target
                index += 1

        return stream()

    return factory


def error_record(error: BaseException) -> dict[str, Any]:
    attributes = {}
    for name in ("rank", "how", "reason", "epoch", "steps_done", "ranks", "step", "batch"):
        if hasattr(error, name):
            value = getattr(error, name)
            attributes[name] = list(value) if isinstance(value, tuple) else value
    return {
        "ok": False,
        "type": type(error).__name__,
        "classes": [cls.__name__ for cls in type(error).__mro__],
        "message": str(error),
        "attributes": attributes,
    }


def one_fit(call: int) -> None:
    options = {**CONFIG.get("fit", {}), **MINE.get("fit", {})}
    model = lamploop.SupervisedModel(module(int(options.get("hidden", 4))), lamploop.mse_loss)
    if options.get("freeze"):
        model.module.get_parameter(options["freeze"]).requires_grad_(False)
    x, y = data(12)
    keywords: dict[str, Any] = {
        "model": model,
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        "train_batches": train_factory(CONFIG.get("rows", 24), CONFIG.get("delay", 0.0), MINE.get("fault")),
        "validation_batches": (
            lamploop.tensor_batches(x, y, batch_size=4, shuffle=False)
            if options.get("validation", True)
            else None
        ),
        "max_epochs": CONFIG.get("epochs", 2) + call,
        "device": "cpu",
        "reporters": [],
        "accumulate_gradient_over_n_batches": options.get("accumulate", 1),
        "strategy": options.get("strategy", "auto"),
        "heartbeat_timeout": CONFIG.get("heartbeat_timeout", 4.0),
    }
    world_size = options.get("world_size", CONFIG.get("world_size"))
    if world_size is not None:
        keywords["world_size"] = world_size
    if CONFIG.get("checkpoint_dir"):
        keywords["checkpoint_dir"] = CONFIG["checkpoint_dir"]
        keywords["checkpoint_every_n_steps"] = CONFIG.get("every_n_steps")
    result = OUT / f"result-{RANK}-{call}.json"
    try:
        state = lamploop.fit(**keywords)
    except BaseException as error:
        _write(result, json.dumps(error_record(error)))
        raise
    params = [float.hex(v) for t in model.module.state_dict().values() for v in t.flatten().tolist()]
    returned = None if state is None else {"epoch": state.epoch, "curve": len(state.learning_curve)}
    _write(result, json.dumps({"ok": True, "returned": returned, "params": params}))


def local_run() -> None:
    """``mode: "local"``: the two ranks as replicas of local_data_parallel_training_loop in this process."""
    replicas = []
    for rank in ("0", "1"):
        options = {**CONFIG.get("fit", {}), **CONFIG.get("ranks", {}).get(rank, {}).get("fit", {})}
        model = lamploop.SupervisedModel(module(int(options.get("hidden", 4))), lamploop.mse_loss)
        if options.get("freeze"):
            model.module.get_parameter(options["freeze"]).requires_grad_(False)
        replicas.append((model, train_factory(CONFIG.get("rows", 24), 0.0, None), None))
    result = OUT / "result-local.json"
    try:
        state = anyio.run(
            lambda: lamploop.local_data_parallel_training_loop(
                replicas, lambda params: torch.optim.SGD(params, lr=0.05), CONFIG.get("epochs", 2)
            )
        )
    except BaseException as error:
        _write(result, json.dumps(error_record(error)))
        raise
    _write(result, json.dumps({"ok": True, "returned": {"epoch": state.epoch}}))


def main() -> None:
    if CONFIG.get("mode") == "local":
        local_run()
        return
    for call in range(CONFIG.get("fit_calls", 1)):
        one_fit(call)


if __name__ == "__main__":
    main()
