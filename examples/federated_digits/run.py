"""Federated digits: FedAvg over 3 node processes that keep their (non-IID) data.

    python examples/federated_digits/run.py [--rounds 10] [--local-epochs 1] [--out runs/federated]

What it does, as three institutions and a researcher would:

1. the researcher writes the training plan (``OUT/plan.json``) and sends it to the nodes;
2. each node's operator approves it: ``lamploop federated approve OUT/plan.json --allow-list
   OUT/node-k/allow.json`` (done here with :func:`lamploop.federated.approve_plan`);
3. the nodes start and connect out to the aggregator (one process each, here on this machine);
4. the aggregator runs the rounds, checkpointing into ``OUT/checkpoints`` after each, and
   prints the learning curve and the final model's accuracy on its own held-out test set.

Run it again with the same ``--out`` and more ``--rounds``: it resumes after the last round.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits_split import MODEL_OPTIONS, NODE_NAMES, held_out_test_set, make_plan

from lamploop.federated import (
    AggregatorSettings,
    FederatedResult,
    approve_plan,
    mlp,
    run_aggregator,
    save_plan,
)

HERE = Path(__file__).resolve().parent


def accuracy(model: dict[str, torch.Tensor]) -> float:
    """The global model's accuracy on the aggregator's held-out test set."""
    module = mlp(MODEL_OPTIONS)
    module.load_state_dict(model)
    x, y = held_out_test_set()
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/federated"))
    parser.add_argument("--port", type=int, default=0, help="the aggregator's port (default: any free one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="aggregator %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(local_epochs=args.local_epochs)
    plan_file = save_plan(plan, args.out / "plan.json")
    for name in NODE_NAMES:  # each node's operator approves the plan
        digest, _ = approve_plan(plan, args.out / name / "allow.json")
    print(f"plan {plan.name}: {digest}")
    token = secrets.token_hex(16)
    nodes: list[subprocess.Popen[bytes]] = []

    def start_nodes(port: int) -> None:
        env = {**os.environ, "LAMPLOOP_FEDERATED_TOKEN": token, "OMP_NUM_THREADS": "1"}
        for name in NODE_NAMES:
            command = [sys.executable, str(HERE / "node.py"), name, "--port", str(port)]
            command += ["--allow-list", str(args.out / name / "allow.json")]
            nodes.append(subprocess.Popen(command, env=env))

    async def aggregate() -> FederatedResult:
        return await run_aggregator(
            plan=plan,
            initial_model=mlp(MODEL_OPTIONS),
            token=token,
            port=args.port,
            settings=AggregatorSettings(
                rounds=args.rounds,
                min_nodes=2,
                expected_nodes=3,
                join_timeout=60,
                round_timeout=120,
                checkpoint_dir=args.out / "checkpoints",
            ),
            on_listening=start_nodes,
        )

    try:
        result = anyio.run(aggregate)
        for node in nodes:
            node.wait(timeout=30)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=10)
    print(f"plan file: {plan_file}")
    print("round  nodes  train loss  valid loss before  valid acc before  wall")
    for record in result.rounds:
        before = record.validation_before
        loss = f"{before.loss:.4f}" if before else "-"
        acc = f"{before.metrics.get('accuracy', float('nan')):.3f}" if before else "-"
        answered, train, wall = len(record.answered), record.training_loss, record.wall_s
        print(f"{record.round:5d}  {answered:5d}  {train:10.4f}  {loss:>17}  {acc:>16}  {wall:.3f} s")
    print(f"final test accuracy: {accuracy(dict(result.model)):.4f}")


if __name__ == "__main__":
    main()
