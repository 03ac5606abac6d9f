"""A federated aggregator process, for tests/federated/test_federated_faults.py (killed and resumed).

    python tests/workers/federated_aggregator.py CONFIG_JSON

CONFIG_JSON: port, plan (a plan file), rounds, min_nodes, expected_nodes, checkpoint_dir, out
(the final model, as a safetensors file).  The initial model is the plan's MLP built from its
options; the token is LAMPLOOP_FEDERATED_TOKEN.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import anyio
import safetensors.torch

from lamploop.federated import AggregatorSettings, load_plan, mlp, run_aggregator


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config: dict[str, Any] = json.loads(sys.argv[1])
    plan = load_plan(config["plan"])
    settings = AggregatorSettings(
        rounds=config["rounds"],
        min_nodes=config["min_nodes"],
        expected_nodes=config["expected_nodes"],
        join_timeout=30.0,
        round_timeout=30.0,
        checkpoint_dir=config["checkpoint_dir"],
    )
    result = anyio.run(
        lambda: run_aggregator(
            plan=plan,
            initial_model=mlp(dict(plan.model.options)),
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            port=config["port"],
            settings=settings,
        )
    )
    safetensors.torch.save_file(dict(result.model), config["out"])
    print(json.dumps({"rounds": [record.round for record in result.rounds]}), flush=True)
    os._exit(0)  # skip the interpreter's teardown (seconds on a loaded machine)


if __name__ == "__main__":
    main()
