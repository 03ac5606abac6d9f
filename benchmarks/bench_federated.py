"""Federated rounds: lamploop's FedAvg against Flower's, side by side on the same non-IID digits.

The federation of examples/federated_digits (3 nodes, digits split non-IID, an MLP 64-64-10,
SGD lr 0.05 momentum 0.9 reset every round, 1 local epoch of batches of 32 per round, the
same seeds, the same batch order) runs R rounds twice per repeat, once on each system, each
with real server and client processes on 127.0.0.1.  The parent process splits the data once
and writes each node's part and the test set as ``.npy`` files (no pickle); both systems'
clients read them at start-up, before any timer.

- **lamploop**: an aggregator process (:func:`lamploop.federated.run_aggregator`) and three
  node processes (:func:`lamploop.federated.run_node` over :func:`lamploop.batches.tensor_batches`,
  as examples/federated_digits/node.py, validation off) over lamploop's authenticated TCP star;
- **Flower**: written as Flower's own PyTorch examples write a ``NumPyClient`` and a server
  strategy, and nothing of lamploop on Flower's side: a server process
  (``flwr.server.start_server``, FedAvg with ``fraction_evaluate=0`` and an
  ``on_fit_config_fn`` that hands the clients the round) and three client processes
  (``start_client`` with a ``NumPyClient`` whose ``fit`` loads the parameters into a plain
  ``torch.nn.Sequential``, trains it with a plain torch loop over batches cut from the
  node's tensors, and returns the parameters and the example count).  The batches: the node's
  tensors permuted by ``torch.randperm`` with the round's seed and cut every 32 rows, the
  same rows in the same order as lamploop's ``tensor_batches``.  These are Flower's "legacy"
  entry points (deprecated since Flower 1.13): Flower 1.42's recommended runtime for a
  ``ClientApp``/``ServerApp`` (SuperLink, SuperNodes, ``flwr run``) polls (a SuperNode that
  finds no message sleeps 3 s before asking again) and starts a ClientApp process per task,
  so its rounds take seconds; the legacy gRPC server and clients push each round at once
  and are Flower's fastest real-socket path.

Time per round, measured alike on both sides (the first round of each run is a warm-up and
left out):

- **server wall**: from the moment the server starts the round (lamploop: the round's task
  is about to be encoded and sent; Flower: ``configure_fit``) to the new global model
  (FedAvg done; Flower: the end of ``aggregate_fit``);
- **client interval**: on each client, the time from the start of its local training in
  round r to the start in round r+1 (lamploop: the node asks its batch stream for the
  round's epoch; Flower: ``fit`` is called): one whole round as a client lives it;
- **CPU per round**: each client's process CPU time over the same intervals, and the
  server's between the ends of consecutive rounds (lamploop: ``run_aggregator``'s
  ``on_round``; Flower: the end of ``aggregate_fit``), less sensitive to the machine's load
  than the wall times.

Every server and client process runs in a session of its own (``--one-session``: all in
this script's session), as separate services would: on Linux with autogroup scheduling
the processes of one session share one CPU share, and on a loaded machine the share that
four processes of one session get depends on how they sleep and wake (see
docs/benchmarks.md).

Accuracy: the final global model on the held-out fifth of the digits.  Repeats alternate
which system runs first; each repeat gives one median per system and one ratio
lamploop/Flower of those medians; the figures are the medians of the repeats with their
range (min-max).  Beside the 1-minute load average, the runnable task count is sampled
during each run (the load average lags by a minute; a run lasts seconds).  Target (issue
19): lamploop/Flower time per round <= 0.8 (server wall, median of the per-repeat ratios),
the same accuracy.

    python benchmarks/bench_federated.py [--quick] [--json PATH] [--rounds R] [--repeats N]

Needs ``pip install "lamploop[federated-bench]"`` (flwr); without it, prints why and skips.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, print_table, summarize, write_json

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "federated_digits"
sys.path.insert(0, str(EXAMPLE))

NODE_NAMES = ("node-0", "node-1", "node-2")
BATCH_SIZE = 32
LEARNING_RATE = 0.05
MOMENTUM = 0.9
LOCAL_EPOCHS = 1
SEED = 0
SIZES = (64, 64, 10)
TARGET_RATIO = 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "LAMPLOOP_FEDERATED_TOKEN": token, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _write_data(data: Path) -> None:
    """Each node's training tensors and the held-out test set, as .npy files (no pickle)."""
    import numpy as np
    from digits_split import held_out_test_set, node_data

    data.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(NODE_NAMES):
        x_train, y_train, _, _ = node_data(index, SEED)
        np.save(data / f"{name}-x.npy", x_train.numpy(), allow_pickle=False)
        np.save(data / f"{name}-y.npy", y_train.numpy(), allow_pickle=False)
    x_test, y_test = held_out_test_set(SEED)
    np.save(data / "test-x.npy", x_test.numpy(), allow_pickle=False)
    np.save(data / "test-y.npy", y_test.numpy(), allow_pickle=False)


def _read_data(data: Path, name: str) -> tuple[Any, Any]:
    import numpy as np
    import torch

    x = torch.from_numpy(np.load(data / f"{name}-x.npy", allow_pickle=False))
    y = torch.from_numpy(np.load(data / f"{name}-y.npy", allow_pickle=False))
    return x, y


def _net() -> Any:
    """The MLP 64-64-10 in plain torch, initial weights seeded with 0 (lamploop's ``mlp`` builds the same)."""
    import torch

    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(), torch.nn.Linear(SIZES[1], SIZES[2])
    )


def _accuracy(state: dict[str, Any], data: Path) -> float:
    import torch

    module = _net()
    module.load_state_dict({name: torch.as_tensor(value) for name, value in state.items()})
    x, y = _read_data(data, "test")
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def _run(
    server: list[str],
    clients: list[list[str]],
    env: dict[str, str],
    out: Path,
    timeout: float,
    *,
    own_sessions: bool,
) -> dict[str, Any]:
    """Start the server, then the clients; wait for all; the server's and the clients' JSON results.

    ``own_sessions``: each process in a session of its own, as separate services are (on
    Linux with autogroup scheduling, the processes of one session share one CPU share).
    """
    procs: list[subprocess.Popen[Any]] = [
        subprocess.Popen(
            server,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=own_sessions,
        )
    ]
    try:
        procs += [
            subprocess.Popen(
                c,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=own_sessions,
            )
            for c in clients
        ]
        _, err = procs[0].communicate(timeout=timeout)
        if procs[0].returncode != 0:
            msg = f"the server failed ({procs[0].returncode}): {err[-2000:]}"
            raise RuntimeError(msg)
        for proc in procs[1:]:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    result: dict[str, Any] = json.loads(out.read_text())
    result["client_starts"] = [
        json.loads((out.parent / f"{name}-starts.json").read_text()) for name in NODE_NAMES
    ]
    return result


class _Runnable:
    """Samples the machine's runnable task count (/proc/loadavg's 4th field) every 50 ms while open.

    The 1-minute load average lags by a minute; this says how busy the cores were during
    one run (a few seconds).  ``None`` where /proc/loadavg is missing.
    """

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            try:
                running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
            except (OSError, IndexError):
                return
            self.samples.append(int(running) - 1)  # less this sampler

    def __enter__(self) -> _Runnable:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def _client_intervals(starts: list[list[list[float]]], clock: int = 0) -> list[float]:
    """Each client's intervals between the starts of consecutive rounds, round 0 (warm-up) left out.

    ``clock`` 0: wall-clock seconds; 1: the client process's CPU seconds.
    """
    return [b[clock] - a[clock] for client in starts for a, b in itertools.pairwise(client[1:])]


# -- lamploop --


def lamploop_round_times(rounds: int, workdir: Path, data: Path, *, own_sessions: bool) -> dict[str, Any]:
    from digits_split import make_plan

    from lamploop.federated import approve_plan, save_plan

    token, port = secrets.token_hex(16), _free_port()
    plan = make_plan(local_epochs=LOCAL_EPOCHS, learning_rate=LEARNING_RATE)
    plan_file = save_plan(plan, workdir / "plan.json")
    clients = []
    for name in NODE_NAMES:
        allow = workdir / name / "allow.json"
        approve_plan(plan, allow)
        node = [sys.executable, __file__, "--role", "lamploop-node", "--name", name, "--port", str(port)]
        node += ["--allow-list", str(allow), "--data", str(data)]
        node += ["--out", str(workdir / f"{name}-starts.json")]
        clients.append(node)
    out = workdir / "lamploop-result.json"
    server = [sys.executable, __file__, "--role", "lamploop-aggregator", "--port", str(port)]
    server += ["--rounds", str(rounds), "--plan", str(plan_file), "--out", str(out)]
    return _run(server, clients, _env(token), out, timeout=300, own_sessions=own_sessions)


def lamploop_aggregator(args: argparse.Namespace) -> None:
    import anyio

    from lamploop.federated import AggregatorSettings, load_plan, mlp, run_aggregator

    plan = load_plan(args.plan)
    ends: list[float] = []  # the process's CPU seconds as each round's global model is done
    result = anyio.run(
        lambda: run_aggregator(
            plan=plan,
            initial_model=mlp(plan.model.options),
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            port=args.port,
            settings=AggregatorSettings(
                rounds=args.rounds, min_nodes=3, expected_nodes=3, join_timeout=120, round_timeout=120
            ),
            on_round=lambda record: ends.append(time.process_time()),
        )
    )
    state = {name: tensor.tolist() for name, tensor in result.model.items()}
    times = [record.wall_s for record in result.rounds]
    args.out.write_text(json.dumps({"round_s": times, "model": state, "cpu_at_round_end": ends}))


def lamploop_node(args: argparse.Namespace) -> None:
    """A node as examples/federated_digits/node.py runs one, noting when each round's training starts."""
    import anyio

    from lamploop.batches import BatchContext, BatchStream, tensor_batches
    from lamploop.federated import NodeSettings, run_node

    x_train, y_train = _read_data(args.data, args.name)
    batches = tensor_batches(x_train, y_train, batch_size=BATCH_SIZE, seed=SEED)
    starts: list[tuple[float, float]] = []

    def timed(context: BatchContext) -> BatchStream:
        starts.append((time.perf_counter(), time.process_time()))  # once per round: one local epoch
        return batches(context)

    anyio.run(
        lambda: run_node(
            name=args.name,
            host="127.0.0.1",
            port=args.port,
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            allow_list=args.allow_list,
            train_batches=timed,
            settings=NodeSettings(connect_timeout=60.0, retry_interval=0.05),
        )
    )
    args.out.write_text(json.dumps(starts))


# -- Flower (plain torch and Flower only: nothing of lamploop runs on this side) --


def flower_round_times(rounds: int, workdir: Path, data: Path, *, own_sessions: bool) -> dict[str, Any]:
    port = _free_port()
    out = workdir / "flower-result.json"
    server = [sys.executable, __file__, "--role", "flower-server", "--port", str(port)]
    server += ["--rounds", str(rounds), "--out", str(out)]
    clients = []
    for name in NODE_NAMES:
        client = [sys.executable, __file__, "--role", "flower-client", "--port", str(port), "--name", name]
        client += ["--data", str(data), "--out", str(workdir / f"{name}-starts.json")]
        clients.append(client)
    return _run(server, clients, _env("unused"), out, timeout=300, own_sessions=own_sessions)


def flower_server(args: argparse.Namespace) -> None:
    import flwr
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    net = _net()
    names = list(net.state_dict())
    initial = [value.cpu().numpy() for value in net.state_dict().values()]
    starts: dict[int, float] = {}
    times: list[float] = []
    ends: list[float] = []  # the process's CPU seconds as each round's global model is done
    final: list[Any] = []

    def fit_config(server_round: int) -> dict[str, Any]:
        return {"server_round": server_round, "local_epochs": LOCAL_EPOCHS}

    class TimedFedAvg(FedAvg):
        """FedAvg that notes when each round starts and when its average is done."""

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            starts[server_round] = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            aggregated = super().aggregate_fit(server_round, results, failures)
            times.append(time.perf_counter() - starts[server_round])
            ends.append(time.process_time())
            if aggregated[0] is not None:
                final[:] = parameters_to_ndarrays(aggregated[0])
            return aggregated

    strategy = TimedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=len(NODE_NAMES),
        min_available_clients=len(NODE_NAMES),
        initial_parameters=ndarrays_to_parameters(initial),
        on_fit_config_fn=fit_config,
    )
    flwr.server.start_server(
        server_address=f"127.0.0.1:{args.port}",
        config=flwr.server.ServerConfig(num_rounds=args.rounds),
        strategy=strategy,
    )
    state = {name: array.tolist() for name, array in zip(names, final, strict=True)}
    args.out.write_text(json.dumps({"round_s": times, "model": state, "cpu_at_round_end": ends}))


def flower_client(args: argparse.Namespace) -> None:
    from collections import OrderedDict

    import numpy as np
    import torch
    from flwr.client import NumPyClient
    from flwr.compat.client.app import start_client

    x_train, y_train = _read_data(args.data, args.name)
    starts: list[tuple[float, float]] = []

    def round_seed(server_round: int) -> int:
        # The data order of round r (Flower counts rounds from 1): a permutation seeded from
        # (SEED, r - 1), the seed lamploop's tensor_batches derives for that epoch.
        words = np.random.SeedSequence([SEED, server_round - 1]).generate_state(2, dtype=np.uint32)
        return (int(words[0]) << 31) ^ int(words[1])

    def batches(server_round: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(round_seed(server_round))
        order = torch.randperm(len(y_train), generator=generator)
        return [(x_train[index], y_train[index]) for index in order.split(BATCH_SIZE)]

    def train(net: torch.nn.Module, server_round: int, epochs: int) -> None:
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
        net.train()
        for _ in range(epochs):
            for features, labels in batches(server_round):
                optimizer.zero_grad()
                criterion(net(features), labels).backward()
                optimizer.step()

    def get_parameters(net: torch.nn.Module) -> list[np.ndarray]:
        return [value.cpu().numpy() for value in net.state_dict().values()]

    def set_parameters(net: torch.nn.Module, parameters: list[np.ndarray]) -> None:
        params_dict = zip(net.state_dict().keys(), parameters, strict=True)
        state_dict = OrderedDict({k: torch.tensor(v) for k, v in params_dict})
        net.load_state_dict(state_dict, strict=True)

    class FlowerClient(NumPyClient):
        def __init__(self) -> None:
            self.net = _net()

        def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
            return get_parameters(self.net)

        def fit(
            self, parameters: list[np.ndarray], config: dict[str, Any]
        ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            starts.append((time.perf_counter(), time.process_time()))
            set_parameters(self.net, parameters)
            train(self.net, int(config["server_round"]), int(config["local_epochs"]))
            return get_parameters(self.net), len(y_train), {}

    start_client(server_address=f"127.0.0.1:{args.port}", client=FlowerClient().to_client(), insecure=True)
    args.out.write_text(json.dumps(starts))


# -- the comparison --


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return (
        f"{statistics.median(values) * scale:.{digits}f} "
        f"[{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}]"
    )


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="rounds per run (default 30, quick 4)")
    parser.add_argument("--repeats", type=int, help="runs of each system (default 8, quick 1)")
    parser.add_argument(
        "--one-session",
        action="store_true",
        help="run every server and client process in this script's session (default: each in its own)",
    )
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--allow-list", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    roles = {
        "lamploop-aggregator": lamploop_aggregator,
        "lamploop-node": lamploop_node,
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
    rounds = args.rounds or (4 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 8)
    if rounds < 3:
        parser.error("--rounds must be at least 3 (round 0 warms up; client intervals need two more)")
    import tempfile

    import torch

    from lamploop.federated import mlp

    # The two sides start from the same model: Flower's plain torch net is lamploop's mlp.
    plain, built = _net().state_dict(), mlp({"sizes": list(SIZES), "seed": SEED}).state_dict()
    assert list(plain) == list(built)
    assert all(torch.equal(plain[k], built[k]) for k in plain)

    runs: dict[str, list[dict[str, Any]]] = {"lamploop": [], "flower": []}
    contenders = {"lamploop": lamploop_round_times, "flower": flower_round_times}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        _write_data(data)
        for repeat in range(repeats):
            order = ["lamploop", "flower"] if repeat % 2 == 0 else ["flower", "lamploop"]
            for system in order:
                load = os.getloadavg()
                with tempfile.TemporaryDirectory(dir=scratch) as workdir, _Runnable() as runnable:
                    result = contenders[system](
                        rounds, Path(workdir), data, own_sessions=not args.one_session
                    )
                server = result["round_s"][1:]  # round 0 warms up
                client = _client_intervals(result["client_starts"])
                run = {
                    "server_round_s": result["round_s"],
                    "client_starts": result["client_starts"],
                    "server_median_s": statistics.median(server),
                    "client_median_s": statistics.median(client),
                    "accuracy": _accuracy(result["model"], data),
                    "load_before": load,
                    "load_after": os.getloadavg(),
                    "runnable_median": runnable.median,
                    "client_cpu_median_s": statistics.median(_client_intervals(result["client_starts"], 1)),
                    # From the end of round 1 on: round 0 (warm-up) and the joining left out.
                    "server_cpu_median_s": statistics.median(
                        b - a for a, b in itertools.pairwise(result["cpu_at_round_end"])
                    ),
                }
                runs[system].append(run)
                print(
                    f"repeat {repeat} {system}: accuracy {run['accuracy']:.4f}, median ms per round: "
                    f"server {run['server_median_s'] * 1e3:.2f}, client {run['client_median_s'] * 1e3:.2f} "
                    f"(load average {load[0]:.2f}; runnable tasks, median {runnable.median})"
                )
    summary: dict[str, Any] = {}
    rows = []
    for system, results in runs.items():
        server_medians = [r["server_median_s"] for r in results]
        client_medians = [r["client_median_s"] for r in results]
        accuracies = [r["accuracy"] for r in results]
        client_cpu = [r["client_cpu_median_s"] for r in results]
        server_cpu = [r["server_cpu_median_s"] for r in results]
        summary[system] = {
            "server_round_s": summarize(server_medians),
            "client_interval_s": summarize(client_medians),
            "accuracy": summarize(accuracies),
            "pooled_server_round_s": summarize([t for r in results for t in r["server_round_s"][1:]]),
            "client_cpu_per_round_s": summarize(client_cpu),
            "server_cpu_per_round_s": summarize(server_cpu),
        }
        rows.append(
            [
                system,
                _spread(accuracies, digits=4),
                f"{_spread(server_medians, 1e3, 2)} ms",
                f"{_spread(client_medians, 1e3, 2)} ms",
                f"{_spread(client_cpu, 1e3, 2)} ms",
                f"{_spread(server_cpu, 1e3, 2)} ms",
            ]
        )
    ratios = {
        kind: [
            a[f"{kind}_median_s"] / b[f"{kind}_median_s"]
            for a, b in zip(runs["lamploop"], runs["flower"], strict=True)
        ]
        for kind in ("server", "client")
    }
    loads = [r["load_before"][0] for results in runs.values() for r in results]
    accuracy_gap = summary["lamploop"]["accuracy"]["median"] - summary["flower"]["accuracy"]["median"]
    what = f"{rounds} rounds x {LOCAL_EPOCHS} local epoch, {repeats} alternated repeat(s)"
    what += f", flwr {flwr.__version__}"
    what += ", every process in this session" if args.one_session else ", each process in its own session"
    headers = ["system", "final accuracy", "server round wall", "client round interval"]
    headers += ["client CPU", "server CPU"]
    print(f"\nFedAvg on non-IID digits, 3 nodes, {what}; median [min-max] of the repeats' medians")
    print_table(headers, rows)
    for kind, label in (("server", "server round wall"), ("client", "client round interval")):
        print(f"lamploop/Flower, {label}: {_spread(ratios[kind], digits=3)} (per-repeat ratios of medians)")
    verdict = "met" if statistics.median(ratios["server"]) <= TARGET_RATIO else "missed"
    print(f"target lamploop/Flower time per round <= {TARGET_RATIO} (server wall, median): {verdict}")
    print(
        f"accuracy lamploop - Flower: {accuracy_gap * 100:+.2f} points "
        f"({'equal' if accuracy_gap == 0 else 'not equal'})"
    )
    runnable = [
        r["runnable_median"] for results in runs.values() for r in results if r["runnable_median"] is not None
    ]
    print(f"load average (1 min) before each run: {min(loads):.2f}-{max(loads):.2f}, now {os.getloadavg()}")
    if runnable:
        span = f"{min(runnable)}-{max(runnable)}"
        print(f"runnable tasks during the runs (medians, these runs' own included): {span}")
    print("(client and server CPU: a process's CPU seconds per round, median; the rounds timed above)")
    if args.json is not None:
        write_json(
            args.json,
            {
                "rounds": rounds,
                "repeats": repeats,
                "own_sessions": not args.one_session,
                "flwr": flwr.__version__,
                "runs": runs,
                "summary": summary,
                "ratio_server_round": summarize(ratios["server"]),
                "ratio_client_interval": summarize(ratios["client"]),
                "ratios": ratios,
                "verdict_time": verdict,
                "accuracy_gap": accuracy_gap,
                "load_1min_before_runs": loads,
                "runnable_medians": runnable,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
