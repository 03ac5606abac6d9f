"""Acceptance tests of ``lamploop.federated``, written from its documentation alone.

Sources: docs/federated.md, docs/api/federated.md (the modules' docstrings) and docs/api/errors.md.
Every federation here is real: an aggregator and its nodes as tasks of one process, talking
TCP over 127.0.0.1 (TLS in one test), with small float64 models and data made in the test.
The references are computed by hand: each node's local training with plain torch (SGD on the
batch-mean loss over the node's own batches, epoch ``r * local_epochs + e`` of round ``r``),
FedAvg ``sum_i n_i p_i / sum_i n_i`` in float64, pooled validation over every example.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import ssl
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from anyio.abc import SocketStream
from torch import nn

from lamploop import BatchContext, tensor_batches
from lamploop.checkpoint import load_checkpoint
from lamploop.cli import main as cli_main
from lamploop.errors import (
    ConfigurationError,
    FederatedError,
    HandshakeError,
    LamploopError,
    PlanNotApprovedError,
)
from lamploop.federated import (
    AggregatorSettings,
    AllowList,
    FederatedResult,
    ModelDescription,
    NodeSettings,
    NodeSummary,
    OptimizerConfig,
    RoundRecord,
    TrainingPlan,
    approve_plan,
    federated_average,
    load_allow_list,
    load_plan,
    mlp,
    plan_from_json,
    plan_hash,
    plan_to_json,
    run_aggregator,
    run_node,
    save_allow_list,
    save_plan,
    wire,
)
from lamploop.federated.plan import canonical_json
from lamploop.federated.records import rounds_to_json
from lamploop.modelspec import model_spec

TOKEN = "acceptance-token"
OPTIONS: dict[str, Any] = {"sizes": [4, 5, 3], "seed": 0, "dtype": "float64"}
TOLERANCE = 1e-12


# --------------------------------------------------------------------------------------------
# Plans, data and nodes
# --------------------------------------------------------------------------------------------


def make_plan(**changes: Any) -> TrainingPlan:
    fields: dict[str, Any] = {
        "name": "acceptance-mlp",
        "model": ModelDescription("mlp", OPTIONS, model_spec(mlp(OPTIONS))),
        "optimizer": OptimizerConfig("sgd", learning_rate=0.1),
        "local_epochs": 1,
        "optimizer_state": "reset",
    }
    fields.update(changes)
    return TrainingPlan(**fields)


def examples(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=generator)
    return x, y


class Stall:
    """A training stream factory whose first ``times`` streams wait ``seconds`` (forever: inf)
    before their first batch: a node frozen, slow, or about to be killed mid-round."""

    def __init__(self, factory: Callable[[BatchContext], Any], *, seconds: float = math.inf, times: int = 1):
        self.factory = factory
        self.seconds = seconds
        self.times = times
        self.calls = 0
        self.started = anyio.Event()

    def __call__(self, context: BatchContext) -> Any:
        self.calls += 1
        if self.calls > self.times:
            return self.factory(context)
        return self._stalled(context)

    async def _stalled(self, context: BatchContext) -> Any:
        self.started.set()
        if math.isinf(self.seconds):
            await anyio.sleep_forever()
        await anyio.sleep(self.seconds)
        async for batch in self.factory(context):
            yield batch


@dataclass
class Node:
    name: str
    seed: int
    n_train: int
    allow_list: Path
    n_valid: int = 6
    batch_size: int = 4
    token: str = TOKEN
    builders: Mapping[str, Callable[[Mapping[str, Any]], nn.Module]] | None = None
    stall: Stall | None = None
    validation: bool = True
    settings: NodeSettings = field(
        default_factory=lambda: NodeSettings(connect_timeout=10, retry_interval=0.05)
    )

    def __post_init__(self) -> None:
        self.x, self.y = examples(self.seed, self.n_train)
        self.xv, self.yv = examples(self.seed + 1000, self.n_valid)
        self.train_batches = tensor_batches(self.x, self.y, batch_size=self.batch_size, seed=self.seed)
        self.validation_batches = tensor_batches(self.xv, self.yv, batch_size=5, shuffle=False)

    def stalled(self, **kwargs: Any) -> Node:
        self.stall = Stall(self.train_batches, **kwargs)
        return self


def approved(tmp_path: Path, name: str, plan: TrainingPlan | None) -> Path:
    """A node's allow-list file: with ``plan`` approved, or empty."""
    path = tmp_path / f"{name}-allow.json"
    if plan is None:
        save_allow_list(AllowList(), path)
    else:
        approve_plan(plan, path)
    return path


async def serve_node(node: Node, port: int, **kwargs: Any) -> NodeSummary:
    return await run_node(
        name=node.name,
        host="127.0.0.1",
        port=port,
        token=node.token,
        allow_list=node.allow_list,
        train_batches=node.stall if node.stall is not None else node.train_batches,
        validation_batches=node.validation_batches if node.validation else None,
        builders=node.builders,
        settings=node.settings,
        **kwargs,
    )


@dataclass
class Outcome:
    result: FederatedResult | None = None
    error: BaseException | None = None
    summaries: dict[str, NodeSummary | BaseException | str] = field(default_factory=dict)
    port: int | None = None
    records: list[RoundRecord] = field(default_factory=list)
    round_times: list[float] = field(default_factory=list)
    listened: bool = False
    ended: dict[str, anyio.Event] = field(default_factory=dict)


async def federate(
    plan: TrainingPlan,
    nodes: list[Node],
    settings: AggregatorSettings,
    *,
    held: tuple[Node, ...] = (),
    initial_model: Any = None,
    on_round: Callable[[RoundRecord], object] | None = None,
    during: Callable[[Outcome, dict[str, anyio.CancelScope]], Awaitable[None]] | None = None,
    ssl_server: ssl.SSLContext | None = None,
    ssl_client: ssl.SSLContext | None = None,
    port: int = 0,
    grace: float = 5.0,
    limit: float = 20.0,
) -> Outcome:
    """Run the aggregator and ``nodes`` as tasks; ``during`` runs once it listens, then the
    ``held`` nodes start. Nodes still running ``grace`` s after the aggregator ended are
    cancelled (their summary reads ``"cancelled"``)."""
    outcome = Outcome()
    listening = anyio.Event()
    aggregator_done = anyio.Event()
    scopes: dict[str, anyio.CancelScope] = {}
    everyone = [*nodes, *held]
    outcome.ended = {node.name: anyio.Event() for node in everyone}

    def on_listening(value: int) -> None:
        outcome.port = value
        outcome.listened = True
        listening.set()

    def record(value: RoundRecord) -> object:
        outcome.records.append(value)
        outcome.round_times.append(time.monotonic())
        return on_round(value) if on_round is not None else None

    async def aggregator() -> None:
        try:
            outcome.result = await run_aggregator(
                plan=plan,
                initial_model=mlp(OPTIONS) if initial_model is None else initial_model,
                token=TOKEN,
                settings=settings,
                port=port,
                ssl_context=ssl_server,
                on_listening=on_listening,
                on_round=record,
            )
        except Exception as error:
            outcome.error = error
        finally:
            aggregator_done.set()
            listening.set()

    async def node_task(node: Node, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                try:
                    assert outcome.port is not None
                    extra = {"ssl_context": ssl_client} if ssl_client is not None else {}
                    outcome.summaries[node.name] = await serve_node(node, outcome.port, **extra)
                except Exception as error:
                    outcome.summaries[node.name] = error
                return
            outcome.summaries[node.name] = "cancelled"
        finally:
            outcome.ended[node.name].set()

    with anyio.fail_after(limit):
        async with anyio.create_task_group() as group:
            group.start_soon(aggregator)
            await listening.wait()
            if outcome.listened:
                for node in nodes:
                    scopes[node.name] = anyio.CancelScope()
                    group.start_soon(node_task, node, scopes[node.name])
                if during is not None:
                    await during(outcome, scopes)
                for node in held:
                    scopes[node.name] = anyio.CancelScope()
                    group.start_soon(node_task, node, scopes[node.name])
            await aggregator_done.wait()
            with anyio.move_on_after(grace):
                for name in scopes:
                    await outcome.ended[name].wait()
            for scope in scopes.values():
                scope.cancel()
    return outcome


# --------------------------------------------------------------------------------------------
# The reference, by hand
# --------------------------------------------------------------------------------------------


@dataclass
class Eval:
    loss_sum: float
    correct: int
    examples: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.examples

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples


def evaluate(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Eval:
    module.eval()
    with torch.no_grad():
        out = module(x)
        return Eval(F.cross_entropy(out, y, reduction="sum").item(), int((out.argmax(1) == y).sum()), len(y))


@dataclass
class Answer:
    state: dict[str, torch.Tensor]
    sample_count: int
    training_loss: float
    before: Eval
    after: Eval


class Replica:
    """One node's local training by hand: torch's SGD on each batch's mean cross-entropy."""

    def __init__(self, node: Node, plan: TrainingPlan, build: Callable[[], nn.Module] = lambda: mlp(OPTIONS)):
        self.node = node
        self.plan = plan
        self.build = build
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    async def train(self, global_state: Mapping[str, torch.Tensor], round_: int) -> Answer:
        if self.module is None or self.plan.optimizer_state == "reset":
            self.module = self.build()
            config = self.plan.optimizer
            assert config.name == "sgd"
            self.optimizer = torch.optim.SGD(
                self.module.parameters(), lr=config.learning_rate, momentum=config.momentum
            )
        assert self.optimizer is not None
        module = self.module
        module.load_state_dict(global_state)
        before = evaluate(module, self.node.xv, self.node.yv)
        module.train()
        loss_sum, count, steps = 0.0, 0, 0
        epochs = self.plan.local_epochs
        epoch = round_ * epochs if epochs is not None else 0
        while True:
            async for x, y in self.node.train_batches(BatchContext(epoch=epoch)):
                self.optimizer.zero_grad()
                loss = F.cross_entropy(module(x), y, reduction="sum")
                (loss / len(y)).backward()
                self.optimizer.step()
                loss_sum += loss.item()
                count += len(y)
                steps += 1
                if self.plan.local_steps is not None and steps == self.plan.local_steps:
                    break
            epoch += 1
            if self.plan.local_steps is not None and steps == self.plan.local_steps:
                break
            if epochs is not None and epoch == (round_ + 1) * epochs:
                break
        after = evaluate(module, self.node.xv, self.node.yv)
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return Answer(state, count, loss_sum / count, before, after)


def fedavg_by_hand(
    global_state: Mapping[str, torch.Tensor], answers: list[Answer], names: set[str]
) -> dict[str, torch.Tensor]:
    total = sum(a.sample_count for a in answers)
    new = {}
    for key, value in global_state.items():
        if key not in names:
            new[key] = value.clone()
            continue
        acc = sum(a.sample_count * a.state[key].to(torch.float64) for a in answers) / total
        new[key] = acc.round().to(value.dtype) if not value.is_floating_point() else acc.to(value.dtype)
    return new


def parameter_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters()}


async def reference_rounds(
    plan: TrainingPlan,
    replicas: dict[str, Replica],
    answering: list[list[str]],
    initial: Mapping[str, torch.Tensor],
    names: set[str],
) -> tuple[dict[str, torch.Tensor], list[dict[str, Answer]], list[dict[str, torch.Tensor]]]:
    """FedAvg by hand over the rounds; ``answering[r]``: the nodes averaged in round r."""
    state = {k: v.clone() for k, v in initial.items()}
    per_round, globals_ = [], []
    for r, who in enumerate(answering):
        globals_.append(state)
        answers = {name: await replicas[name].train(state, r) for name in who}
        per_round.append(answers)
        state = fedavg_by_hand(state, list(answers.values()), names)
    return state, per_round, globals_


def assert_state_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert actual[key].device.type == "cpu", key
        torch.testing.assert_close(actual[key], value, rtol=0, atol=TOLERANCE, msg=key)


def assert_state_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def drop_tracebacks(error: BaseException | None) -> BaseException | None:
    """``error`` without its tracebacks (and those of its context and group), so that what the
    failed run left behind is collected at the end of this test, not of the session."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        item.__traceback__ = None
        pending += [item.__context__, item.__cause__, *getattr(item, "exceptions", ())]
    return error


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --------------------------------------------------------------------------------------------
# The plan and its hash, approval, settings (no network)
# --------------------------------------------------------------------------------------------


def test_docs_plan_example_hash_and_approval(tmp_path: Path) -> None:
    # docs/federated.md "The training plan and its hash": the example, as written there.
    options = {"sizes": [64, 64, 10], "seed": 0}
    plan = TrainingPlan(
        name="digits-mlp",
        model=ModelDescription("mlp", options, model_spec(mlp(options))),
        optimizer=OptimizerConfig("sgd", learning_rate=0.05, momentum=0.9),
        local_epochs=1,
        optimizer_state="reset",
    )
    path = save_plan(plan, tmp_path / "plan.json")
    assert load_plan(path) == plan
    digest, added = approve_plan(plan, tmp_path / "allow.json")
    assert added
    assert digest == plan_hash(plan)
    assert load_allow_list(tmp_path / "allow.json").allows(digest)
    assert approve_plan(plan, tmp_path / "allow.json") == (digest, False)  # approved already
    faster = TrainingPlan(
        name="digits-mlp", model=plan.model, optimizer=OptimizerConfig("sgd", learning_rate=0.5, momentum=0.9)
    )
    assert plan_hash(faster) != digest
    assert not load_allow_list(tmp_path / "allow.json").allows(plan_hash(faster))


def test_plan_hash_is_sha256_of_sorted_compact_json() -> None:
    # "Its hash is the sha256 of its canonical JSON" (cattrs, sorted keys, no whitespace).
    plan = make_plan()
    obj = plan_to_json(plan)
    expected_bytes = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    assert canonical_json(obj) == expected_bytes
    assert plan_hash(plan) == hashlib.sha256(expected_bytes).hexdigest()
    assert plan_from_json(json.loads(json.dumps(obj))) == plan


def test_anything_that_changes_training_changes_the_hash() -> None:
    # "anything that changes how a node would train changes the hash"
    base = make_plan()
    other_options = {**OPTIONS, "seed": 1}
    variants = {
        "learning_rate": make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.2)),
        "momentum": make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.1, momentum=0.5)),
        "weight_decay": make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.1, weight_decay=0.01)),
        "optimizer": make_plan(optimizer=OptimizerConfig("adam", learning_rate=0.1)),
        "loss": make_plan(loss="mse"),
        "local_epochs": make_plan(local_epochs=2),
        "local_steps": make_plan(local_epochs=None, local_steps=3),
        "optimizer_state": make_plan(optimizer_state="keep"),
        "average": make_plan(average="parameters_and_buffers"),
        "seed": make_plan(seed=1),
        "model_options": make_plan(
            model=ModelDescription("mlp", other_options, model_spec(mlp(other_options)))
        ),
        "name": make_plan(name="another"),
    }
    hashes = {key: plan_hash(plan) for key, plan in variants.items()}
    assert plan_hash(base) not in hashes.values()
    assert len(set(hashes.values())) == len(hashes)
    assert plan_hash(make_plan()) == plan_hash(base)  # and the same plan, the same hash


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"local_epochs": 1, "local_steps": 3}, id="both-epochs-and-steps"),
        pytest.param({"local_epochs": None, "local_steps": None}, id="neither-epochs-nor-steps"),
        pytest.param({"local_epochs": 0}, id="zero-epochs"),
        pytest.param({"loss": "hinge"}, id="unknown-loss"),
        pytest.param({"optimizer_state": "forget"}, id="unknown-optimizer-state"),
        pytest.param({"average": "everything"}, id="unknown-average"),
        pytest.param({"metrics": ("f1",)}, id="unknown-metric"),
    ],
)
def test_plan_out_of_range_is_a_configuration_error(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        make_plan(**changes)
    assert isinstance(caught.value, ValueError)  # docs/api/errors.md: bad arguments are ValueErrors too
    assert isinstance(caught.value, LamploopError)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"name": "rmsprop", "learning_rate": 0.1}, id="unknown-optimizer"),
        pytest.param({"name": "sgd", "learning_rate": 0.0}, id="zero-learning-rate"),
        pytest.param({"name": "sgd", "learning_rate": -0.1}, id="negative-learning-rate"),
    ],
)
def test_optimizer_config_out_of_range(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        OptimizerConfig(**config)


def test_plan_from_json_is_strict_and_names_where_and_field() -> None:
    obj = plan_to_json(make_plan())
    with pytest.raises(ConfigurationError, match=r"my-plan\.json") as caught:
        plan_from_json({**obj, "surprise": 1}, where="my-plan.json")
    assert "surprise" in str(caught.value)
    as_string = json.loads(json.dumps(obj))
    as_string["optimizer"]["learning_rate"] = "0.1"
    with pytest.raises(ConfigurationError, match="learning_rate"):
        plan_from_json(as_string)


def test_plan_and_allow_list_files_errors_start_with_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigurationError) as caught:
        load_plan(missing)
    assert str(caught.value).startswith(str(missing))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ConfigurationError) as caught:
        load_plan(garbage)
    assert str(caught.value).startswith(str(garbage))
    with pytest.raises(ConfigurationError) as caught:
        load_allow_list(missing)
    assert str(caught.value).startswith(str(missing))
    assert not load_allow_list(missing, missing_ok=True).allows(plan_hash(make_plan()))
    with pytest.raises(ConfigurationError) as caught:
        load_allow_list(garbage)
    assert str(caught.value).startswith(str(garbage))
    with pytest.raises(ConfigurationError):
        approve_plan(make_plan(), garbage)  # "the existing file is not an allow-list"


def test_cli_approve_prints_hash_name_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # docs/federated.md "Approving a plan": the command and its output line.
    plan = make_plan()
    plan_path = save_plan(plan, tmp_path / "plan.json")
    allow = tmp_path / "etc" / "allow.json"
    assert cli_main(["federated", "approve", str(plan_path), "--allow-list", str(allow)]) == 0
    out = capsys.readouterr().out
    assert f"approved: {plan_hash(plan)} ({plan.name}) in {allow}" in out.splitlines()
    assert load_allow_list(allow).allows(plan_hash(plan))


@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [
        (AggregatorSettings, "rounds", -1),
        (AggregatorSettings, "min_nodes", 0),
        (AggregatorSettings, "join_timeout", -1.0),
        (AggregatorSettings, "round_timeout", 0.0),
        (AggregatorSettings, "round_attempts", 0),
        (AggregatorSettings, "handshake_timeout", 0.0),
        (AggregatorSettings, "max_pending_handshakes", 0),
        (AggregatorSettings, "max_frame_bytes", 0),
        (AggregatorSettings, "keep_last", 0),
        (NodeSettings, "connect_timeout", -1.0),
        (NodeSettings, "retry_interval", 0.0),
        (NodeSettings, "handshake_timeout", 0.0),
        (NodeSettings, "idle_timeout", 0.0),
        (NodeSettings, "max_frame_bytes", 0),
    ],
)
def test_settings_checks_name_field_and_value(cls: type, name: str, value: object) -> None:
    # settings module: "every check names the field and the bad value and raises ConfigurationError"
    kwargs: dict[str, Any] = {"rounds": 1} if cls is AggregatorSettings else {}
    kwargs[name] = value
    with pytest.raises(ConfigurationError) as caught:
        cls(**kwargs)
    message = str(caught.value)
    assert name in message
    assert str(value) in message or repr(value) in message


# --------------------------------------------------------------------------------------------
# FedAvg itself
# --------------------------------------------------------------------------------------------


def test_federated_average_accumulates_in_float64_and_rounds_integer_buffers() -> None:
    tiny = 2.0**-24
    global_model = {
        "w": torch.tensor([0.0], dtype=torch.float32),
        "count": torch.tensor(0, dtype=torch.int64),
        "kept": torch.tensor([7.0], dtype=torch.float32),
    }

    def update(w: float, count: int) -> dict[str, torch.Tensor]:
        return {
            "w": torch.tensor([w], dtype=torch.float32),
            "count": torch.tensor(count, dtype=torch.int64),
            "kept": torch.tensor([-1.0], dtype=torch.float32),
        }

    updates = [("a", 1, update(1.0, 1)), ("b", 1, update(tiny, 4)), ("c", 1, update(tiny, 4))]
    new = federated_average(global_model, updates, names=frozenset({"w", "count"}))
    by_hand = torch.tensor([(1.0 + 2 * tiny) / 3], dtype=torch.float64).to(torch.float32)
    in_float32 = (torch.tensor([1.0]) + tiny + tiny) / 3
    assert not torch.equal(by_hand, in_float32)  # the case tells the two accumulations apart
    assert new["w"].dtype == torch.float32
    assert torch.equal(new["w"], by_hand)
    assert new["count"].dtype == torch.int64
    assert int(new["count"]) == 3  # 9 / 3
    assert torch.equal(new["kept"], global_model["kept"])  # not averaged: the global model's value
    # weights: (2 * 1 + 1 * 2) / 3 = 1.33 -> 1 and (1 * 1 + 2 * 2) / 3 = 1.67 -> 2 (rounded, not cut)
    low = federated_average(
        global_model, [("a", 2, update(0.0, 1)), ("b", 1, update(0.0, 2))], names=frozenset({"count"})
    )
    high = federated_average(
        global_model, [("a", 1, update(0.0, 1)), ("b", 2, update(0.0, 2))], names=frozenset({"count"})
    )
    assert (int(low["count"]), int(high["count"])) == (1, 2)
    shuffled = federated_average(global_model, updates[::-1], names=frozenset({"w", "count"}))
    assert torch.equal(shuffled["w"], new["w"])


def test_federated_average_errors_name_node_and_tensor() -> None:
    global_model = {"w": torch.zeros(2, dtype=torch.float64)}
    with pytest.raises(FederatedError):
        federated_average(global_model, [], names=frozenset({"w"}))
    with pytest.raises(FederatedError):
        federated_average(
            global_model, [("a", 0, {"w": torch.ones(2, dtype=torch.float64)})], names=frozenset({"w"})
        )
    with pytest.raises(FederatedError) as caught:
        federated_average(
            global_model,
            [
                ("good", 1, {"w": torch.ones(2, dtype=torch.float64)}),
                ("odd", 1, {"w": torch.ones(3, dtype=torch.float64)}),
            ],
            names=frozenset({"w"}),
        )
    assert "odd" in str(caught.value)
    assert "w" in str(caught.value)


# --------------------------------------------------------------------------------------------
# Happy path: FedAvg over real nodes equals FedAvg by hand
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer_state", ["reset", "keep"])
async def test_rounds_equal_fedavg_by_hand(tmp_path: Path, optimizer_state: str) -> None:
    plan = make_plan(
        optimizer=OptimizerConfig("sgd", learning_rate=0.1, momentum=0.9),
        local_epochs=2,
        optimizer_state=optimizer_state,
    )
    nodes = [
        Node("node-c", seed=3, n_train=6, allow_list=approved(tmp_path, "c", plan), n_valid=4),
        Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan)),
    ]
    late = Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", plan), n_valid=9)

    async def wait(outcome: Outcome, scopes: object) -> None:
        await anyio.sleep(0.3)  # node-b joins late: round 0 waits for expected_nodes

    settings = AggregatorSettings(rounds=2, min_nodes=2, expected_nodes=3, round_timeout=30, join_timeout=10)
    started = time.monotonic()
    outcome = await federate(plan, nodes, settings, held=(late,), during=wait)
    elapsed = time.monotonic() - started
    assert outcome.error is None, outcome.error
    result = outcome.result
    assert result is not None

    everyone = sorted([*nodes, late], key=lambda n: n.name)
    replicas = {n.name: Replica(n, plan) for n in everyone}
    names = [n.name for n in everyone]
    initial = state_of(mlp(OPTIONS))
    final, per_round, globals_ = await reference_rounds(
        plan, replicas, [names, names], initial, parameter_names(mlp(OPTIONS))
    )
    assert result.plan_hash == plan_hash(plan)
    assert_state_close(result.model, final)
    if optimizer_state == "keep":  # the test tells keep from reset apart
        reset = make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.1, momentum=0.9), local_epochs=2)
        other, _, _ = await reference_rounds(
            reset,
            {n.name: Replica(n, reset) for n in everyone},
            [names, names],
            initial,
            parameter_names(mlp(OPTIONS)),
        )
        assert not torch.allclose(other["0.weight"], final["0.weight"], rtol=0, atol=1e-6)

    assert [r.round for r in result.rounds] == [0, 1]
    assert outcome.records == list(result.rounds)  # on_round saw every record, in order
    for r, record in enumerate(result.rounds):
        assert record.attempts == 1
        assert record.missing == ()
        assert [a.node for a in record.answered] == names  # in name order
        assert 0 < record.wall_s < elapsed
        total = 0
        for report in record.answered:
            node = next(n for n in everyone if n.name == report.node)
            answer = per_round[r][report.node]
            assert report.sample_count == node.n_train * 2 == answer.sample_count
            assert report.training_loss == pytest.approx(answer.training_loss, rel=1e-12)
            assert report.train_wall_s >= 0
            assert report.train_cpu_s >= 0
            assert report.before is not None
            assert report.after is not None
            assert report.before.examples == report.after.examples == node.n_valid
            assert report.before.loss == pytest.approx(answer.before.loss, rel=1e-12)
            assert report.before.metrics["accuracy"] == pytest.approx(answer.before.accuracy)
            assert report.after.loss == pytest.approx(answer.after.loss, rel=1e-12)
            assert report.after.metrics["accuracy"] == pytest.approx(answer.after.accuracy)
            total += report.sample_count
        weighted = sum(a.sample_count * a.training_loss for a in per_round[r].values()) / total
        assert record.training_loss == pytest.approx(weighted, rel=1e-12)
        # validation before: the round's global model over every node's validation examples
        module = mlp(OPTIONS)
        module.load_state_dict(globals_[r])
        pooled = evaluate(module, torch.cat([n.xv for n in everyone]), torch.cat([n.yv for n in everyone]))
        assert record.validation_before is not None
        assert record.validation_before.examples == pooled.examples == sum(n.n_valid for n in everyone)
        assert record.validation_before.loss == pytest.approx(pooled.loss, rel=1e-12)
        assert record.validation_before.metrics["accuracy"] == pytest.approx(pooled.accuracy)
        after_sum = sum(a.after.loss_sum for a in per_round[r].values())
        after_correct = sum(a.after.correct for a in per_round[r].values())
        assert record.validation_after is not None
        assert record.validation_after.loss == pytest.approx(after_sum / pooled.examples, rel=1e-12)
        assert record.validation_after.metrics["accuracy"] == pytest.approx(after_correct / pooled.examples)
    for name in names:
        summary = outcome.summaries[name]
        assert isinstance(summary, NodeSummary), summary
        assert summary.trained == (0, 1)
        assert summary.refused == ()
        assert not summary.failed


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_local_steps_chain_the_streams_epochs(tmp_path: Path) -> None:
    # TrainingPlan.local_steps: "optimizer steps per round (the stream's epochs are chained)";
    # 10 examples in batches of 4 make 3 batches an epoch, so 5 steps are epoch 0 then 2 of epoch 1.
    # The node has no validation stream: "before: ... (None: the node has no validation data)",
    # RoundRecord.validation_before "(None without validation data)".
    plan = make_plan(local_epochs=None, local_steps=5)
    node = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan), validation=False)
    outcome = await federate(plan, [node], AggregatorSettings(rounds=1, round_timeout=30, join_timeout=10))
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    answer = await Replica(node, plan).train(state_of(mlp(OPTIONS)), 0)
    assert answer.sample_count == 4 + 4 + 2 + 4 + 4
    (record,) = outcome.result.rounds
    (report,) = record.answered
    assert report.sample_count == answer.sample_count
    assert report.training_loss == pytest.approx(answer.training_loss, rel=1e-12)
    assert report.before is None
    assert report.after is None
    assert record.validation_before is None
    assert record.validation_after is None
    assert_state_close(outcome.result.model, answer.state)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_node_joining_during_the_round_gets_it(tmp_path: Path) -> None:
    # "send the round number, the training plan and the global model to every connected node,
    # and to any node that joins during the round"; node-a keeps round 0 open for 0.6 s.
    plan = make_plan()
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan)).stalled(seconds=0.6)
    b = Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", plan))

    async def round_0_under_way(outcome: Outcome, scopes: object) -> None:
        assert a.stall is not None
        with anyio.fail_after(10):
            await a.stall.started.wait()

    outcome = await federate(
        plan,
        [a],
        AggregatorSettings(rounds=1, min_nodes=1, round_timeout=30, join_timeout=10),
        held=(b,),
        during=round_0_under_way,
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a", "node-b"]
    replicas = {n.name: Replica(n, plan) for n in (a, b)}
    final, _, _ = await reference_rounds(
        plan, replicas, [["node-a", "node-b"]], state_of(mlp(OPTIONS)), parameter_names(mlp(OPTIONS))
    )
    assert_state_close(outcome.result.model, final)


def bn_net(options: Mapping[str, Any]) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(options["seed"])
        return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3)).double()


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("average", ["parameters", "parameters_and_buffers"])
async def test_average_parameters_or_buffers_too(tmp_path: Path, average: str) -> None:
    # "what is averaged (parameters, or parameters_and_buffers)"; fedavg: "Tensors that are not
    # averaged (buffers, when the plan averages parameters only) keep the global model's value",
    # "integer buffers are rounded". A custom architecture from the nodes' own registries.
    options = {"seed": 5}
    builders = {"bn-net": bn_net}
    plan = make_plan(model=ModelDescription("bn-net", options, model_spec(bn_net(options))), average=average)
    nodes = [
        Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan), builders=builders),
        Node("node-b", seed=2, n_train=6, allow_list=approved(tmp_path, "b", plan), builders=builders),
    ]
    outcome = await federate(
        plan,
        nodes,
        AggregatorSettings(rounds=1, min_nodes=2, round_timeout=30, join_timeout=10),
        initial_model=bn_net(options),
    )
    assert drop_tracebacks(outcome.error) is None, outcome.error
    assert outcome.result is not None
    initial = state_of(bn_net(options))
    answers = [await Replica(n, plan, lambda: bn_net(options)).train(initial, 0) for n in nodes]
    module = bn_net(options)
    names = parameter_names(module) | (
        {k for k, _ in module.named_buffers()} if average != "parameters" else set()
    )
    expected = fedavg_by_hand(initial, answers, names)
    assert_state_close(outcome.result.model, expected)
    counts = [int(a.state["1.num_batches_tracked"]) for a in answers]
    assert counts == [3, 2]
    if average == "parameters":
        assert_state_equal(
            {k: outcome.result.model[k] for k in ("1.running_mean", "1.running_var")},
            {k: initial[k] for k in ("1.running_mean", "1.running_var")},
        )
        assert int(outcome.result.model["1.num_batches_tracked"]) == 0
    else:
        assert int(outcome.result.model["1.num_batches_tracked"]) == 3  # (10 * 3 + 6 * 2) / 16 = 2.6


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_tls_round_equals_fedavg_by_hand(tmp_path: Path) -> None:
    # "Both take an optional ssl_context (a server context on the aggregator, a client context
    # on the nodes) to run TLS under lamploop's own handshake."
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    plan = make_plan()
    node = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    outcome = await federate(
        plan,
        [node],
        AggregatorSettings(rounds=1, round_timeout=30, join_timeout=10),
        ssl_server=server,
        ssl_client=client,
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    answer = await Replica(node, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_node_retries_until_the_aggregator_listens(tmp_path: Path) -> None:
    # node module: "The node connects out ... and retries until the aggregator listens"
    plan = make_plan()
    node = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    summaries: list[NodeSummary] = []
    results: list[FederatedResult] = []

    async def node_task() -> None:
        summaries.append(await serve_node(node, port))

    async def aggregator_task() -> None:
        results.append(
            await run_aggregator(
                plan=plan,
                initial_model=mlp(OPTIONS),
                token=TOKEN,
                port=port,
                settings=AggregatorSettings(rounds=1, round_timeout=30, join_timeout=10),
            )
        )

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(node_task)
            await anyio.sleep(0.5)
            group.start_soon(aggregator_task)
    assert summaries[0].trained == (0,)
    answer = await Replica(node, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(results[0].model, answer.state)


# --------------------------------------------------------------------------------------------
# Allow-list: refusal, naming the hash; re-read every round
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_plan_not_on_allow_list_fails_with_plan_not_approved_error(tmp_path: Path) -> None:
    plan = make_plan()
    digest = plan_hash(plan)
    node = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", None))
    outcome = await federate(plan, [node], AggregatorSettings(rounds=2, round_timeout=30, join_timeout=10))
    assert isinstance(outcome.error, PlanNotApprovedError), outcome.error
    assert outcome.error.plan_hash == digest
    assert digest in str(outcome.error)
    assert outcome.result is None
    assert outcome.records == []
    summary = outcome.summaries["node-a"]
    assert isinstance(summary, NodeSummary), summary
    assert summary.trained == ()
    assert summary.refused == (0,)
    assert summary.failed


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_refusal_is_named_with_hash_and_allow_list_is_read_every_round(tmp_path: Path) -> None:
    # "check that the plan's hash is on the node's allow-list, else refuse the round, naming the
    # hash (in the node's log and in the aggregator's record)"; the allow-list is "read again at
    # every round, so an approval or a removal needs no restart".
    plan = make_plan()
    digest = plan_hash(plan)
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    b = Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", None))

    def on_round(record: RoundRecord) -> None:
        if record.round == 0:
            approve_plan(plan, b.allow_list)
        elif record.round == 1:
            save_allow_list(AllowList(), a.allow_list)

    outcome = await federate(
        plan,
        [a, b],
        AggregatorSettings(rounds=3, min_nodes=1, expected_nodes=2, round_timeout=30, join_timeout=10),
        on_round=on_round,
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    r0, r1, r2 = outcome.result.rounds
    assert [x.node for x in r0.answered] == ["node-a"]
    assert [m.node for m in r0.missing] == ["node-b"]
    assert digest in r0.missing[0].why
    assert [x.node for x in r1.answered] == ["node-a", "node-b"]
    assert r1.missing == ()
    assert [x.node for x in r2.answered] == ["node-b"]
    assert [m.node for m in r2.missing] == ["node-a"]
    assert digest in r2.missing[0].why
    sa, sb = outcome.summaries["node-a"], outcome.summaries["node-b"]
    assert isinstance(sa, NodeSummary), sa
    assert isinstance(sb, NodeSummary), sb
    assert (sa.trained, sa.refused) == ((0, 1), (2,))
    assert (sb.trained, sb.refused) == ((1, 2), (0,))
    # and round 0 is FedAvg of node-a alone
    replicas = {n.name: Replica(n, plan) for n in (a, b)}
    final, _, _ = await reference_rounds(
        plan,
        replicas,
        [["node-a"], ["node-a", "node-b"], ["node-b"]],
        state_of(mlp(OPTIONS)),
        parameter_names(mlp(OPTIONS)),
    )
    assert_state_close(outcome.result.model, final)


def wrong_mlp(options: Mapping[str, Any]) -> nn.Module:
    return mlp({**options, "sizes": [4, 6, 3]})


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["model-does-not-match", "architecture-unknown-here"])
async def test_node_refuses_a_model_it_cannot_build(tmp_path: Path, case: str) -> None:
    # "build the plan's model from the node's own registry of architectures (no code travels)
    # and check that it has exactly the plan's tensors"; refused rounds are named in the record.
    if case == "model-does-not-match":
        plan = make_plan()
        good_builders, bad_builders = None, {"mlp": wrong_mlp}
    else:
        plan = make_plan()
        good_builders, bad_builders = None, {"other": mlp}
    good = Node(
        "node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan), builders=good_builders
    )
    bad = Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", plan), builders=bad_builders)
    outcome = await federate(
        plan,
        [good, bad],
        AggregatorSettings(rounds=1, min_nodes=1, expected_nodes=2, round_timeout=30, join_timeout=10),
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a"]
    assert [m.node for m in record.missing] == ["node-b"]
    assert record.missing[0].why
    summary = outcome.summaries["node-b"]
    assert isinstance(summary, NodeSummary), summary
    assert summary.refused == (0,)
    answer = await Replica(good, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


# --------------------------------------------------------------------------------------------
# The token
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_wrong_token_is_refused_and_changes_no_round(tmp_path: Path) -> None:
    plan = make_plan()
    stranger = Node(
        "node-x", seed=9, n_train=10, allow_list=approved(tmp_path, "x", plan), token="not-the-token"
    )
    good = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))

    async def stranger_first(outcome: Outcome, scopes: object) -> None:
        with anyio.fail_after(10):
            await outcome.ended["node-x"].wait()

    outcome = await federate(
        plan,
        [stranger],
        AggregatorSettings(rounds=1, round_timeout=30, join_timeout=10),
        held=(good,),
        during=stranger_first,
    )
    assert isinstance(outcome.summaries["node-x"], HandshakeError), outcome.summaries["node-x"]
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a"]
    assert record.missing == ()
    answer = await Replica(good, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


async def read_frame(stream: SocketStream, buffer: bytearray) -> Any:
    while len(buffer) < 4:
        buffer += await stream.receive()
    (length,) = struct.unpack(">I", bytes(buffer[:4]))
    while len(buffer) < 4 + length:
        buffer += await stream.receive()
    body = bytes(buffer[4 : 4 + length])
    del buffer[: 4 + length]
    return wire.decode_body(body)


async def closed_by_peer(stream: SocketStream) -> bool:
    """Read (and drop) until the peer closes: True then."""
    try:
        while True:
            await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
        return True


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("welcome", ["bad-proof", "silent"])
async def test_node_refuses_an_aggregator_that_does_not_prove_the_token(tmp_path: Path, welcome: str) -> None:
    # "What it refuses: ... an aggregator that does not prove the token"; run_node raises
    # HandshakeError (bad proof), or FederatedError "silent for idle_timeout seconds" once joined.
    plan = make_plan()
    node = Node(
        "node-a",
        seed=1,
        n_train=10,
        allow_list=approved(tmp_path, "a", plan),
        settings=NodeSettings(connect_timeout=3, retry_interval=0.05, handshake_timeout=3, idle_timeout=0.5),
    )
    hellos: list[tuple[str, Any]] = []

    async def fake_aggregator(stream: SocketStream) -> None:
        async with stream:
            buffer = bytearray()
            nonce = secrets.token_hex(32)
            await stream.send(wire.encode_frame(wire.Challenge(wire.PROTOCOL_VERSION, nonce)))
            hello = await read_frame(stream, buffer)
            hellos.append((nonce, hello))
            if welcome == "bad-proof":
                await stream.send(wire.encode_frame(wire.Welcome("0" * 64)))
            else:
                proof = wire.aggregator_proof(TOKEN.encode(), aggregator_nonce=nonce, hello=hello)
                await stream.send(wire.encode_frame(wire.Welcome(proof)))
            with anyio.move_on_after(10):
                await closed_by_peer(stream)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    with anyio.fail_after(15):
        async with listener, anyio.create_task_group() as group:
            group.start_soon(listener.serve, fake_aggregator)
            started = time.monotonic()
            with pytest.raises((HandshakeError, FederatedError)) as caught:
                await serve_node(node, port)
            elapsed = time.monotonic() - started
            group.cancel_scope.cancel()
    assert hellos, "the node never said hello"
    # the node proved the token itself: HMAC-SHA256 under the token
    nonce, hello = hellos[0]
    assert hello.node == "node-a"
    assert hello.proof == wire.node_proof(TOKEN.encode(), aggregator_nonce=nonce, hello=hello)
    if welcome == "bad-proof":
        assert isinstance(caught.value, HandshakeError), caught.value
        assert elapsed < 2.5  # refused at once, not retried until connect_timeout
    else:
        assert isinstance(caught.value, FederatedError), caught.value
        assert elapsed < 2.5


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_node_gives_up_after_connect_timeout(tmp_path: Path) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    node = Node(
        "node-a",
        seed=1,
        n_train=10,
        allow_list=approved(tmp_path, "a", make_plan()),
        settings=NodeSettings(connect_timeout=0.5, retry_interval=0.05),
    )
    started = time.monotonic()
    with anyio.fail_after(10), pytest.raises(FederatedError):
        await serve_node(node, port)
    assert 0.4 < time.monotonic() - started < 5


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_strangers_are_refused_and_never_touch_a_round(tmp_path: Path) -> None:
    # "What it refuses and logs: a wrong token, garbage, a frame over the size limit (4 KiB until
    # the peer proved the token), a connection that does not finish its handshake within
    # handshake_timeout, and too many handshakes at once (the oldest is dropped). None of them
    # changes a round."
    plan = make_plan()
    good = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    handshake_timeout = 1.5
    timings: dict[str, float] = {}

    async def poke(outcome: Outcome, scopes: object) -> None:
        assert outcome.port is not None
        port = outcome.port
        for name, data in [
            ("garbage", struct.pack(">I", 7) + b"garbage"),
            ("oversized", struct.pack(">I", 4096 + 1024)),
        ]:
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                assert isinstance(await read_frame(stream, bytearray()), wire.Challenge)
                await stream.send(data)
                with anyio.fail_after(handshake_timeout * 0.75):
                    assert await closed_by_peer(stream), name
        # three silent connections, two allowed: the oldest is dropped at once
        s1 = await anyio.connect_tcp("127.0.0.1", port)
        s2 = await anyio.connect_tcp("127.0.0.1", port)
        s3 = await anyio.connect_tcp("127.0.0.1", port)
        async with s1, s2, s3:
            opened = time.monotonic()
            for s in (s1, s2, s3):
                with anyio.fail_after(5):
                    assert isinstance(await read_frame(s, bytearray()), wire.Challenge)
            with anyio.fail_after(handshake_timeout * 0.5):
                assert await closed_by_peer(s1)
            timings["oldest"] = time.monotonic() - opened
            # the others stay until handshake_timeout, then go too
            with anyio.fail_after(handshake_timeout + 3):
                assert await closed_by_peer(s3)
            timings["silent"] = time.monotonic() - opened

    outcome = await federate(
        plan,
        [],
        AggregatorSettings(
            rounds=1,
            round_timeout=30,
            join_timeout=20,
            handshake_timeout=handshake_timeout,
            max_pending_handshakes=2,
        ),
        held=(good,),
        during=poke,
        limit=25,
    )
    assert timings["silent"] >= handshake_timeout * 0.5
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a"]
    assert record.missing == ()
    answer = await Replica(good, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_refusals_are_logged_at_a_bounded_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # "What it refuses and logs (at most a few lines per 10 s)": 30 garbage connections in a
    # burst are refused, and logged, but not one line each.
    plan = make_plan()
    good = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    burst = 30
    refused = 0

    async def garbage_burst(outcome: Outcome, scopes: object) -> None:
        nonlocal refused
        assert outcome.port is not None
        for _ in range(burst):
            async with await anyio.connect_tcp("127.0.0.1", outcome.port) as stream:
                await read_frame(stream, bytearray())
                await stream.send(struct.pack(">I", 7) + b"garbage")
                with anyio.fail_after(3):
                    refused += await closed_by_peer(stream)

    with caplog.at_level(logging.INFO, logger="lamploop"):
        outcome = await federate(
            plan,
            [],
            AggregatorSettings(rounds=1, round_timeout=30, join_timeout=20),
            held=(good,),
            during=garbage_burst,
        )
    assert refused == burst
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    assert outcome.result.rounds[0].missing == ()
    lines = [r for r in caplog.records if r.name.startswith("lamploop") and r.levelno >= logging.WARNING]
    # "a few" is not a number: 10 a burst (and a line counting the rest) is taken as a few
    assert 1 <= len(lines) <= 12
    assert len(lines) < burst


# --------------------------------------------------------------------------------------------
# Answers that are not averaged
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "bad", ["another-round", "another-plan", "other-tensors", "non-finite", "oversized-frame"]
)
async def test_bad_answers_are_not_averaged_and_named(tmp_path: Path, bad: str) -> None:
    # "An answer to another round, of another plan, with other tensors or with non-finite
    # parameters is not averaged; the node is named in the round's record."
    plan = make_plan()
    good = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))

    async def fake_node(outcome: Outcome, scopes: object) -> None:
        assert outcome.port is not None
        async with await anyio.connect_tcp("127.0.0.1", outcome.port) as stream:
            buffer = bytearray()
            challenge = await read_frame(stream, buffer)
            nonce = secrets.token_hex(32)
            unsigned = wire.Hello(wire.PROTOCOL_VERSION, "node-z", nonce, "")
            proof = wire.node_proof(TOKEN.encode(), aggregator_nonce=challenge.nonce, hello=unsigned)
            await stream.send(wire.encode_frame(wire.Hello(wire.PROTOCOL_VERSION, "node-z", nonce, proof)))
            assert isinstance(await read_frame(stream, buffer), wire.Welcome)
            task = await read_frame(stream, buffer)
            assert isinstance(task, wire.RoundTask)
            assert task.plan == plan_to_json(plan)
            tensors = {k: torch.full_like(v, 100.0) for k, v in task.tensors.items()}
            round_, digest = task.round, plan_hash(plan)
            if bad == "another-round":
                round_ += 1
            elif bad == "another-plan":
                digest = plan_hash(make_plan(seed=1))
            elif bad == "other-tensors":
                tensors["0.weight"] = torch.zeros(5, 5, dtype=torch.float64)
            elif bad == "non-finite":
                tensors["0.bias"][0] = float("nan")
            if bad == "oversized-frame":  # over max_frame_bytes, from a node that proved the token
                await stream.send(struct.pack(">I", 1 << 20) + b"x" * 1024)
            else:
                reply = wire.RoundReply(round_, digest, 1000, 0.01, 0.01, 1.0, None, None, tensors)
                await stream.send(wire.encode_frame(reply))
            with anyio.move_on_after(10):
                await closed_by_peer(stream)

    outcome = await federate(
        plan,
        [good],
        AggregatorSettings(
            rounds=1,
            min_nodes=1,
            expected_nodes=2,
            round_timeout=1.0,
            join_timeout=10,
            max_frame_bytes=1 << 16,
        ),
        during=fake_node,
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a"]
    assert [m.node for m in record.missing] == ["node-z"]
    answer = await Replica(good, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


# --------------------------------------------------------------------------------------------
# Faults: a node lost, frozen or slow; too few answers or nodes
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_node_lost_mid_round_is_dropped_at_once_and_named(tmp_path: Path) -> None:
    # "A node that dies in the middle of a round is dropped at once (its connection breaks) and
    # named in the record; the round goes on with the others if at least min_nodes answered."
    plan = make_plan()
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    b = Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", plan))
    c = Node("node-c", seed=3, n_train=8, allow_list=approved(tmp_path, "c", plan)).stalled()
    killed: list[float] = []

    async def kill_c(outcome: Outcome, scopes: dict[str, anyio.CancelScope]) -> None:
        assert c.stall is not None
        with anyio.fail_after(10):
            await c.stall.started.wait()  # node-c is in the middle of its round
        await anyio.sleep(0.1)
        killed.append(time.monotonic())
        scopes["node-c"].cancel()  # its task ends, its connection closes

    outcome = await federate(
        plan,
        [a, b, c],
        AggregatorSettings(rounds=1, min_nodes=2, expected_nodes=3, round_timeout=60, join_timeout=10),
        during=kill_c,
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a", "node-b"]
    assert [m.node for m in record.missing] == ["node-c"]
    assert "lost" in record.missing[0].why  # MissingNode: "and why (lost, refused, too late)"
    assert outcome.round_times[0] - killed[0] < 5  # at once, not at round_timeout (60 s)
    assert outcome.summaries["node-c"] == "cancelled"
    replicas = {n.name: Replica(n, plan) for n in (a, b)}
    final, _, _ = await reference_rounds(
        plan, replicas, [["node-a", "node-b"]], state_of(mlp(OPTIONS)), parameter_names(mlp(OPTIONS))
    )
    assert_state_close(outcome.result.model, final)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_frozen_node_is_dropped_at_round_timeout(tmp_path: Path) -> None:
    plan = make_plan()
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    frozen = Node("node-f", seed=3, n_train=8, allow_list=approved(tmp_path, "f", plan)).stalled()
    round_timeout = 0.7
    started = time.monotonic()
    outcome = await federate(
        plan,
        [a, frozen],
        AggregatorSettings(
            rounds=1, min_nodes=1, expected_nodes=2, round_timeout=round_timeout, join_timeout=10
        ),
        grace=0.2,
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a"]
    assert [m.node for m in record.missing] == ["node-f"]
    assert record.missing[0].why
    assert round_timeout * 0.9 <= record.wall_s < round_timeout + 3
    assert outcome.round_times[0] - started < round_timeout + 5
    answer = await Replica(a, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_too_few_answers_fail_with_federated_error_naming_the_missing(tmp_path: Path) -> None:
    plan = make_plan()
    frozen = Node("node-f", seed=3, n_train=8, allow_list=approved(tmp_path, "f", plan)).stalled()
    outcome = await federate(
        plan,
        [frozen],
        AggregatorSettings(rounds=2, min_nodes=1, round_timeout=0.5, join_timeout=5),
        grace=0.2,
    )
    assert isinstance(outcome.error, FederatedError), outcome.error
    assert not isinstance(outcome.error, PlanNotApprovedError)
    assert "node-f" in str(outcome.error)
    assert outcome.records == []


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_round_sent_again_counts_its_attempts(tmp_path: Path) -> None:
    # "otherwise send the round again (round_attempts in all)"; RoundRecord.attempts: "how many
    # times the round was sent (more than 1 after too few answers)". node-s is too slow for the
    # first attempt only; a node that loses the aggregator "reconnects ... and gets the current
    # round", and trains it again "from the same optimizer state and the same batches".
    plan = make_plan()
    slow = Node("node-s", seed=1, n_train=10, allow_list=approved(tmp_path, "s", plan)).stalled(seconds=0.8)
    outcome = await federate(
        plan,
        [slow],
        AggregatorSettings(rounds=1, min_nodes=1, round_timeout=0.5, round_attempts=4, join_timeout=5),
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    (record,) = outcome.result.rounds
    assert record.attempts >= 2
    assert [x.node for x in record.answered] == ["node-s"]
    answer = await Replica(slow, plan).train(state_of(mlp(OPTIONS)), 0)
    assert_state_close(outcome.result.model, answer.state)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_too_few_nodes_joining_in_time_is_a_federated_error(tmp_path: Path) -> None:
    plan = make_plan()
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    started = time.monotonic()
    outcome = await federate(
        plan,
        [a],
        AggregatorSettings(rounds=1, min_nodes=2, join_timeout=0.5, round_timeout=30),
    )
    assert isinstance(outcome.error, FederatedError), outcome.error
    assert time.monotonic() - started < 5
    assert outcome.records == []
    summary = outcome.summaries["node-a"]
    assert isinstance(summary, NodeSummary), summary
    assert summary.failed
    assert summary.trained == ()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_expected_nodes_are_waited_for_at_most_join_timeout(tmp_path: Path) -> None:
    # "wait until enough nodes are connected (expected_nodes before the first round, then
    # min_nodes), at most join_timeout seconds": one of two expected nodes, min_nodes=1.
    plan = make_plan()
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    join_timeout = 0.6
    started = time.monotonic()
    outcome = await federate(
        plan, [a], AggregatorSettings(rounds=1, min_nodes=1, expected_nodes=2, join_timeout=join_timeout)
    )
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    assert outcome.round_times[0] - started >= join_timeout  # it waited for node 2
    (record,) = outcome.result.rounds
    assert [x.node for x in record.answered] == ["node-a"]
    assert record.missing == ()  # never sent the round: not missing


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_on_round_raising_ends_the_run_as_a_failure(tmp_path: Path) -> None:
    # run_aggregator: on_round "what it raises ends the run as a failure"
    plan = make_plan()
    a = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))

    class Stop(RuntimeError):
        pass

    def on_round(record: RoundRecord) -> None:
        raise Stop("enough")

    outcome = await federate(
        plan, [a], AggregatorSettings(rounds=3, round_timeout=30, join_timeout=10), on_round=on_round
    )
    assert outcome.error is not None
    assert outcome.result is None
    assert [r.round for r in outcome.records] == [0]
    summary = outcome.summaries["node-a"]
    assert isinstance(summary, NodeSummary), summary
    assert summary.trained == (0,)
    assert summary.failed
    assert "enough" in summary.finish_reason  # Finish: "(reason says which)"


# --------------------------------------------------------------------------------------------
# Bad arguments, checked before anything starts
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "case",
    [
        "initial-model-other-shapes",
        "initial-model-other-dtype",
        "initial-model-missing-tensor",
        "settings",
        "empty-token",
        "port-out-of-range",
    ],
)
async def test_aggregator_bad_arguments_before_listening(case: str) -> None:
    plan = make_plan()
    initial: Any = mlp(OPTIONS)
    settings: Any = AggregatorSettings(rounds=1, join_timeout=10)
    if case == "initial-model-other-shapes":
        initial = mlp({**OPTIONS, "sizes": [4, 6, 3]})
    elif case == "initial-model-other-dtype":
        initial = mlp({**OPTIONS, "dtype": "float32"})
    elif case == "initial-model-missing-tensor":
        initial = {k: v for k, v in mlp(OPTIONS).state_dict().items() if k != "2.bias"}
    elif case == "settings":
        settings = {"rounds": 1}
    token, port = TOKEN, 0
    if case == "empty-token":
        token = ""
    elif case == "port-out-of-range":
        port = 70000
    listened: list[int] = []
    with anyio.fail_after(5), pytest.raises(ConfigurationError):
        await run_aggregator(
            plan=plan,
            initial_model=initial,
            token=token,
            port=port,
            settings=settings,
            on_listening=listened.append,
        )
    assert listened == []


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "case",
    [
        "empty-name",
        "empty-token",
        "port-out-of-range",
        "train-batches-not-callable",
        "settings",
    ],
)
async def test_node_bad_arguments_before_connecting(tmp_path: Path, case: str) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    node = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", make_plan()))
    kwargs: dict[str, Any] = {
        "name": node.name,
        "host": "127.0.0.1",
        "port": port,
        "token": TOKEN,
        "allow_list": node.allow_list,
        "train_batches": node.train_batches,
        "settings": NodeSettings(connect_timeout=30),
    }
    if case == "empty-name":
        kwargs["name"] = ""
    elif case == "empty-token":
        kwargs["token"] = ""
    elif case == "port-out-of-range":
        kwargs["port"] = 70000
    elif case == "train-batches-not-callable":
        kwargs["train_batches"] = [(node.x, node.y)]
    else:
        kwargs["settings"] = {"connect_timeout": 30}
    with anyio.fail_after(3), pytest.raises(ConfigurationError):  # not after connect_timeout (30 s)
        await run_node(**kwargs)


# --------------------------------------------------------------------------------------------
# Checkpoints and resume
# --------------------------------------------------------------------------------------------


def find_json(value: Any, wanted: Any) -> bool:
    if value == wanted:
        return True
    if isinstance(value, dict):
        return any(find_json(v, wanted) for v in value.values())
    if isinstance(value, list):
        return any(find_json(v, wanted) for v in value)
    return False


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_checkpoint_every_round_and_resume_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "With checkpoint_dir, the aggregator checkpoints after every round (an ordinary lamploop
    # checkpoint: lamploop inspect reads it; the round records live in its federated extra), and
    # a new run with the same directory and plan resumes after the last round checkpointed."
    plan = make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.1, momentum=0.9))

    def fresh_nodes() -> list[Node]:
        return [
            Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan)),
            Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", plan)),
        ]

    run_dir = tmp_path / "run"
    saved: list[dict[str, torch.Tensor]] = []

    def after_round(record: RoundRecord) -> None:  # "once the round is done (... checkpointed)"
        saved.append(dict(load_checkpoint(run_dir).state.model))

    first = await federate(
        plan,
        fresh_nodes(),
        AggregatorSettings(rounds=2, min_nodes=2, round_timeout=30, join_timeout=10, checkpoint_dir=run_dir),
        on_round=after_round,
    )
    assert first.error is None, first.error
    assert first.result is not None
    assert len(saved) == 2
    assert not torch.equal(saved[0]["0.weight"], saved[1]["0.weight"])
    checkpoint = load_checkpoint(run_dir)
    assert_state_equal(checkpoint.state.model, first.result.model)
    assert_state_equal(saved[1], first.result.model)
    assert "federated" in checkpoint.extras
    _, meta = checkpoint.extras["federated"]
    assert find_json(meta, rounds_to_json(first.result.rounds))
    assert cli_main(["inspect", str(run_dir)]) == 0
    capsys.readouterr()

    resumed = await federate(
        plan,
        fresh_nodes(),
        AggregatorSettings(rounds=3, min_nodes=2, round_timeout=30, join_timeout=10, checkpoint_dir=run_dir),
    )
    assert resumed.error is None, resumed.error
    assert resumed.result is not None
    assert [r.round for r in resumed.result.rounds] == [0, 1, 2]
    assert resumed.result.rounds[:2] == first.result.rounds
    for name in ("node-a", "node-b"):
        summary = resumed.summaries[name]
        assert isinstance(summary, NodeSummary), summary
        assert summary.trained == (2,)

    whole = await federate(
        plan,
        fresh_nodes(),
        AggregatorSettings(
            rounds=3,
            min_nodes=2,
            round_timeout=30,
            join_timeout=10,
            checkpoint_dir=tmp_path / "whole",
            keep_last=1,
        ),
    )
    assert whole.error is None, whole.error
    assert whole.result is not None
    # AggregatorSettings.keep_last: "round checkpoints kept"
    kept = [p.name for p in (tmp_path / "whole").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(kept) == 1
    assert_state_equal(load_checkpoint(tmp_path / "whole").state.model, whole.result.model)
    assert_state_equal(resumed.result.model, whole.result.model)
    assert [r.training_loss for r in resumed.result.rounds] == [r.training_loss for r in whole.result.rounds]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_checkpoint_of_another_plan_is_refused(tmp_path: Path) -> None:
    plan = make_plan()
    run_dir = tmp_path / "run"
    node = Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan))
    first = await federate(
        plan, [node], AggregatorSettings(rounds=1, round_timeout=30, join_timeout=10, checkpoint_dir=run_dir)
    )
    assert first.error is None, first.error
    other = make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.2))
    listened: list[int] = []
    with anyio.fail_after(10), pytest.raises(FederatedError):
        await run_aggregator(
            plan=other,
            initial_model=mlp(OPTIONS),
            token=TOKEN,
            on_listening=listened.append,
            settings=AggregatorSettings(rounds=2, join_timeout=5, checkpoint_dir=run_dir),
        )
    assert listened == []  # the package doc: "checks, resume, then its listener and round loop"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_aggregator_restart_nodes_reconnect_and_end_bitwise_equal(tmp_path: Path) -> None:
    # "A node that loses the aggregator reconnects (for up to connect_timeout) and gets the
    # current round"; "the resumed run ends bitwise equal to an uninterrupted one" (momentum kept).
    plan = make_plan(
        optimizer=OptimizerConfig("sgd", learning_rate=0.1, momentum=0.9), optimizer_state="keep"
    )

    def fresh_nodes() -> list[Node]:
        return [
            Node("node-a", seed=1, n_train=10, allow_list=approved(tmp_path, "a", plan)),
            Node("node-b", seed=2, n_train=17, allow_list=approved(tmp_path, "b", plan)),
        ]

    settings = AggregatorSettings(rounds=3, min_nodes=2, round_timeout=30, join_timeout=10)
    whole = await federate(plan, fresh_nodes(), attrs_evolve(settings, checkpoint_dir=tmp_path / "whole"))
    assert whole.error is None, whole.error
    assert whole.result is not None

    run_dir = tmp_path / "run"
    nodes = fresh_nodes()
    summaries: dict[str, NodeSummary] = {}
    results: list[FederatedResult] = []
    ports: list[int] = []
    listening = anyio.Event()

    gone = anyio.Event()

    async def aggregator(port: int, cancel_after_round_0: bool) -> None:
        with anyio.CancelScope() as scope:

            def on_round(record: RoundRecord) -> None:
                if cancel_after_round_0:
                    scope.cancel()  # the aggregator dies after round 0 was checkpointed

            def on_listening(value: int) -> None:
                ports.append(value)
                listening.set()

            results.append(
                await run_aggregator(
                    plan=plan,
                    initial_model=mlp(OPTIONS),
                    token=TOKEN,
                    port=port,
                    settings=attrs_evolve(settings, checkpoint_dir=run_dir),
                    on_listening=on_listening,
                    on_round=on_round,
                )
            )
        gone.set()

    async def node_task(node: Node) -> None:
        summaries[node.name] = await serve_node(node, ports[0])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(aggregator, 0, True)
            await listening.wait()
            for node in nodes:
                group.start_soon(node_task, node)
            await gone.wait()
            assert results == []  # the first aggregator died after round 0
            assert load_checkpoint(run_dir).state.loop_state.epoch == 1
            await anyio.sleep(0.2)
            group.start_soon(aggregator, ports[0], False)
    (result,) = results
    assert [r.round for r in result.rounds] == [0, 1, 2]
    assert_state_equal(result.model, whole.result.model)
    assert [r.training_loss for r in result.rounds] == [r.training_loss for r in whole.result.rounds]
    for name in ("node-a", "node-b"):
        assert set(summaries[name].trained) == {0, 1, 2}


def attrs_evolve(settings: AggregatorSettings, **changes: Any) -> AggregatorSettings:
    import attrs

    return attrs.evolve(settings, **changes)
