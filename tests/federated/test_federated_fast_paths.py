"""The federated round's fast paths give what the slower ways they replace gave.

A node parses a plan once per distinct plan, seeds the CPU generator alone for a CPU model,
trains without metrics; tensors are written in the safetensors layout directly; FedAvg sums
one flat vector per update; the aggregator checks finiteness with NumPy, times a round up
to the new global model and hands each record to ``on_round``.  Each test fails if its
path departs from the reference.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import safetensors.torch
import torch

from lamploop.errors import ConfigurationError
from lamploop.federated import (
    AggregatorSettings,
    FederatedResult,
    OptimizerConfig,
    RoundRecord,
    mlp,
    plan_hash,
    plan_to_json,
    run_aggregator,
)
from lamploop.federated import node_trainer as node_trainer_module
from lamploop.federated import round_loop as round_loop_module
from lamploop.federated.aggregator import finite
from lamploop.federated.fedavg import federated_average
from lamploop.federated.models import build_supervised_model
from lamploop.federated.node import seed_round
from lamploop.federated.node_trainer import NodeTrainer
from lamploop.federated.wire import decode_tensors, encode_tensors
from tests.workers.federated_harness import TOKEN, free_port, in_process_node, make_plan


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(4, 6, generator=gen)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "f64": torch.randn(2, 2, generator=gen, dtype=torch.float64),
        "f16": torch.randn(7, generator=gen).half(),
        "bf16": torch.randn(3, 3, generator=gen).bfloat16(),
        "i64": torch.arange(-6, 6).reshape(3, 4),
        "i32": torch.arange(5, dtype=torch.int32),
        "i16": torch.arange(-2, 2, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": base.t(),  # not contiguous
        "tied_a": base,
        "tied_b": base,  # the same storage as tied_a (safetensors.torch.save refuses that)
        "needs_grad": torch.ones(2, requires_grad=True),
    }


def test_tensors_written_directly_read_back_as_safetensors_writes_them() -> None:
    tensors = _tensors()
    payload = encode_tensors(tensors)
    assert int.from_bytes(payload[:8], "little") % 8 == 0  # the header is padded to 8 bytes
    decoded = decode_tensors(payload)
    reference = safetensors.torch.load(
        safetensors.torch.save({name: t.detach().clone().contiguous() for name, t in tensors.items()})
    )
    assert sorted(decoded) == sorted(tensors) == sorted(reference)
    for name, tensor in tensors.items():
        for got in (decoded[name], reference[name]):
            assert got.dtype == tensor.dtype, name
            assert got.shape == tensor.shape, name
            assert torch.equal(got, tensor.detach()), name
    # A dtype written by safetensors itself (complex) still round-trips, beside the others.
    mixed = {"c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64), "f": torch.ones(2)}
    back = decode_tensors(encode_tensors(mixed))
    assert torch.equal(back["c"], mixed["c"])
    assert torch.equal(back["f"], mixed["f"])


def _reference_average(
    global_model: dict[str, torch.Tensor],
    updates: list[tuple[str, int, dict[str, torch.Tensor]]],
    names: frozenset[str],
) -> dict[str, torch.Tensor]:
    """FedAvg tensor by tensor, as lamploop 0.3 computed it."""
    total = sum(count for _, count, _ in updates)
    result = {}
    for name, current in global_model.items():
        if name not in names:
            result[name] = current.clone()
            continue
        accumulator = torch.zeros(current.shape, dtype=torch.float64)
        for _, count, state in updates:
            accumulator += state[name].to(torch.float64) * (count / total)
        is_float = current.is_floating_point()
        result[name] = accumulator.to(current.dtype) if is_float else accumulator.round().to(current.dtype)
    return result


def test_fedavg_of_flat_vectors_equals_the_tensor_by_tensor_sum_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)

    def state() -> dict[str, torch.Tensor]:
        return {
            "w": torch.randn(8, 5, generator=gen),
            "b": torch.randn(8, generator=gen, dtype=torch.float64),
            "scale": torch.randn((), generator=gen),
            "count": torch.randint(0, 1000, (3,), generator=gen),
            "kept": torch.randn(4, generator=gen),
        }

    global_model = state()
    updates = [("a", 17, state()), ("b", 40, state()), ("c", 3, state())]
    for names in (frozenset({"w", "b", "scale", "count"}), frozenset({"w"}), frozenset()):
        result = federated_average(global_model, updates, names=names)
        expected = _reference_average(global_model, updates, names)
        assert list(result) == list(expected)
        for name in expected:
            assert result[name].dtype == expected[name].dtype, name
            assert torch.equal(result[name], expected[name]), name
    # Every tensor has its own storage (none is a view of the flat sum or of another).
    result = federated_average(global_model, updates, names=frozenset({"w", "b", "scale", "count"}))
    storages = {t.untyped_storage().data_ptr() for t in result.values()}
    inputs = {t.untyped_storage().data_ptr() for _, _, s in updates for t in s.values()}
    assert len(storages) == len(result)
    assert not storages & inputs


def test_a_cpu_model_is_seeded_as_torch_manual_seed_seeds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    torch.manual_seed(12345)
    expected = torch.get_rng_state()
    draws = torch.rand(5)
    torch.manual_seed(0)
    calls: list[int] = []
    monkeypatch.setattr(torch, "manual_seed", calls.append)
    seed_round(module, 12345)
    assert calls == []  # the CPU generator alone
    assert torch.equal(torch.get_rng_state(), expected)
    assert torch.equal(torch.rand(5), draws)
    on_meta = torch.nn.Linear(3, 3, device="meta")  # tensors elsewhere: every generator, as before
    seed_round(on_meta, 99)
    assert calls == [99]


def test_training_builds_the_model_without_metrics() -> None:
    plan = make_plan(metrics=("accuracy",))
    module = mlp(dict(plan.model.options))
    assert list(build_supervised_model(plan, module).metrics) == ["accuracy"]
    assert dict(build_supervised_model(plan, module, metrics=False).metrics) == {}


def test_a_node_parses_the_same_plan_once_and_any_other_plan_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[object] = []
    real = node_trainer_module.plan_from_json

    def counting(obj: object, *, where: str = "plan") -> Any:
        parsed.append(obj)
        return real(obj, where=where)

    monkeypatch.setattr(node_trainer_module, "plan_from_json", counting)
    trainer = NodeTrainer("node-0", lambda context: None, None, None)  # type: ignore[arg-type,return-value]
    plan = make_plan()
    raw = plan_to_json(plan)
    assert trainer.read_plan(raw, 0) == (plan, plan_hash(plan))
    assert trainer.read_plan(plan_to_json(plan), 1) == (plan, plan_hash(plan))  # an equal plan: not parsed
    assert len(parsed) == 1
    other = make_plan(optimizer=OptimizerConfig("sgd", learning_rate=0.25))
    assert trainer.read_plan(plan_to_json(other), 2) == (other, plan_hash(other))
    assert len(parsed) == 2
    # A plan equal to the last one in Python (1 == 1.0 == True) but not in JSON is parsed again.
    changed = plan_to_json(other)
    changed["optimizer"]["momentum"] = False
    with pytest.raises(ConfigurationError, match=r"optimizer\.momentum"):
        trainer.read_plan(changed, 3)
    assert len(parsed) == 3
    assert trainer.read_plan(plan_to_json(other), 4)[1] == plan_hash(other)
    assert len(parsed) == 3


def test_finite_says_whether_every_element_is_finite() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        values = torch.tensor([0.0, 1.5, -2.0], dtype=dtype)
        assert finite(values), dtype
        for bad in (float("nan"), float("inf"), float("-inf")):
            spoiled = values.clone()
            spoiled[1] = bad
            assert not finite(spoiled), (dtype, bad)
    assert finite(torch.arange(3))
    assert finite(torch.tensor([True]))
    assert not finite(torch.tensor([1.0, float("nan")], requires_grad=True))


def test_a_rounds_wall_time_runs_up_to_the_new_global_model_and_on_round_sees_each_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    delay = 0.5
    real = round_loop_module.federated_average

    def slow_average(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        time.sleep(delay)
        return real(*args, **kwargs)

    monkeypatch.setattr(round_loop_module, "federated_average", slow_average)
    plan = make_plan()
    port = free_port()
    node = in_process_node(tmp_path, plan, port, "node-0", (0, 40), 40)

    async def main() -> FederatedResult:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(anyio.to_thread.run_sync, anyio.run, node, abandon_on_cancel=True))
            with anyio.fail_after(30):
                return await run_aggregator(
                    plan=plan,
                    initial_model=mlp(dict(plan.model.options)),
                    token=TOKEN,
                    port=port,
                    settings=AggregatorSettings(rounds=2),
                    on_round=seen.append,
                )

    seen: list[RoundRecord] = []
    result = anyio.run(main)
    assert [record.wall_s >= delay for record in result.rounds] == [True, True]
    assert seen == list(result.rounds)
    assert [record.round for record in seen] == [0, 1]
