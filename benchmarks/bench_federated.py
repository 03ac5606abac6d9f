"""Federated rounds: lamploop's FedAvg against Flower's, side by side on the same non-IID digits.

The federation of examples/federated_digits (3 nodes, digits split non-IID, an MLP 64-64-10,
SGD lr 0.05 momentum 0.9 reset every round, 1 local epoch of batches of 32 per round, the
same seeds, the same batch order) runs R rounds twice per repeat, once on each system, each
with real server and client processes on 127.0.0.1:

- **lamploop**: an aggregator process (:func:`lamploop.federated.run_aggregator`) and three
  node processes (examples/federated_digits/node.py, validation off) over lamploop's
  authenticated TCP star;
- **Flower**: a server process (``flwr.server.start_server``, the gRPC transport, FedAvg
  with ``fraction_evaluate=0``) and three client processes (``start_client`` with a
  ``NumPyClient`` training the same model on the same batches).  These are Flower's
  "legacy" entry points (deprecated since Flower 1.13 in favour of SuperLink/SuperNode),
  kept because they run a real server and real clients over Flower's own gRPC transport
  without a Flower app project.

Time per round: from the moment the server starts the round (lamploop: sends the task;
Flower: ``configure_fit``) to the new global model (FedAvg done), measured in the server;
the first round of each run is a warm-up and left out.  Accuracy: the final global model on
the held-out fifth of the digits.  Repeats alternate which system runs first.  Targets:
accuracy within 1 point of Flower's, lamploop's time per round <= Flower's.

    python benchmarks/bench_federated.py [--quick] [--json PATH] [--rounds R] [--repeats N]

Needs ``pip install "lamploop[federated-bench]"`` (flwr); without it, prints why and skips.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, print_table, summarize, write_json

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "federated_digits"
sys.path.insert(0, str(EXAMPLE))

BATCH_SIZE = 32
LEARNING_RATE = 0.05
MOMENTUM = 0.9
LOCAL_EPOCHS = 1
SEED = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "LAMPLOOP_FEDERATED_TOKEN": token, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _accuracy(state: dict[str, Any]) -> float:
    import torch
    from digits_split import MODEL_OPTIONS, held_out_test_set

    from lamploop.federated import mlp

    module = mlp(MODEL_OPTIONS)
    module.load_state_dict({name: torch.as_tensor(value) for name, value in state.items()})
    x, y = held_out_test_set(SEED)
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def _run(
    server: list[str], clients: list[list[str]], env: dict[str, str], out: Path, timeout: float
) -> dict[str, Any]:
    """Start the server, then the clients; wait for all; the server's JSON result."""
    procs: list[subprocess.Popen[Any]] = [
        subprocess.Popen(server, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ]
    try:
        procs += [
            subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for c in clients
        ]
        _, err = procs[0].communicate(timeout=timeout)
        if procs[0].returncode != 0:
            msg = f"the server failed ({procs[0].returncode}): {err[-2000:]}"
            raise RuntimeError(msg)
        for proc in procs[1:]:
            proc.wait(timeout=30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# -- lamploop --


def lamploop_round_times(rounds: int, workdir: Path) -> dict[str, Any]:
    from digits_split import NODE_NAMES, make_plan

    from lamploop.federated import approve_plan, save_plan

    token, port = secrets.token_hex(16), _free_port()
    plan = make_plan(local_epochs=LOCAL_EPOCHS, learning_rate=LEARNING_RATE)
    plan_file = save_plan(plan, workdir / "plan.json")
    clients = []
    for name in NODE_NAMES:
        allow = workdir / name / "allow.json"
        approve_plan(plan, allow)
        node = [
            sys.executable,
            str(EXAMPLE / "node.py"),
            name,
            "--port",
            str(port),
            "--allow-list",
            str(allow),
        ]
        clients.append([*node, "--batch-size", str(BATCH_SIZE), "--seed", str(SEED), "--no-validation"])
    out = workdir / "lamploop-result.json"
    server = [sys.executable, __file__, "--role", "lamploop-aggregator", "--port", str(port)]
    server += ["--rounds", str(rounds), "--plan", str(plan_file), "--out", str(out)]
    return _run(server, clients, _env(token), out, timeout=300)


def lamploop_aggregator(args: argparse.Namespace) -> None:
    import anyio
    from digits_split import MODEL_OPTIONS

    from lamploop.federated import AggregatorSettings, load_plan, mlp, run_aggregator

    plan = load_plan(args.plan)
    result = anyio.run(
        lambda: run_aggregator(
            plan=plan,
            initial_model=mlp(MODEL_OPTIONS),
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            port=args.port,
            settings=AggregatorSettings(
                rounds=args.rounds, min_nodes=3, expected_nodes=3, join_timeout=120, round_timeout=120
            ),
        )
    )
    state = {name: tensor.tolist() for name, tensor in result.model.items()}
    times = [record.wall_s for record in result.rounds]
    args.out.write_text(json.dumps({"round_s": times, "model": state}))


# -- Flower --


def flower_round_times(rounds: int, workdir: Path) -> dict[str, Any]:
    from digits_split import NODE_NAMES

    port = _free_port()
    out = workdir / "flower-result.json"
    server = [sys.executable, __file__, "--role", "flower-server", "--port", str(port)]
    server += ["--rounds", str(rounds), "--out", str(out)]
    clients = [
        [sys.executable, __file__, "--role", "flower-client", "--port", str(port), "--name", name]
        for name in NODE_NAMES
    ]
    return _run(server, clients, _env("unused"), out, timeout=300)


def flower_server(args: argparse.Namespace) -> None:
    import flwr
    from digits_split import MODEL_OPTIONS
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    from lamploop.federated import mlp

    initial = [t.detach().numpy() for t in mlp(MODEL_OPTIONS).state_dict().values()]
    names = list(mlp(MODEL_OPTIONS).state_dict())
    starts: dict[int, float] = {}
    times: list[float] = []
    final: list[Any] = []

    class TimedFedAvg(FedAvg):
        """FedAvg that notes when each round starts and when its average is done."""

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            starts[server_round] = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            aggregated = super().aggregate_fit(server_round, results, failures)
            times.append(time.perf_counter() - starts[server_round])
            if aggregated[0] is not None:
                final[:] = parameters_to_ndarrays(aggregated[0])
            return aggregated

    strategy = TimedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=3,
        min_evaluate_clients=0,
        min_available_clients=3,
        initial_parameters=ndarrays_to_parameters(initial),
        # The clients need the round for the batch order (Flower counts rounds from 1).
        on_fit_config_fn=lambda server_round: {"server_round": server_round},
    )
    flwr.server.start_server(
        server_address=f"127.0.0.1:{args.port}",
        config=flwr.server.ServerConfig(num_rounds=args.rounds),
        strategy=strategy,
    )
    state = {name: array.tolist() for name, array in zip(names, final, strict=True)}
    args.out.write_text(json.dumps({"round_s": times, "model": state}))


def flower_client(args: argparse.Namespace) -> None:
    import anyio
    import torch
    import torch.nn.functional as F
    from digits_split import MODEL_OPTIONS, NODE_NAMES, node_data
    from flwr.client import NumPyClient
    from flwr.compat.client.app import start_client

    from lamploop.batches import BatchContext, tensor_batches
    from lamploop.federated import mlp

    module = mlp(MODEL_OPTIONS)
    x_train, y_train, _, _ = node_data(NODE_NAMES.index(args.name), SEED)
    # The same batches, in the same order, as the lamploop node's (its order depends on the epoch).
    batches = tensor_batches(x_train, y_train, batch_size=BATCH_SIZE, seed=SEED)

    async def collect(epoch: int) -> list[Any]:
        return [batch async for batch in batches(BatchContext(epoch))]

    class DigitsClient(NumPyClient):
        def get_parameters(self, config: Any) -> list[Any]:
            return [t.detach().numpy() for t in module.state_dict().values()]

        def fit(self, parameters: list[Any], config: Any) -> tuple[list[Any], int, dict[str, Any]]:
            state = dict(zip(module.state_dict(), (torch.as_tensor(p) for p in parameters), strict=True))
            module.load_state_dict(state)
            round_ = int(config["server_round"]) - 1  # lamploop's rounds count from 0
            optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
            module.train()
            examples = 0
            for epoch in range(LOCAL_EPOCHS):
                for features, target in anyio.run(collect, round_ * LOCAL_EPOCHS + epoch):
                    optimizer.zero_grad()
                    F.cross_entropy(module(features), target).backward()
                    optimizer.step()
                    examples += int(target.shape[0])
            return self.get_parameters({}), examples, {}

    start_client(server_address=f"127.0.0.1:{args.port}", client=DigitsClient().to_client(), insecure=True)


# -- the comparison --


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="rounds per run (default 10, quick 4)")
    parser.add_argument("--repeats", type=int, help="runs of each system (default 5, quick 1)")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    roles = {
        "lamploop-aggregator": lamploop_aggregator,
        "flower-server": flower_server,
        "flower-client": flower_client,
    }
    if args.role is not None:
        roles[args.role](args)
        return 0
    try:
        import flwr
    except ImportError:
        reason = 'flwr is not installed: pip install "lamploop[federated-bench]"'
        print(f"bench_federated: skipped: {reason}")
        if args.json is not None:
            write_json(args.json, {"skipped": reason})
        return 0
    rounds = args.rounds or (4 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 5)
    import tempfile

    runs: dict[str, list[dict[str, Any]]] = {"lamploop": [], "flower": []}
    contenders = {"lamploop": lamploop_round_times, "flower": flower_round_times}
    for repeat in range(repeats):
        order = ["lamploop", "flower"] if repeat % 2 == 0 else ["flower", "lamploop"]
        for system in order:
            with tempfile.TemporaryDirectory() as workdir:
                result = contenders[system](rounds, Path(workdir))
            accuracy, times = _accuracy(result["model"]), result["round_s"]
            runs[system].append({"round_s": times, "accuracy": accuracy, "load": os.getloadavg()})
            print(f"repeat {repeat} {system}: accuracy {accuracy:.4f}, seconds per round {times}")
    summary: dict[str, Any] = {}
    rows = []
    for system, results in runs.items():
        per_round = [t for r in results for t in r["round_s"][1:]]  # round 0 warms up
        times = summarize(per_round)
        accuracies = summarize([r["accuracy"] for r in results])
        summary[system] = {"time_per_round_s": times, "accuracy": accuracies}
        rows.append(
            [
                system,
                f"{accuracies['median']:.4f}",
                f"{times['median'] * 1e3:.1f} ms",
                f"[{times['q1'] * 1e3:.1f}, {times['q3'] * 1e3:.1f}] ms",
                times["n"],
            ]
        )
    ratios = [
        statistics.median(a["round_s"][1:]) / statistics.median(b["round_s"][1:])
        for a, b in zip(runs["lamploop"], runs["flower"], strict=True)
    ]
    ratio = summarize(ratios)
    lam, flo = summary["lamploop"]["time_per_round_s"], summary["flower"]["time_per_round_s"]
    spread = (lam["q1"] / flo["q3"], lam["q3"] / flo["q1"])
    accuracy_gap = summary["lamploop"]["accuracy"]["median"] - summary["flower"]["accuracy"]["median"]
    what = f"{rounds} rounds x {LOCAL_EPOCHS} local epoch, {repeats} repeat(s)"
    print(f"\nFedAvg on non-IID digits, 3 nodes, {what}")
    print_table(["system", "final accuracy", "time/round (median)", "IQR", "rounds timed"], rows)
    print(
        f"time per round lamploop/Flower: {ratio['median']:.3f} (median of per-repeat ratios of medians; "
        f"IQR {ratio['q1']:.3f}..{ratio['q3']:.3f}, min {ratio['min']:.3f}, max {ratio['max']:.3f}); "
        f"pooled rounds' quartiles give {spread[0]:.3f}..{spread[1]:.3f}"
    )
    # The verdict reads the per-repeat ratios (each repeat runs both systems back to back, which
    # cancels slow drifts of the machine's load): met when even their upper quartile is <= 1.
    if ratio["q3"] <= 1.0:
        verdict = "met"
    elif ratio["q1"] > 1.0:
        verdict = "missed"
    else:
        verdict = "inconclusive"
    print(f"target lamploop time/round <= Flower's: {verdict}")
    print(
        f"accuracy lamploop - Flower: {accuracy_gap * 100:+.2f} points (target within 1 point: "
        f"{'met' if abs(accuracy_gap) <= 0.01 else 'missed'})"
    )
    print(f"load average: {os.getloadavg()} (a shared machine: figures are noisy)")
    if args.json is not None:
        write_json(
            args.json,
            {
                "rounds": rounds,
                "repeats": repeats,
                "flwr": flwr.__version__,
                "runs": runs,
                "summary": summary,
                "ratio_time_per_round": ratio,
                "quartile_ratio_range": spread,
                "verdict_time": verdict,
                "accuracy_gap": accuracy_gap,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
