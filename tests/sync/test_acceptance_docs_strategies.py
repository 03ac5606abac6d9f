"""Acceptance tests of the gradient-sync strategies, written from the docs alone.

Sources: docs/strategies.md, docs/concepts/sync-strategies.md, docs/api/sync.md (the
docstrings of ``lamploop.sync``), docs/distributed.md "Strategies and their trade-offs",
docs/architecture.md "Adding a gradient-sync strategy" (the plugin it shows) and DESIGN.md
section 4. Every check compares lamploop with a reference that owes nothing to it: PyTorch's
DDP comm hooks (``allreduce_hook``, ``bf16_compress_hook``, ``fp16_compress_hook``,
``powerSGD_hook``) run beside it in the same Gloo group, or a float64 reference written
here from the definitions (full-batch SGD over every rank's examples; Local SGD: each rank
steps alone, parameters averaged every H steps weighted by examples; DiLoCo: the paper's
outer Nesterov step on the averaged pseudo-gradient; PowerSGD: Vogels et al.'s power
iteration with error feedback and warm start).

The multi-process checks all run in one pair of real processes
(tests/workers/acceptance_strategies_rank.py, ranks 0 and 1 of a Gloo group on 127.0.0.1):
one module-scoped fixture starts them once, and each test below judges its part of what
they recorded.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file
from support import free_port
from workers import acceptance_strategies_rank as worker
from workers.records import load_record

import lamploop
from lamploop.errors import ConfigurationError, DistributedError, LamploopError
from lamploop.sync import (
    AllReduce,
    CompressedAllReduce,
    LocalSGD,
    OuterNesterov,
    PowerSGD,
    strategy_named,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "acceptance_strategies_rank.py"
WORKER_BOUND_S = 80.0
DOC_STRATEGIES = (
    "all_reduce",
    "reduce_to_root",
    "all_reduce_bf16",
    "all_reduce_fp16",
    "powersgd1",
    "powersgd4",
    "local_sgd8",
    "diloco8",
    "fsdp",
)
STATEFUL = worker.STATEFUL
multiprocess = pytest.mark.timeout(90)


# --- the pair of ranks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' records of every check of the worker (one run for the whole module)."""
    out = tmp_path_factory.mktemp("strategies")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(out / f"log{r}.txt", "wb") for r in range(worker.NRANKS)]  # noqa: SIM115
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(port), str(out)],
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        for r in range(worker.NRANKS)
    ]
    deadline = time.monotonic() + WORKER_BOUND_S
    try:
        for process in processes:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
            process.wait()
        pytest.fail(f"the ranks did not finish within {WORKER_BOUND_S} s (a hang): {_tails(out)}")
    finally:
        for log in logs:
            log.close()
    codes = [p.returncode for p in processes]
    assert codes == [0, 0], f"exit codes {codes}: {_tails(out)}"
    return [load_record(out / f"rank{r}.json") for r in range(worker.NRANKS)]


def _tails(out: Path) -> str:
    return "\n".join(
        f"--- rank {r} ---\n" + (out / f"log{r}.txt").read_text(errors="replace")[-3000:]
        for r in range(worker.NRANKS)
    )


def records(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Both ranks' records of one check; a check that raised fails the test with its traceback."""
    out = []
    for r, rank in enumerate(ranks):
        assert name in rank, f"rank {r} has no record of {name!r}"
        assert "error" not in rank[name], f"rank {r}, {name}:\n{rank[name]['error']}"
        out.append(rank[name])
    return out


# --- references (plain torch) ------------------------------------------------------------


def plan_of(scenario: dict[str, Any], *, dtype: torch.dtype = torch.float64, accumulate: int = 1) -> list:
    x, y = worker.data(scenario["n"], scenario["dims"])
    return worker.steps(worker.cut(x, y, scenario["batch"], dtype), accumulate)


def buffer_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def load_buffers(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(state[name])


def made_alike(states: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """docs/distributed.md: floating buffers become their mean over the ranks, integer ones the root's."""
    alike = {
        name: (sum(s[name] for s in states) / len(states) if value.is_floating_point() else value.clone())
        for name, value in states[0].items()
    }
    return [{k: v.clone() for k, v in alike.items()} for _ in states]


def exact_reference(scenario: dict[str, Any], *, passes: int, accumulate: int = 1) -> dict[str, Any]:
    """One process, float64: each step descends on the mean loss of every example of every rank.

    Buffers (BatchNorm's running statistics) are kept per rank, each updated by its own
    batches' forward passes, and made alike at the end of each pass."""
    plan = plan_of(scenario, accumulate=accumulate)
    module = worker.model_for(scenario)
    optimizer = torch.optim.SGD(
        module.parameters(), lr=scenario["lr"], momentum=scenario.get("momentum", 0.0)
    )
    buffers = [buffer_state(module) for _ in range(worker.NRANKS)]
    losses = []
    for _ in range(passes):
        loss_sum, count = 0.0, 0
        for step in plan:
            optimizer.zero_grad()
            loss, examples = torch.zeros((), dtype=torch.float64), 0
            for r, batches in enumerate(step):
                for bx, by in batches:  # rank r's forward: its own running statistics
                    output = torch.func.functional_call(
                        module, (dict(module.named_parameters()), buffers[r]), (bx,)
                    )
                    loss = loss + torch.nn.functional.cross_entropy(output, by, reduction="sum")
                    examples += len(by)
            (loss / examples).backward()
            optimizer.step()
            loss_sum, count = loss_sum + float(loss.detach()), count + examples
        buffers = made_alike(buffers)
        losses.append(loss_sum / count)
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "losses": losses,
        "buffers": buffers[0],
    }


def exact_step_gradient(
    before: Sequence[torch.Tensor], scenario: dict[str, Any], step: list
) -> list[torch.Tensor]:
    """float64 gradient of the step's mean loss over every rank's batches, at ``before``."""
    module = worker.model_for(scenario)
    with torch.no_grad():
        for p, value in zip(module.parameters(), before, strict=True):
            p.copy_(value.double())
    batches = [b for rank in step for b in rank]
    examples = sum(len(by) for _, by in batches)
    return worker.local_gradient(module, batches, examples)


def local_sgd_reference(
    scenario: dict[str, Any], every: int, outer: tuple[float, float] | None
) -> dict[str, Any]:
    """Local SGD from its definition, float64: every rank steps its own SGD on the mean loss of
    its own examples; every ``every`` steps and at the end of each pass the ranks' parameters are
    averaged, each weighted by the examples it trained on since the last average. With
    ``outer=(lr, momentum)`` it is DiLoCo: the averaged change from the last outer parameters is
    the outer gradient, and ``torch.optim.SGD(nesterov=True)`` steps on it."""
    plan = plan_of(scenario)
    start = worker.model_for(scenario)
    replicas = [copy.deepcopy(start) for _ in range(worker.NRANKS)]
    inner = [
        torch.optim.SGD(m.parameters(), lr=scenario["lr"], momentum=scenario.get("momentum", 0.0))
        for m in replicas
    ]
    anchor = copy.deepcopy(start)
    outer_optimizer = (
        torch.optim.SGD(anchor.parameters(), lr=outer[0], momentum=outer[1], nesterov=True) if outer else None
    )
    weights = [0] * worker.NRANKS
    since = 0

    def average() -> None:
        nonlocal since
        total = sum(weights)
        with torch.no_grad():
            for i, target in enumerate(anchor.parameters()):
                mean = (
                    sum(w * list(m.parameters())[i] for w, m in zip(weights, replicas, strict=True)) / total
                )
                if outer_optimizer is None:
                    target.copy_(mean)
                else:
                    target.grad = target.detach() - mean
        if outer_optimizer is not None:
            outer_optimizer.step()
        with torch.no_grad():
            for m in replicas:
                for p, a in zip(m.parameters(), anchor.parameters(), strict=True):
                    p.copy_(a)
        weights[:] = [0] * worker.NRANKS
        since = 0

    losses = []
    for _ in range(scenario["passes"]):
        loss_sum, count = 0.0, 0
        for step in plan:
            for r, batches in enumerate(step):
                if not batches:
                    continue  # no batch: no step, weight zero
                examples = sum(len(by) for _, by in batches)
                inner[r].zero_grad()
                loss = sum(worker.ce_sum(replicas[r], bx, by) for bx, by in batches)
                (loss / examples).backward()
                inner[r].step()
                weights[r] += examples
                loss_sum, count = loss_sum + float(loss.detach()), count + examples
            since += 1
            if since == every:
                average()
        if since:
            average()
        for m, state in zip(replicas, made_alike([buffer_state(m) for m in replicas]), strict=True):
            load_buffers(m, state)
        losses.append(loss_sum / count)
    return {
        "params": [p.detach().clone() for p in replicas[0].parameters()],
        "losses": losses,
        "buffers": buffer_state(replicas[0]),
    }


def max_abs(tensors: Sequence[torch.Tensor]) -> float:
    return max(float(t.abs().max()) for t in tensors)


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def bitwise_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --- no processes: the registry and the arguments ------------------------------------------


def test_every_documented_strategy_is_registered_with_its_documented_settings() -> None:
    """docs/concepts/sync-strategies.md: "Six more send less per step, each approximating
    something: `all_reduce_bf16` and `all_reduce_fp16` (16-bit gradients), `powersgd1` and
    `powersgd4` (low-rank factors with error feedback) and `local_sgd8` and `diloco8`
    (parameters averaged every 8 steps)"; docs/strategies.md: "SGD with Nesterov momentum
    (`lr=0.7, momentum=0.5`) steps on it ... the registered `diloco8` uses 0.5
    (`OuterNesterov()` keeps the paper's 0.7 and 0.9 for longer windows)", "Tensors that would
    not shrink `min_compression_ratio` times (default 2 ...)", "doubled after 200 clean steps"."""
    assert set(DOC_STRATEGIES) <= set(lamploop.strategy_names())
    assert list(lamploop.strategy_names()) == sorted(lamploop.strategy_names())
    assert strategy_named("all_reduce").steps_on_every_rank
    assert not strategy_named("reduce_to_root").steps_on_every_rank
    for name in DOC_STRATEGIES:
        if name != "reduce_to_root":
            assert strategy_named(name).steps_on_every_rank, name  # "every rank steps its own optimizer"
    assert strategy_named("all_reduce_bf16").wire == "bf16"
    fp16 = strategy_named("all_reduce_fp16")
    assert (fp16.wire, fp16.growth_interval) == ("fp16", 200)
    for name, rank in (("powersgd1", 1), ("powersgd4", 4)):
        powersgd = strategy_named(name)
        assert (powersgd.rank, powersgd.min_compression_ratio, powersgd.warm_start) == (rank, 2.0, True)
    local = strategy_named("local_sgd8")
    assert (local.every_n_steps, local.outer) == (8, None)
    diloco = strategy_named("diloco8")
    assert diloco.every_n_steps == 8
    assert diloco.outer == OuterNesterov(lr=0.7, momentum=0.5)
    assert OuterNesterov() == OuterNesterov(lr=0.7, momentum=0.9)


def test_stateful_strategies_say_so() -> None:
    """docs/strategies.md "Checkpoints": "A strategy that keeps state says so (`keeps_state =
    True`, and `optimizer_state_per_rank = True` for local SGD)"; the table: `all_reduce` and
    `all_reduce_bf16` keep no state, `all_reduce_fp16` "the scale and its good-step count"."""
    for name in STATEFUL:
        assert getattr(strategy_named(name), "keeps_state", False) is True, name
    for name in ("local_sgd8", "diloco8"):
        assert getattr(strategy_named(name), "optimizer_state_per_rank", False) is True, name
    for name in ("all_reduce", "all_reduce_bf16", "all_reduce_fp16", "powersgd1", "powersgd4"):
        assert not getattr(strategy_named(name), "optimizer_state_per_rank", False), name
    for name in ("all_reduce", "all_reduce_bf16", "reduce_to_root"):
        assert not getattr(strategy_named(name), "keeps_state", False), name


def test_default_names_of_new_instances() -> None:
    """docs/strategies.md: "`lamploop.register_strategy(PowerSGD(rank=8), replace=True)  #
    registered as "powersgd8"`" and "`LocalSGD(every_n_steps=4, outer=OuterNesterov(lr=0.7,
    momentum=0.9))` ... # "diloco4""; help(LocalSGD): "name: the registered name (default
    ``local_sgd<H>``, or ``diloco<H>`` with ``outer``)"; help(CompressedAllReduce): "default
    ``all_reduce_<wire>``"."""
    assert PowerSGD(rank=8).name == "powersgd8"
    assert LocalSGD(every_n_steps=4, outer=OuterNesterov(lr=0.7, momentum=0.9)).name == "diloco4"
    assert LocalSGD(every_n_steps=32).name == "local_sgd32"
    assert CompressedAllReduce(wire="fp16").name == "all_reduce_fp16"
    assert CompressedAllReduce().name == "all_reduce_bf16"


BAD_ARGUMENTS = [  # id, make it, the bad value
    ("PowerSGD-rank-0", lambda: PowerSGD(rank=0), 0),
    ("PowerSGD-rank-float", lambda: PowerSGD(rank=1.5), 1.5),
    ("PowerSGD-ratio-negative", lambda: PowerSGD(min_compression_ratio=-1.0), -1.0),
    ("PowerSGD-ratio-inf", lambda: PowerSGD(min_compression_ratio=math.inf), math.inf),
    ("PowerSGD-seed-negative", lambda: PowerSGD(seed=-3), -3),
    ("LocalSGD-H-0", lambda: LocalSGD(every_n_steps=0), 0),
    ("LocalSGD-outer-str", lambda: LocalSGD(outer="nesterov"), "nesterov"),
    ("OuterNesterov-lr-0", lambda: OuterNesterov(lr=0.0), 0.0),
    ("OuterNesterov-lr-negative", lambda: OuterNesterov(lr=-0.5), -0.5),
    ("OuterNesterov-momentum-1", lambda: OuterNesterov(momentum=1.0), 1.0),
    ("OuterNesterov-momentum-negative", lambda: OuterNesterov(momentum=-0.25), -0.25),
    ("CompressedAllReduce-wire", lambda: CompressedAllReduce(wire="fp8"), "fp8"),
    ("CompressedAllReduce-growth-0", lambda: CompressedAllReduce(wire="fp16", growth_interval=0), 0),
]


@pytest.mark.parametrize(("make", "bad"), [pytest.param(m, b, id=i) for i, m, b in BAD_ARGUMENTS])
def test_bad_strategy_arguments_raise_configuration_error_naming_the_value(make: Any, bad: object) -> None:
    """docs/strategies.md: "`PowerSGD(rank=0)` ... `except ConfigurationError as error: print(error)
    # PowerSGD: rank must be an int >= 1, got 0`"; the Raises sections of help(PowerSGD) ("a
    rank below 1, a negative or infinite ratio, a negative seed"), help(LocalSGD)
    ("``every_n_steps`` below 1, or ``outer`` of another type"), help(OuterNesterov) ("``lr``
    not above 0, ``momentum`` outside ``[0, 1)``") and help(CompressedAllReduce) ("an unknown
    ``wire`` or a ``growth_interval`` below 1"); lamploop.errors: "Errors about bad arguments
    also derive from :class:`ValueError` ... Each message names the offending value"."""
    with pytest.raises(ConfigurationError) as caught:
        make()
    assert isinstance(caught.value, ValueError)
    assert repr(bad) in str(caught.value)


def test_the_documented_powersgd_message() -> None:
    """docs/strategies.md: "`PowerSGD(rank=0)` ... `print(error)  # PowerSGD: rank must be an int >=
    1, got 0`"."""
    with pytest.raises(ConfigurationError) as caught:
        PowerSGD(rank=0)
    assert str(caught.value) == "PowerSGD: rank must be an int >= 1, got 0"


def test_a_registered_instance_is_accepted_by_name() -> None:
    """docs/strategies.md: "Other ranks or settings are one registration away: ...
    `lamploop.register_strategy(PowerSGD(rank=8), replace=True)` ... `assert "powersgd8" in
    lamploop.strategy_names()` / `lamploop.TrainingSettings(strategy="powersgd8")`"."""
    strategy = PowerSGD(rank=8, name="acc_powersgd8_doc")
    with pytest.raises(ConfigurationError, match="acc_powersgd8_doc"):
        lamploop.TrainingSettings(strategy="acc_powersgd8_doc")
    lamploop.register_strategy(strategy, replace=True)
    assert "acc_powersgd8_doc" in lamploop.strategy_names()
    assert strategy_named("acc_powersgd8_doc") is strategy
    assert lamploop.TrainingSettings(strategy="acc_powersgd8_doc").strategy == "acc_powersgd8_doc"
    lamploop.register_strategy(strategy, replace=True)  # replace=True: registering again is fine


def test_register_strategy_refuses_a_taken_name_auto_and_a_non_strategy() -> None:
    """docs/concepts/sync-strategies.md: "`lamploop.register_strategy(AllReduce())  # the name is
    taken` ... `# register_strategy: the name 'all_reduce' is taken; pass replace=True to replace
    it`"; help(register_strategy): "ConfigurationError: the name is ``"auto"`` or already taken
    (unless ``replace``), or ``strategy`` lacks the :class:`SyncStrategy` members"."""
    with pytest.raises(ConfigurationError, match="'all_reduce' is taken"):
        lamploop.register_strategy(AllReduce())
    for replace in (False, True):
        with pytest.raises(ConfigurationError, match="'auto'"):
            lamploop.register_strategy(AllReduce(name="auto"), replace=replace)
    with pytest.raises(ConfigurationError):
        lamploop.register_strategy(object())  # type: ignore[arg-type]
    assert "auto" not in lamploop.strategy_names()


def test_a_typo_in_the_strategy_name_is_a_configuration_error_naming_it() -> None:
    """docs/concepts/sync-strategies.md: "`strategy="all-reduce",  # a typo` ... `# strategy must
    be 'auto' or one of ('all_reduce', 'reduce_to_root', ...), got 'all-reduce'`"; help(
    TrainingSettings): "strategy: the gradient-sync strategy's registered name ... Raises:
    ConfigurationError: a value is out of range; the message names the argument"."""
    x, y = torch.randn(4, 2), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=2),
            max_epochs=1,
            strategy="all-reduce",
        )
    message = str(caught.value)
    assert "got 'all-reduce'" in message
    assert all(f"'{name}'" in message for name in DOC_STRATEGIES)
    with pytest.raises(ConfigurationError, match="'powersgd9'"):
        lamploop.TrainingSettings(strategy="powersgd9")
    lamploop.TrainingSettings(strategy="powersgd4")  # a registered one is fine


def test_fsdp_and_unknown_names_are_refused_by_local_data_parallel_training_loop() -> None:
    """docs/strategies.md (fsdp): "Refused up front, with a `ConfigurationError` naming the setting
    and why: ... `local_data_parallel_training_loop` ... (`local_control`: its ranks are threads of
    one process; FSDP2 shards over one process per rank)"."""
    x, y = torch.randn(8, 2), torch.zeros(8, dtype=torch.long)
    batches = lamploop.tensor_batches(x, y, batch_size=2)
    for strategy in ("fsdp", "powersgd-1"):
        replicas = [(lamploop.SupervisedModel(torch.nn.Linear(2, 2)), batches, None) for _ in range(2)]
        with pytest.raises(ConfigurationError, match=f"'{strategy}'"):
            anyio.run(
                lambda r=replicas, s=strategy: lamploop.local_data_parallel_training_loop(
                    r, lambda params: torch.optim.SGD(params, lr=0.1), 1, strategy=s
                )
            )


# --- exact strategies against one process ---------------------------------------------------


@multiprocess
@pytest.mark.parametrize("strategy", worker.EXACT_STRATEGIES)
def test_exact_strategies_equal_one_process_on_uneven_streams(
    ranks: list[dict[str, Any]], strategy: str
) -> None:
    """docs/concepts/sync-strategies.md: "Whatever the strategy, one optimizer step uses the
    gradient of *(sum of the losses of every example of the step, on every rank) / (number of
    those examples)*"; docs/strategies.md: "Every strategy keeps lamploop's example weighting ...
    and the uneven-stream rule", "With plain SGD and `H = 1` this is all-reduce ... the same losses
    and parameters to `1e-12` in float64", "At rank `min(n, m)` with every matrix compressed the
    sum is exact (tested to `1e-10` in float64)"; docs/distributed.md: "parameters | identical
    because updates are identical | broadcast from rank 0"; docs/architecture.md: "Then
    `strategy="float64_all_reduce"` works in `fit`, the drivers and
    `local_data_parallel_training_loop`" (here through `one_epoch` over a process group).

    2 ranks, 11 batches of 8 (the last of 6, on rank 0 alone), 2 passes of plain SGD, float64."""
    got = records(ranks, f"exact/{strategy}")
    reference = exact_reference(worker.EXACT, passes=worker.EXACT["passes"])
    tolerance = 1e-10 if strategy == "acc_powersgd_full" else 1e-12
    for r, rank in enumerate(got):
        assert max_diff(rank["params"][-1], reference["params"]) <= tolerance, f"rank {r}"
        assert rank["losses"] == pytest.approx(reference["losses"], abs=tolerance, rel=0)
    assert bitwise_equal(got[0]["params"][-1], got[1]["params"][-1]), "the ranks ended apart"
    assert got[0]["losses"][1] < got[0]["losses"][0]


@multiprocess
def test_fsdp_over_gloo_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    """docs/strategies.md (fsdp): "`tests/sync/test_fsdp.py` also checks, on 2 and 3 Gloo ranks in
    float64 (...; 62 examples dealt round robin, so streams are uneven, also inside a step), that
    the parameters after 1-2 epochs equal ... plain one-process training on the same examples,
    to `1e-10`"; the doc's `one_epoch` example: `FullyShard(...)`, `strategy.shard(collectives,
    module)`, the optimizer over the shards, `ProcessGroupChannel(collectives, strategy)`."""
    got = records(ranks, "fsdp")
    reference = exact_reference(worker.EXACT, passes=worker.EXACT["passes"])
    for r, rank in enumerate(got):
        assert max_diff(rank["params"], reference["params"]) <= 1e-10, f"rank {r}"
        assert rank["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)


# --- against PyTorch's DDP comm hooks --------------------------------------------------------


@multiprocess
@pytest.mark.parametrize(
    ("strategy", "hook", "tolerance"),
    [
        pytest.param("all_reduce", "allreduce", 1e-12, id="all_reduce-vs-allreduce_hook"),
        pytest.param("acc_powersgd_full", "powersgd_full", 1e-10, id="powersgd_full_rank-vs-powerSGD_hook"),
    ],
)
def test_exact_strategies_equal_ddp_with_its_hook(
    ranks: list[dict[str, Any]], strategy: str, hook: str, tolerance: float
) -> None:
    """docs/distributed.md: "`all_reduce` ... same pattern as `DistributedDataParallel`";
    docs/strategies.md: "At rank `min(n, m)` with every matrix compressed the sum is exact
    (tested to `1e-10` in float64)". The references: DDP with `default_hooks.allreduce_hook`, and
    with `powerSGD_hook` at rank min(n, m) with every matrix compressed (`min_compression_rate=0`,
    error feedback and warm start on, `start_powerSGD_iter=2`, the least torch allows then).

    2 ranks, 4 steps of 8 + 8 examples (DDP averages the ranks' means: equal counts), 2 passes."""
    mine, theirs = records(ranks, f"even/{strategy}"), records(ranks, f"ddp/{hook}")
    reference = exact_reference(worker.EVEN, passes=worker.EVEN["passes"])
    for r in range(worker.NRANKS):
        assert max_diff(mine[r]["params"], theirs[r]["params"]) <= tolerance, f"rank {r}"
        assert max_diff(mine[r]["params"], reference["params"]) <= tolerance, f"rank {r}"


@multiprocess
@pytest.mark.parametrize(
    ("strategy", "hook", "bits"),
    [
        pytest.param("all_reduce_bf16", "bf16", 8, id="bf16-vs-bf16_compress_hook"),
        pytest.param("all_reduce_fp16", "fp16", 11, id="fp16-vs-fp16_compress_hook"),
    ],
)
def test_compressed_all_reduce_within_its_rounding_and_near_ddp_hook(
    ranks: list[dict[str, Any]], strategy: str, hook: str, bits: int
) -> None:
    """docs/strategies.md: "bf16 ... keeps 8 significant bits, and
    tests/sync/test_strategies_compression.py checks every reduced gradient within `(ranks + 1) *
    2^-8` of the largest fp32 one, step after step. fp16 keeps 11 bits"; the table: "each rank's
    gradient and every partial sum rounded to 8 significant bits", "rounded to 11 bits".

    Each step's reduced gradient (float32 model) is checked against the exact float64 gradient at
    the same point, within `(ranks + 1) * 2^-bits` of its largest entry; the run ends where DDP
    with PyTorch's own `bf16_compress_hook` / `fp16_compress_hook` ends, within what those
    roundings allow (each step's update within `2 lr (ranks + 1) 2^-bits max|g|` of the other's)."""
    mine, theirs = records(ranks, f"even/{strategy}"), records(ranks, f"ddp/{hook}")
    plan = plan_of(worker.EVEN, dtype=torch.float32)
    bound = (worker.NRANKS + 1) * 2.0**-bits
    allowance = 0.0
    for r, rank in enumerate(mine):
        assert len(rank["grads"]) == len(plan) * worker.EVEN["passes"]
        for k, (before, grads) in enumerate(zip(rank["before"], rank["grads"], strict=True)):
            exact = exact_step_gradient(before, worker.EVEN, plan[k % len(plan)])
            largest = max_abs(exact)
            error = max_diff(grads, exact)
            assert error <= bound * largest, f"rank {r}, step {k}: {error:.3g} > {bound * largest:.3g}"
            allowance += 2 * worker.EVEN["lr"] * bound * largest
        assert rank["losses"][1] < rank["losses"][0]
    assert bitwise_equal(mine[0]["params"], mine[1]["params"]), "the ranks ended apart"
    for r in range(worker.NRANKS):
        assert max_diff(mine[r]["params"], theirs[r]["params"]) <= allowance, f"rank {r}"


@multiprocess
def test_fp16_overflow_is_resent_in_full_width_and_the_scale_halves_then_grows(
    ranks: list[dict[str, Any]],
) -> None:
    """docs/strategies.md: "fp16 keeps 11 bits but overflows above 65504: it travels pre-divided by
    the number of ranks and multiplied by a factor every rank holds alike (from `2^16`; halved when
    a reduced bucket holds an inf or NaN, that bucket then resent in full width, so the step is
    still right; doubled after 200 clean steps)"; help(CompressedAllReduce): "growth_interval: fp16
    only: steps without an overflow before the factor doubles".

    `CompressedAllReduce(wire="fp16", growth_interval=2)`, a linear model at a fixed point (lr 0):
    the first step's gradient (~1e3) overflows fp16 at any factor near 2^16, the next five
    (~1e-4) never do."""
    got = records(ranks, "fp16_scale")
    module = worker.linear_fp16_model()
    plan = worker.fp16_batches(module)
    interval = worker.FP16["growth_interval"]
    for r, rank in enumerate(got):
        for k, grads in enumerate(rank["grads"]):
            twin = copy.deepcopy(module).double()
            batches = list(plan[k])  # one batch per rank
            total = sum(len(t) for _, t in batches)
            loss = (
                sum(worker.squared_error_sum(twin(bx.double()), t.double())[0] for bx, t in batches) / total
            )
            exact = [g.detach() for g in torch.autograd.grad(loss, list(twin.parameters()))]
            largest = max_abs(exact)
            tolerance = (1e-5 if k == 0 else (worker.NRANKS + 1) * 2.0**-11) * largest
            assert max_diff(grads, exact) <= tolerance, f"rank {r}, step {k}"
        expected = [2.0 ** (15 + k // interval) for k in range(len(rank["scales"]))]
        assert rank["scales"] == expected, f"rank {r}: the factor after each step"
        assert rank["good_steps"][0] == 0


# --- PowerSGD against its definition -----------------------------------------------------------


def _by_index(state: dict[str, torch.Tensor], kind: str) -> dict[int, torch.Tensor]:
    """The state's tensors of one kind ("q" or "error"), by parameter index (keys "<kind>.<i>")."""
    out = {}
    for key, value in state.items():
        head, _, index = key.rpartition(".")
        if head == kind and index.isdigit():
            out[int(index)] = value
    return out


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """docs/strategies.md: "a convolution kernel as `out x rest`"."""
    return t.reshape(t.shape[0], -1)


@multiprocess
@pytest.mark.parametrize(
    ("check", "rank_of", "compressed"),
    [
        pytest.param("powersgd/powersgd1", 1, {0, 2}, id="powersgd1"),
        pytest.param("powersgd/powersgd4", 4, {0}, id="powersgd4"),
        pytest.param("powersgd_conv/powersgd1", 1, {0, 2}, id="powersgd1-conv1d"),
    ],
)
def test_powersgd_follows_the_power_iteration_with_error_feedback(
    ranks: list[dict[str, Any]], check: str, rank_of: int, compressed: set[int]
) -> None:
    """docs/strategies.md: "Each weight matrix's gradient `M` (`n x m`, a convolution kernel as
    `out x rest`) is sent as two thin factors: `P = M Q` is summed over ranks and orthonormalised
    (QR), then `Q = M^T P` is summed, and every rank uses `P Q^T`. What a rank's projection missed
    is its error feedback, added to its next gradient, so nothing is lost, only delayed; `Q` is
    kept from step to step (warm start) ... Tensors that would not shrink `min_compression_ratio`
    times (default 2: biases, the last layer at small ranks) go whole ... with rank 1 the error
    feedback is checked to lose nothing: what was applied plus what the ranks still owe equals
    every gradient sent"; "The error feedback differs from rank to rank"; help(PowerSGD):
    "compress a gradient only if ``n*m >= ratio * r*(n+m)``", "rank: the factors' rank ``r``
    (capped per matrix at ``min(n, m)``)"; "Every strategy keeps ... the uneven-stream rule".

    float64, 2 ranks, 17 batches of 8 (the last of 4, rank 1 idle in the last step), 2 passes:
    MLP 16-32-4, or Conv1d(2, 16, 3) + Linear(64, 4). Every step's applied gradient is predicted
    from the ranks' own gradients (computed here), their error feedback and `Q` after the step
    before; the first step's from its own subspace."""
    got = records(ranks, check)
    shapes = [tuple(t.shape) for t in got[0]["records"][0]["before"]]
    by_rule = set()
    for i, shape in enumerate(shapes):
        if len(shape) >= 2:
            n, m = shape[0], math.prod(shape[1:])
            if n * m >= 2.0 * min(rank_of, n, m) * (n + m):
                by_rule.add(i)
    assert by_rule == compressed  # the documented rule, on these shapes
    steps_ = list(zip(got[0]["records"], got[1]["records"], strict=True))
    plan_length = len(steps_) // 2
    assert all(float(g.abs().max()) == 0 for g in steps_[plan_length - 1][1]["own"]), "rank 1 idle at the end"
    for k, (a, b) in enumerate(steps_):
        assert set(_by_index(a["state"], "q")) == compressed, f"step {k}: the tensors kept as factors"
        for i in range(len(shapes)):
            summed = a["own"][i] + b["own"][i]  # the exact gradient of the step's mean loss
            applied = a["applied"][i]
            assert torch.equal(applied, b["applied"][i]), f"step {k}, tensor {i}: the ranks applied different"
            if i not in compressed:
                assert max_diff([applied], [summed]) <= 1e-12 * max_abs([summed]), (
                    f"step {k}, tensor {i} sent whole"
                )
                continue
            q_a, q_b = _by_index(a["state"], "q")[i], _by_index(b["state"], "q")[i]
            assert torch.equal(q_a, q_b), f"step {k}: Q differs between the ranks"
            applied, summed = _matrix(applied), _matrix(summed)
            assert torch.linalg.matrix_rank(applied, rtol=1e-9) <= rank_of
            errors = [_matrix(_by_index(a["state"], "error")[i]), _matrix(_by_index(b["state"], "error")[i])]
            if k == 0:
                m = summed
                u = torch.linalg.svd(applied).U[:, :rank_of]  # the subspace it projected on
                prediction = u @ u.T @ m
            else:
                before = steps_[k - 1]
                owed = [_matrix(_by_index(before[r]["state"], "error")[i]) for r in range(worker.NRANKS)]
                ms = [
                    _matrix(a["own"][i]) + owed[0],
                    _matrix(b["own"][i]) + owed[1],
                ]  # M: gradient + feedback
                q_prev = _by_index(before[0]["state"], "q")[i]
                p = torch.linalg.qr(ms[0] @ q_prev + ms[1] @ q_prev).Q  # P = sum(M Q), orthonormalised
                q = ms[0].T @ p + ms[1].T @ p  # Q = sum(M^T P)
                prediction = p @ q.T
                m = ms[0] + ms[1]
                basis = torch.linalg.qr(q).Q  # the Q kept for the next step spans sum(M^T P)'s columns
                assert float((q_a - basis @ basis.T @ q_a).abs().max()) <= 1e-9 * float(q_a.abs().max())
            size = float(m.abs().max())
            assert float((applied - prediction).abs().max()) <= 1e-9 * size, f"step {k}, tensor {i}"
            # nothing lost: what the ranks owe now is what they had to send minus what was applied
            assert float((errors[0] + errors[1] - (m - applied)).abs().max()) <= 1e-9 * size, f"step {k}"
    last = steps_[-1]
    for i in compressed:
        sent = sum(a["own"][i] + b["own"][i] for a, b in steps_)
        applied = sum(a["applied"][i] for a, _ in steps_)
        owed = _by_index(last[0]["state"], "error")[i] + _by_index(last[1]["state"], "error")[i]
        assert max_diff([applied + owed.reshape(sent.shape)], [sent]) <= 1e-10 * max_abs([sent]), (
            "feedback lost"
        )
        assert not torch.equal(
            _by_index(last[0]["state"], "error")[i], _by_index(last[1]["state"], "error")[i]
        )
    assert got[0]["losses"][1] < got[0]["losses"][0]
    assert bitwise_equal(got[0]["params"], got[1]["params"])


# --- Local SGD and DiLoCo against their definitions -------------------------------------------


@multiprocess
@pytest.mark.parametrize("strategy", list(worker.LOCAL_STRATEGIES))
def test_local_sgd_and_diloco_equal_their_float64_references(
    ranks: list[dict[str, Any]], strategy: str
) -> None:
    """docs/strategies.md: "Each rank scales its gradients to the mean loss of *its own* examples
    and steps its own optimizer; every `H` steps the ranks average their parameters, each weighted
    by the examples it trained on since the last average. A rank with no batch left weighs nothing
    and does not step ... The end of every pass ... averages too: validation, checkpoints and the
    next epoch see one model, the same on every rank", "optimizer state is never averaged";
    "`diloco8` adds DiLoCo's outer optimizer: the change from the last average to the new one is
    an outer gradient, and SGD with Nesterov momentum (`lr=0.7, momentum=0.5`) steps on it";
    "`tests/sync/test_strategy_references.py` checks `diloco8` against a float64 reference of the
    paper's algorithm"; "`OuterNesterov()` keeps the paper's 0.7 and 0.9"; "register larger `H`
    with `LocalSGD(every_n_steps=H)`".

    `local_sgd8`, `diloco8`, `LocalSGD(4, OuterNesterov())` and `LocalSGD(5)` (5 does not divide
    the pass: the reference counts H steps from the last average, the pass end's included).
    2 ranks, 31 batches of 4 (the last of 2): 16 steps a pass, rank 1 idle in the last; inner SGD
    with momentum 0.9; 2 passes; float64."""
    got = records(ranks, f"local/{strategy}")
    every, outer = worker.LOCAL_STRATEGIES[strategy]
    reference = local_sgd_reference(worker.LOCAL, every, outer)
    for p in range(worker.LOCAL["passes"]):
        assert bitwise_equal(got[0]["params"][p], got[1]["params"][p]), f"pass {p}: the ranks ended apart"
    for r, rank in enumerate(got):
        assert max_diff(rank["params"][-1], reference["params"]) <= 1e-12, f"rank {r}"
        assert rank["losses"] == pytest.approx(reference["losses"], abs=1e-12, rel=0)
    assert got[0]["losses"][1] < got[0]["losses"][0]


@multiprocess
@pytest.mark.parametrize("strategy", ["all_reduce", "powersgd1", "local_sgd8"])
def test_buffers_are_made_alike_at_every_pass_end(ranks: list[dict[str, Any]], strategy: str) -> None:
    """docs/distributed.md "Strategies and their trade-offs": "Buffers such as BatchNorm running
    statistics are made alike on every rank at the end of each training pass ...: floating buffers
    become their mean over the ranks (for BatchNorm's running mean, the running mean of every
    rank's batches), integer buffers (`num_batches_tracked`) the root's ... Within an epoch each
    rank normalises with its own statistics"; docs/strategies.md (local SGD): "validation,
    checkpoints and the next epoch see one model, the same on every rank".

    MLP with a BatchNorm1d, float64, 2 ranks, 16 batches of 4 on rank 0 and 15 on rank 1 a pass,
    2 passes. `all_reduce` and `local_sgd8` against their references (which keep each rank's
    statistics apart and average them at each pass end); `powersgd1`: alike on both ranks."""
    got = records(ranks, f"buffers/{strategy}")
    per_pass = len(plan_of(worker.BUFFERS))
    for p in range(worker.BUFFERS["passes"]):
        a, b = got[0]["buffers"][p], got[1]["buffers"][p]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"pass {p}: buffers differ"
        tracked = [v for k, v in a.items() if k.endswith("num_batches_tracked")]
        assert [int(v) for v in tracked] == [per_pass * (p + 1)], "num_batches_tracked is not the root's"
        assert bitwise_equal(got[0]["params"][p], got[1]["params"][p]), f"pass {p}: parameters differ"
    if strategy == "powersgd1":
        return
    reference = (
        exact_reference(worker.BUFFERS, passes=worker.BUFFERS["passes"])
        if strategy == "all_reduce"
        else local_sgd_reference(worker.BUFFERS, 8, None)
    )
    final = got[0]["buffers"][-1]
    for name, value in reference["buffers"].items():
        assert float((final[name].double() - value.double()).abs().max()) <= 1e-12, name
    assert max_diff(got[0]["params"][-1], reference["params"]) <= 1e-12
    assert got[0]["losses"] == pytest.approx(reference["losses"], abs=1e-12, rel=0)


@multiprocess
def test_only_plain_sums_say_they_reduce_linearly(ranks: list[dict[str, Any]]) -> None:
    """docs/distributed.md: "That correction after the sum is right only for a strategy whose
    reduction is linear and keeps nothing from the gradients (`all_reduce`, `reduce_to_root`,
    `all_reduce_bf16`: their syncs say `reduces_linearly = True`). Every other strategy
    (PowerSGD's error feedback, fp16's range and scale, local SGD, and any strategy you add unless
    it says otherwise) is handed the step's exact units"."""
    flags = records(ranks, "linear_flags")[0]["flags"]
    assert {"all_reduce", "reduce_to_root", "all_reduce_bf16", "acc_float64_all_reduce", *STATEFUL} <= set(
        flags
    )
    assert {name for name, linear in flags.items() if linear} == {
        "all_reduce",
        "reduce_to_root",
        "all_reduce_bf16",
    }


@multiprocess
def test_reduce_to_root_under_fit_keeps_optimizer_state_on_the_root_only(ranks: list[dict[str, Any]]) -> None:
    """docs/distributed.md: "`reduce_to_root` ... optimizer | only rank 0 steps; optimizer state
    only there ... memory | optimizer state once"; docs/concepts/sync-strategies.md: "R ranks with
    batches of b train like one rank with batches of R * b".

    `fit(strategy="reduce_to_root")` on 2 ranks, SGD with momentum 0.9, 1 epoch, float64."""
    got = records(ranks, "fit_reduce_to_root")
    reference = exact_reference(worker.FIT, passes=1)
    assert max_diff(got[0]["params"], reference["params"]) <= 1e-12
    assert got[0]["optimizer_states"]
    assert got[0]["optimizer_states"][-1] > 0
    assert all(n == 0 for n in got[1]["optimizer_states"]), f"rank 1's optimizer holds state: {got[1]}"


@multiprocess
def test_auto_is_all_reduce_under_fit(ranks: list[dict[str, Any]]) -> None:
    """help(fit): "strategy ...: as in :func:`drive_distributed_training` (``"auto"`` is
    ``all_reduce`` here: every rank has the optimizer factory)"; docs/distributed.md "`all_reduce`
    ... optimizer | replicated: every rank steps".

    `fit(strategy="auto")` on 2 ranks, SGD with momentum 0.9, 1 epoch, float64."""
    got = records(ranks, "fit_auto")
    reference = exact_reference(worker.FIT, passes=1)
    assert max_diff(got[0]["params"], reference["params"]) <= 1e-12
    for r in range(worker.NRANKS):
        assert got[r]["optimizer_states"], f"rank {r} made no optimizer"
        assert got[r]["optimizer_states"][-1] > 0, f"rank {r} did not step"


@multiprocess
def test_reduce_to_root_one_epoch_steps_only_the_root(ranks: list[dict[str, Any]]) -> None:
    """help(lamploop.sync.strategy): "A training pass drives it like this, on every rank alike: ...
    `optimizer step  # every rank, or only the root (steps_on_every_rank)`"; docs/concepts/
    sync-strategies.md: "`reduce_to_root` ... optimizer | only rank 0 steps; optimizer state only
    there"; help(one_epoch): "step_optimizer: called once per step after the gradients are
    complete".

    `one_epoch` over a `reduce_to_root` channel on 2 ranks, each rank passing its optimizer's step
    (SGD, then SGD with momentum), uneven streams, float64."""
    plain, momentum = records(ranks, "exact/reduce_to_root"), records(ranks, "reduce_to_root_momentum")
    reference = exact_reference({**worker.EXACT, "momentum": 0.9}, passes=worker.EXACT["passes"])
    for r in range(worker.NRANKS):
        assert max_diff(momentum[r]["params"][-1], reference["params"]) <= 1e-12, f"rank {r}"
    assert plain[0]["step_calls"] == 2 * len(plan_of(worker.EXACT))
    assert momentum[0]["optimizer_state"] == 4
    assert plain[1]["step_calls"] == 0, f"the follower stepped {plain[1]['step_calls']} times"
    assert momentum[1]["optimizer_state"] == 0, "the follower's optimizer holds state"


# --- the plugin interface ------------------------------------------------------------------------


@multiprocess
@pytest.mark.parametrize("strategy", ["acc_recording", "acc_recording_linear"])
def test_a_user_strategy_is_driven_as_documented(ranks: list[dict[str, Any]], strategy: str) -> None:
    """docs/concepts/sync-strategies.md: "`sync.begin_pass()` / for each step: for each of the
    step's batches: if it is the last: `sync.last_backward()`; backward of (loss_sum / expected);
    `sync.step_examples(...)`  # only a sync that has it; `sync.reduce(expected / global example
    count)`; optimizer step; `sync.after_step()` / `sync.end_pass()`"; docs/architecture.md: "By
    default the loop hands `reduce` gradients in the step's exact units: before `reduce`, the sum
    over ranks of `.grad` is the gradient of the step's mean loss ... and `scale` is exactly `1.0`,
    at every step, the first of a pass included ... A sync whose `reduce` is linear ... may opt
    into the faster path with a class attribute `reduces_linearly = True`: the loop then
    backpropagates with a guess of the step's example count (the previous step's, `1` at a pass's
    first step) ... and `reduce(scale)` must multiply what it reduced by `scale`"; help(
    CountsStepExamples.step_examples): "``expected`` (the loss divisor of backward), this rank's
    and all ranks' examples".

    The documented `Float64Sync`, recording its calls; 2 ranks, 2 batches accumulated a step,
    uneven streams: 3 steps of 32, 32 and 20 examples; float64."""
    linear = strategy.endswith("linear")
    got = records(ranks, f"plugin/{strategy}")
    plan = plan_of(worker.PLUGIN, accumulate=worker.PLUGIN["accumulate"])
    totals = [sum(len(by) for rank in step for _, by in rank) for step in plan]
    assert totals == [32, 32, 20]
    expected_calls = (
        ["begin_pass"] + ["last_backward", "step_examples", "reduce", "after_step"] * 3 + ["end_pass"]
    )
    guesses = [1, *totals[:-1]] if linear else totals
    module = worker.mlp(worker.PLUGIN["dims"])
    reference = exact_reference(worker.PLUGIN, passes=1, accumulate=worker.PLUGIN["accumulate"])
    for r, rank in enumerate(got):
        assert rank["calls"] == expected_calls, f"rank {r}"
        locals_ = [sum(len(by) for _, by in step[r]) for step in plan]
        assert rank["examples"] == [[g, n, t] for g, n, t in zip(guesses, locals_, totals, strict=True)]
        assert rank["scales"] == [g / t for g, t in zip(guesses, totals, strict=True)]
        assert max_diff(rank["params"], reference["params"]) <= 1e-12, f"rank {r}"
        assert rank["loss"] == pytest.approx(reference["losses"][0], abs=1e-12, rel=0)
    # the units: sum over ranks of what reduce was handed, times scale, is the step's exact gradient
    optimizer = torch.optim.SGD(module.parameters(), lr=worker.PLUGIN["lr"])
    for k, step in enumerate(plan):
        exact = exact_step_gradient([p.detach() for p in module.parameters()], worker.PLUGIN, step)
        handed = [
            (a + b) * got[0]["scales"][k]
            for a, b in zip(got[0]["handed"][k], got[1]["handed"][k], strict=True)
        ]
        assert max_diff(handed, exact) <= 1e-12 * max_abs(exact), f"step {k}"
        for p, g in zip(module.parameters(), exact, strict=True):
            p.grad = g.clone()
        optimizer.step()


@multiprocess
def test_a_user_strategy_trains_through_fit(ranks: list[dict[str, Any]]) -> None:
    """docs/architecture.md: "`lamploop.register_strategy(Float64AllReduce(), replace=True)` ...
    Then `strategy="float64_all_reduce"` works in `fit`, the drivers and
    `local_data_parallel_training_loop`"; docs/concepts/sync-strategies.md: "R ranks with batches
    of b train like one rank with batches of R * b".

    The documented plugin (registered on both ranks), `fit` on 2 ranks under torchrun's variables,
    1 epoch of SGD with momentum, unshuffled batches of 4 dealt round robin; float64."""
    got = records(ranks, "fit_plugin")
    reference = exact_reference({**worker.FIT}, passes=1)
    assert max_diff(got[0]["params"], reference["params"]) <= 1e-12


# --- checkpoints ---------------------------------------------------------------------------------


@multiprocess
@pytest.mark.parametrize("strategy", [*STATEFUL, "acc_fp16_grow2"])
def test_sync_state_round_trips_through_state_dict(ranks: list[dict[str, Any]], strategy: str) -> None:
    """docs/strategies.md "Checkpoints": "Each strategy's state is its `GradientSync.state_dict()`
    (tensors only, safetensors-ready) and `load_state_dict()`: PowerSGD's `Q` and error feedback,
    fp16's scale, local SGD's window and DiLoCo's last average and momentum."

    2 passes in one go against: 1 pass, the sync's state through safetensors bytes, a new channel
    and sync with that state loaded (model and each rank's optimizer state restored too), 1 pass.
    For PowerSGD and DiLoCo the same without loading the state must differ (the state matters).
    `acc_fp16_grow2` is fp16 with `growth_interval=2`, so that its factor moves (11 steps a pass)."""
    got = records(ranks, f"roundtrip/{strategy}")
    for r, rank in enumerate(got):
        assert rank["restored_state"], f"rank {r}: a stateful strategy with an empty state_dict"
        assert rank["restored_state_kinds"] == ["Tensor"], f"rank {r}: {rank['restored_state_kinds']}"
        assert bitwise_equal(rank["restored"], rank["uninterrupted"]), f"rank {r}: resumed != uninterrupted"
        if strategy in ("powersgd1", "powersgd4", "diloco8"):
            assert not bitwise_equal(rank["not_restored"], rank["uninterrupted"]), (
                f"rank {r}: the state is unused"
            )
        if strategy == "acc_fp16_grow2":
            assert float(rank["restored_state"]["fp16_scale"]) != 2.0**16, "the factor did not move"


@multiprocess
@pytest.mark.parametrize("strategy", STATEFUL)
def test_fit_resumes_every_ranks_sync_state_bit_for_bit(ranks: list[dict[str, Any]], strategy: str) -> None:
    """docs/strategies.md "Checkpoints": "then `fit` saves **every rank's** state at every epoch end
    ... the checkpoint holds `extra-sync.safetensors` for rank 0 and `extra-sync.rank<r>.safetensors`
    for the others. On resume the root sends each rank its own when the ranks meet ...
    `tests/sync/test_sync_state.py` stops a 2-rank `powersgd1` and a `diloco8` run after one epoch,
    resumes it, and checks that the final model equals an uninterrupted run's bit for bit"; "The
    error feedback differs from rank to rank".

    `fit` on 2 ranks (torchrun's variables): 2 epochs in one run, against 1 epoch then a second
    run that resumes it to 2, rank 1 given a `checkpoint_dir` of its own that never holds a
    checkpoint ("so no rank needs to read the checkpoint directory"); SGD with momentum,
    shuffled batches, float64."""
    got = records(ranks, f"fit_resume/{strategy}")
    root = got[0]
    assert bitwise_equal(root["resumed"], root["whole"]), "the resumed run ended elsewhere"
    assert got[1]["written"] == [], "rank 1 wrote into its own checkpoint_dir"
    assert not bitwise_equal(root["first"], root["whole"])
    assert sorted(root["files"]) == ["epoch-000001", "epoch-000002"]
    for name, files in root["files"].items():
        assert "extra-sync.safetensors" in files, name
        assert "extra-sync.rank1.safetensors" in files, name
    if strategy.startswith("powersgd"):
        directory = Path(root["root"]) / "whole" / "epoch-000001"
        mine = _by_index(load_file(directory / "extra-sync.safetensors"), "error")
        theirs = _by_index(load_file(directory / "extra-sync.rank1.safetensors"), "error")
        assert mine
        assert mine.keys() == theirs.keys()
        assert any(not torch.equal(mine[i], theirs[i]) for i in mine), "rank 1's file holds rank 0's state"


@multiprocess
def test_fit_refuses_step_checkpoints_with_stateful_strategies(ranks: list[dict[str, Any]]) -> None:
    """docs/strategies.md "Checkpoints": "such a checkpoint is consistent at epoch ends only: `fit`
    refuses `checkpoint_every_n_steps` and `checkpoint_every_seconds` with these strategies (make
    epochs shorter instead)"; lamploop.errors: "Errors about bad arguments ... Each message names
    the offending value".

    On 2 ranks, every stateful strategy with each setting: a ConfigurationError on both ranks,
    naming the setting and the strategy, at once."""
    got = records(ranks, "fit_refusals")
    for r, rank in enumerate(got):
        cases = {case: outcome for case, outcome in rank.items() if case != "wall_s"}
        assert len(cases) == 2 * len(STATEFUL)
        for case, outcome in cases.items():
            strategy, setting = case.split("/")
            assert outcome["type"] == "ConfigurationError", f"rank {r}, {case}: {outcome}"
            assert setting in outcome["message"], f"rank {r}, {case}"
            assert strategy in outcome["message"], f"rank {r}, {case}"
            assert outcome["seconds"] < 10, f"rank {r}, {case}"


@multiprocess
def test_ranks_asking_for_different_strategies_fail_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """docs/distributed.md: "Every rank must ask for the same strategy; a mismatch fails on every rank
    with `DistributedError` at start"; docs/concepts/sync-strategies.md: "a mismatch fails on every
    rank at start".

    Rank 0 asks `fit` for `all_reduce`, rank 1 for `powersgd1`: both raise, naming the strategy,
    within seconds (nothing hangs)."""
    got = records(ranks, "fit_mismatch")
    for r, rank in enumerate(got):
        assert rank["type"] == "DistributedError", f"rank {r}: {rank}"
        assert "LamploopError" in rank["mro"]
        assert "strategy" in rank["message"], f"rank {r}: {rank['message']}"
        assert rank["asked"] in rank["message"], f"rank {r}: {rank['message']}"
        assert rank["seconds"] < 15, f"rank {r}"
    assert issubclass(DistributedError, LamploopError)


@multiprocess
def test_the_roots_mismatch_error_names_the_differing_rank_and_value(ranks: list[dict[str, Any]]) -> None:
    """lamploop.errors: "Each message names the offending value and where it came from";
    docs/distributed.md: "Every rank must ask for the same strategy; a mismatch fails on every rank
    with `DistributedError` at start".

    Rank 0 asks `fit` for `all_reduce`, rank 1 for `powersgd1`: every rank's message names the
    value that differs from the root's ('powersgd1') and where it came from (rank 1)."""
    got = records(ranks, "fit_mismatch")
    for r, rank in enumerate(got):
        assert "'powersgd1'" in rank["message"], f"rank {r}: {rank['message']}"
        assert "rank 1" in rank["message"], f"rank {r}: {rank['message']}"
