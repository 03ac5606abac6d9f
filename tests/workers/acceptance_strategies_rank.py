"""One rank of tests/sync/test_acceptance_docs_strategies.py: every sync strategy over real Gloo.

``python acceptance_strategies_rank.py RANK PORT OUT_DIR``: two of these processes (ranks 0
and 1) meet in a ``torch.distributed`` Gloo default group on 127.0.0.1:PORT and run every
check of ``checks()`` in turn over it, writing what each rank saw (parameters, gradients, sync
state, errors) to ``OUT_DIR/rank<R>.pt``. The test computes its references from the data
and models defined here (plain torch, nothing of lamploop); the PyTorch DDP comm-hook
references need a process group, so they run here, beside lamploop's runs.

``fit`` is run with torchrun's variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``; docs/distributed.md "torchrun, one node"), this harness
playing torchrun: rank 0 hosts a fresh store for every call, so one pair of processes runs
every ``fit`` without spawning more.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for workers.records
from workers.records import save_record

NRANKS = 2
TIMEOUT_S = 20.0
SMALL = (6, 10, 3)  # MLP in-hidden-out; every weight matrix is full rank with >= 6 examples a step
WIDE = (16, 32, 4)  # 32x16 is compressed by powersgd4, 4x32 only by powersgd1

Batch = tuple[torch.Tensor, torch.Tensor]


# --- data and models, shared with the test (its references are built from these) ---------


def data(n: int, dims: tuple[int, int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dims[0], generator=generator, dtype=torch.float64)
    y = torch.randint(0, dims[2], (n,), generator=generator)
    return x, y


def mlp(dims: tuple[int, int, int], dtype: torch.dtype = torch.float64, seed: int = 1) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.Tanh(), nn.Linear(dims[1], dims[2]))
    return module.to(dtype)


CONV_IN = (2, 6)  # channels x length of the conv scenario's examples (dims[0] == 12 numbers)


def model_for(scenario: Mapping[str, Any], dtype: torch.dtype = torch.float64) -> nn.Module:
    """The scenario's model: ``mlp``; ``"conv"``: a Conv1d (kernel 16x2x3, sent as 16x6) and a
    Linear; ``"bn"``: an MLP with a BatchNorm1d (running statistics: buffers)."""
    kind, dims = scenario.get("kind", "mlp"), scenario["dims"]
    if kind == "mlp":
        return mlp(dims, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if kind == "conv":
            length = CONV_IN[1] - 2
            module = nn.Sequential(
                nn.Unflatten(1, CONV_IN),
                nn.Conv1d(CONV_IN[0], dims[1], 3),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(dims[1] * length, dims[2]),
            )
        elif kind == "bn":
            module = nn.Sequential(
                nn.Linear(dims[0], dims[1]), nn.BatchNorm1d(dims[1]), nn.Tanh(), nn.Linear(dims[1], dims[2])
            )
        else:
            raise ValueError(kind)
    return module.to(dtype)


def cut(x: torch.Tensor, y: torch.Tensor, batch_size: int, dtype: torch.dtype = torch.float64) -> list[Batch]:
    """Batches in global order: batch ``i`` goes to rank ``i % nranks`` (as ``tensor_batches``)."""
    return [(x[i : i + batch_size].to(dtype), y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def rank_batches(batches: Sequence[Batch], rank: int, nranks: int = NRANKS) -> list[Batch]:
    return list(batches[rank::nranks])


def steps(batches: Sequence[Batch], accumulate: int = 1, nranks: int = NRANKS) -> list[list[list[Batch]]]:
    """``result[step][rank]``: the batches each rank trains on in each optimizer step."""
    per_rank = [rank_batches(batches, r, nranks) for r in range(nranks)]
    count = max(math.ceil(len(b) / accumulate) for b in per_rank)
    return [[b[s * accumulate : (s + 1) * accumulate] for b in per_rank] for s in range(count)]


def ce_sum(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module(x), y, reduction="sum")


def local_gradient(module: nn.Module, batches: Sequence[Batch], divisor: int) -> list[torch.Tensor]:
    """float64 gradient of (this rank's summed loss over ``batches``) / ``divisor`` at ``module``'s point."""
    twin = copy.deepcopy(module).double()
    if not batches:
        return [torch.zeros_like(p) for p in twin.parameters()]
    loss = sum(ce_sum(twin, x.double(), y) for x, y in batches) / divisor
    return [g.detach() for g in torch.autograd.grad(loss, list(twin.parameters()))]


# The settings of each scenario (the test rebuilds its references from them).
EXACT = {"n": 86, "dims": SMALL, "batch": 8, "passes": 2, "lr": 0.1}  # uneven: 11 batches, the last of 6
EVEN = {"n": 64, "dims": SMALL, "batch": 8, "passes": 2, "lr": 0.1}  # 4 steps of 8 + 8 examples
# 17 batches of 8 (the last of 4): 9 steps a pass, the last on rank 0 alone
POWER = {"n": 132, "dims": WIDE, "batch": 8, "passes": 2, "lr": 0.1}
POWER_CONV = {**POWER, "kind": "conv", "dims": (12, 16, 4)}
LOCAL = {"n": 122, "dims": SMALL, "batch": 4, "passes": 2, "lr": 0.05, "momentum": 0.9}  # 16 steps, uneven
BUFFERS = {"n": 122, "dims": SMALL, "batch": 4, "passes": 2, "lr": 0.05, "momentum": 0.9, "kind": "bn"}
ROUNDTRIP = {"n": 84, "dims": WIDE, "batch": 4, "lr": 0.05, "momentum": 0.9}  # 11 steps, uneven
PLUGIN = {"n": 84, "dims": SMALL, "batch": 8, "accumulate": 2, "lr": 0.1}  # 3 steps: 32, 32, 20 examples
FIT = {"n": 80, "dims": WIDE, "batch": 4, "lr": 0.05, "momentum": 0.9}  # 10 steps an epoch
FP16 = {"in": 4, "per_rank_batch": 4, "steps": 6, "growth_interval": 2}

EXACT_STRATEGIES = (
    "all_reduce",
    "reduce_to_root",
    "acc_powersgd_full",
    "acc_local_sgd1",
    "acc_float64_all_reduce",
)
STATEFUL = ("all_reduce_fp16", "powersgd1", "powersgd4", "local_sgd8", "diloco8")
# name: (H, outer (lr, momentum) or None)
LOCAL_STRATEGIES = {
    "local_sgd8": (8, None),
    "diloco8": (8, (0.7, 0.5)),
    "acc_diloco4": (4, (0.7, 0.9)),  # OuterNesterov()'s defaults, the paper's
    "acc_local_sgd5": (5, None),  # H does not divide the pass's 16 steps
}


def fp16_batches(module: nn.Module) -> list[list[Batch]]:
    """``result[step][rank]``: step 0's targets are 1e4 away (its gradient overflows fp16 at any
    scale near 2^16), the later ones 1e-3 away (no overflow even at 2^20)."""
    generator = torch.Generator().manual_seed(3)
    out: list[list[Batch]] = []
    for step in range(FP16["steps"]):
        per_rank = []
        for _ in range(NRANKS):
            x = torch.randn(FP16["per_rank_batch"], FP16["in"], generator=generator)
            with torch.no_grad():
                target = (
                    module(x)
                    + (1e4 if step == 0 else 1e-3)
                    * torch.randn(FP16["per_rank_batch"], 1, generator=generator).sign()
                )
            per_rank.append((x, target))
        out.append(per_rank)
    return out


def squared_error_sum(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``SupervisedModel`` loss: (loss sum, example count)."""
    return ((output - target) ** 2).sum(), int(target.shape[0])


def linear_fp16_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        return nn.Linear(FP16["in"], 1)


# --- the documented plugin (docs/architecture.md "Adding a gradient-sync strategy") --------


def define_plugins() -> dict[str, Any]:
    import attrs

    import lamploop
    from lamploop.sync import Collectives, GradientSync

    class Float64Sync:  # verbatim from docs/architecture.md
        def __init__(self, collectives: Collectives, parameters: Sequence[torch.nn.Parameter]) -> None:
            self.collectives = collectives
            self.parameters = [p for p in parameters if p.requires_grad]

        def begin_pass(self) -> None:
            for p in self.parameters:
                p.grad = None

        def last_backward(self) -> None:
            pass  # nothing starts early

        def reduce(self, scale: float) -> None:
            for p in self.parameters:
                wide = (p.grad if p.grad is not None else torch.zeros_like(p)).double()
                self.collectives.wait(self.collectives.all_reduce([wide]), "float64 gradient sum")
                p.grad = (wide * scale).to(p.dtype)

        def after_step(self) -> None:
            self.begin_pass()

        def end_pass(self) -> None:
            pass

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {}

        def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
            pass

        def close(self, *, abandon: bool) -> None:
            pass

    @attrs.frozen
    class Float64AllReduce:  # verbatim from docs/architecture.md, but for the name
        name: str = "acc_float64_all_reduce"
        steps_on_every_rank: bool = True

        def gradient_sync(self, collectives, parameters, modules, *, bucket_cap_mb) -> GradientSync:  # type: ignore[no-untyped-def]
            return Float64Sync(collectives, parameters)

    class RecordingSync(Float64Sync):
        """Float64Sync that records the calls the loop makes, and what it was handed."""

        log: list[Any]

        def begin_pass(self) -> None:
            self.log.append("begin_pass")
            super().begin_pass()

        def last_backward(self) -> None:
            self.log.append("last_backward")

        def step_examples(self, *, expected: int, local: int, total: int) -> None:
            self.log.append(("step_examples", expected, local, total))

        def reduce(self, scale: float) -> None:
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for p in self.parameters
            ]
            self.log.append(("reduce", scale, grads))
            super().reduce(scale)

        def after_step(self) -> None:
            self.log.append("after_step")
            Float64Sync.begin_pass(self)  # what Float64Sync.after_step does, without logging a begin_pass

        def end_pass(self) -> None:
            self.log.append("end_pass")

    class LinearRecordingSync(RecordingSync):
        reduces_linearly = True

    logs: dict[str, list[Any]] = {}

    @attrs.frozen
    class Recording:
        name: str
        linear: bool
        steps_on_every_rank: bool = True

        def gradient_sync(self, collectives, parameters, modules, *, bucket_cap_mb) -> GradientSync:  # type: ignore[no-untyped-def]
            sync = (LinearRecordingSync if self.linear else RecordingSync)(collectives, parameters)
            sync.log = logs.setdefault(self.name, [])
            return sync

    from lamploop.sync import CompressedAllReduce, LocalSGD, OuterNesterov, PowerSGD

    lamploop.register_strategy(Float64AllReduce(), replace=True)
    lamploop.register_strategy(Recording("acc_recording", linear=False), replace=True)
    lamploop.register_strategy(Recording("acc_recording_linear", linear=True), replace=True)
    lamploop.register_strategy(
        PowerSGD(rank=32, min_compression_ratio=0, name="acc_powersgd_full"), replace=True
    )
    lamploop.register_strategy(LocalSGD(every_n_steps=1, name="acc_local_sgd1"), replace=True)
    lamploop.register_strategy(
        LocalSGD(every_n_steps=4, outer=OuterNesterov(), name="acc_diloco4"), replace=True
    )
    lamploop.register_strategy(LocalSGD(every_n_steps=5, name="acc_local_sgd5"), replace=True)
    lamploop.register_strategy(
        CompressedAllReduce(wire="fp16", growth_interval=FP16["growth_interval"], name="acc_fp16_grow2"),
        replace=True,
    )
    return {"logs": logs}


# --- running lamploop ----------------------------------------------------------------------


class Rank:
    def __init__(self, rank: int, port: int, out: Path) -> None:
        import torch.distributed as dist

        self.rank, self.out = rank, out
        self.dist = dist
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        self.store = dist.TCPStore("127.0.0.1", port, NRANKS, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=self.store, rank=rank, world_size=NRANKS, timeout=timeout)
        self.group = dist.group.WORLD
        self.plugins = define_plugins()
        self.step_calls = 0

    def channel(self, strategy: str) -> Any:
        from lamploop.sync.group_channel import ProcessGroupChannel

        return ProcessGroupChannel.of_group(
            self.group,
            rank=self.rank,
            nranks=NRANKS,
            device=torch.device("cpu"),
            strategy=strategy,
            timeout=TIMEOUT_S,
        )

    def one_pass(
        self,
        module: nn.Module,
        batches: Sequence[Batch],
        channel: Any,
        optimizer: torch.optim.Optimizer,
        *,
        on_step: Callable[[int], None] | None = None,
        accumulate: int = 1,
        epoch: int = 0,
        loss: Any = None,
    ) -> float:
        import anyio

        import lamploop

        count = [0]

        def step() -> None:
            if on_step is not None:
                on_step(count[0])
            count[0] += 1
            self.step_calls += 1
            optimizer.step()

        async def stream() -> Any:
            for batch in batches:
                yield batch

        model = (
            lamploop.SupervisedModel(module) if loss is None else lamploop.SupervisedModel(module, loss=loss)
        )
        return float(
            anyio.run(
                lambda: lamploop.one_epoch(
                    model=model,
                    batches=stream(),
                    channel=channel,
                    step_optimizer=step,
                    epoch=epoch,
                    accumulate_gradient_over_n_batches=accumulate,
                )
            )
        )

    def train(
        self, strategy: str, scenario: Mapping[str, Any], *, dtype: torch.dtype = torch.float64
    ) -> dict[str, Any]:
        """``passes`` passes of plain SGD (or with momentum) over the scenario's batches."""
        x, y = data(scenario["n"], scenario["dims"])
        batches = rank_batches(cut(x, y, scenario["batch"], dtype), self.rank)
        module = model_for(scenario, dtype)
        optimizer = torch.optim.SGD(
            module.parameters(), lr=scenario["lr"], momentum=scenario.get("momentum", 0.0)
        )
        channel = self.channel(strategy)
        losses, params, buffers = [], [], []
        self.step_calls = 0
        try:
            for epoch in range(scenario["passes"]):
                losses.append(self.one_pass(module, batches, channel, optimizer, epoch=epoch))
                params.append([p.detach().clone() for p in module.parameters()])
                buffers.append({k: v.clone() for k, v in module.named_buffers()})
        finally:
            channel.close()
        return {
            "losses": losses,
            "params": params,
            "buffers": buffers,
            "step_calls": self.step_calls,
            "optimizer_state": len(optimizer.state),
        }

    # --- checks: each returns what this rank saw ------------------------------------------

    def check_exact(self, strategy: str) -> dict[str, Any]:
        return self.train(strategy, EXACT)

    def check_even(self, strategy: str, dtype: torch.dtype) -> dict[str, Any]:
        """lamploop's run and, per step, the parameters before it and the reduced gradient."""
        x, y = data(EVEN["n"], EVEN["dims"])
        batches = rank_batches(cut(x, y, EVEN["batch"], dtype), self.rank)
        module = mlp(EVEN["dims"], dtype)
        optimizer = torch.optim.SGD(module.parameters(), lr=EVEN["lr"])
        channel = self.channel(strategy)
        before: list[list[torch.Tensor]] = []
        grads: list[list[torch.Tensor]] = []

        def record(_: int) -> None:
            before.append([p.detach().clone() for p in module.parameters()])
            grads.append([p.grad.detach().clone() for p in module.parameters()])

        try:
            losses = [
                self.one_pass(module, batches, channel, optimizer, on_step=record, epoch=e)
                for e in range(EVEN["passes"])
            ]
        finally:
            channel.close()
        return {
            "losses": losses,
            "params": [p.detach().clone() for p in module.parameters()],
            "before": before,
            "grads": grads,
        }

    def check_ddp(self, hook_name: str, dtype: torch.dtype) -> dict[str, Any]:
        """PyTorch's DistributedDataParallel with one of its own comm hooks, same data and start."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        from torch.nn.parallel import DistributedDataParallel

        x, y = data(EVEN["n"], EVEN["dims"])
        batches = rank_batches(cut(x, y, EVEN["batch"], dtype), self.rank)
        module = mlp(EVEN["dims"], dtype)
        ddp = DistributedDataParallel(module, bucket_cap_mb=25)
        if hook_name == "allreduce":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook_name == "bf16":
            # DDP refuses the hook by name unless NCCL is there; the hook itself runs on Gloo.
            ddp.register_comm_hook(
                None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket)
            )
        elif hook_name == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook_name == "powersgd_full":
            # Every matrix compressed at rank min(n, m) (docs: "At rank min(n, m) with every
            # matrix compressed the sum is exact"); start_powerSGD_iter=2 is the least torch
            # allows with error feedback and warm start (the first 2 steps are plain all-reduce).
            state = powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=max(EVEN["dims"]),
                start_powerSGD_iter=2,
                min_compression_rate=0,
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
            )
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        else:
            raise ValueError(hook_name)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=EVEN["lr"])
        for _ in range(EVEN["passes"]):
            for bx, by in batches:
                optimizer.zero_grad()
                (ce_sum(ddp, bx, by) / len(by)).backward()  # DDP averages the ranks' mean losses
                optimizer.step()
        return {"params": [p.detach().clone() for p in module.parameters()]}

    def check_powersgd(self, strategy: str, scenario: Mapping[str, Any]) -> dict[str, Any]:
        """Per step: the parameters before it, the applied gradient, this rank's own gradient
        (of its loss sum / the step's global count, by hand) and the sync's state after it."""
        x, y = data(scenario["n"], scenario["dims"])
        all_batches = cut(x, y, scenario["batch"])
        plan = steps(all_batches)
        batches = rank_batches(all_batches, self.rank)
        module = model_for(scenario)
        optimizer = torch.optim.SGD(module.parameters(), lr=scenario["lr"])
        channel = self.channel(strategy)
        sync = channel.gradient_sync(module)
        records: list[dict[str, Any]] = []

        def record(step: int) -> None:
            count = sum(len(by) for rank in plan[step] for _, by in rank)
            records.append(
                {
                    "before": [p.detach().clone() for p in module.parameters()],
                    "applied": [p.grad.detach().clone() for p in module.parameters()],
                    "own": local_gradient(module, plan[step][self.rank], count),
                    "state": {k: v.detach().clone() for k, v in sync.state_dict().items()},
                }
            )

        losses = []
        try:
            for epoch in range(scenario["passes"]):
                start = len(records)
                losses.append(
                    self.one_pass(
                        module, batches, channel, optimizer, on_step=lambda s: record(s), epoch=epoch
                    )
                )
                assert len(records) - start == len(plan), (
                    f"{len(records) - start} steps recorded, {len(plan)} run"
                )
        finally:
            channel.close()
        return {
            "losses": losses,
            "records": records,
            "params": [p.detach().clone() for p in module.parameters()],
        }

    def check_local(self, strategy: str) -> dict[str, Any]:
        return self.train(strategy, LOCAL)

    def check_buffers(self, strategy: str) -> dict[str, Any]:
        return self.train(strategy, BUFFERS)

    def check_linear_flags(self) -> dict[str, Any]:
        """Whether each registered strategy's sync says it reduces linearly."""
        import lamploop
        from lamploop.sync.strategy import reduces_linearly

        out = {}
        for name in lamploop.strategy_names():
            if name == "fsdp" or name.startswith("acc_recording"):
                continue  # fsdp's sync needs a sharded model
            module = mlp(SMALL)
            channel = self.channel(name)
            try:
                out[name] = bool(reduces_linearly(channel.gradient_sync(module)))
            finally:
                channel.close()
        return {"flags": out}

    def check_roundtrip(self, strategy: str) -> dict[str, Any]:
        """Two passes in one go, and the same with the sync rebuilt from its state_dict between
        them (through safetensors bytes), and rebuilt without it."""
        from safetensors.torch import load as st_load
        from safetensors.torch import save as st_save

        x, y = data(ROUNDTRIP["n"], ROUNDTRIP["dims"])
        batches = rank_batches(cut(x, y, ROUNDTRIP["batch"]), self.rank)

        def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
            module = mlp(ROUNDTRIP["dims"])
            return module, torch.optim.SGD(
                module.parameters(), lr=ROUNDTRIP["lr"], momentum=ROUNDTRIP["momentum"]
            )

        module, optimizer = fresh()
        channel = self.channel(strategy)
        try:
            self.one_pass(module, batches, channel, optimizer, epoch=0)
            self.one_pass(module, batches, channel, optimizer, epoch=1)
        finally:
            channel.close()
        uninterrupted = [p.detach().clone() for p in module.parameters()]

        out: dict[str, Any] = {"uninterrupted": uninterrupted}
        for restore in (True, False):
            module, optimizer = fresh()
            channel = self.channel(strategy)
            try:
                self.one_pass(module, batches, channel, optimizer, epoch=0)
                state = channel.gradient_sync(module).state_dict()
                kinds = sorted({type(v).__name__ for v in state.values()})
                payload = st_save(dict(state))
                saved_model = copy.deepcopy(module.state_dict())
                saved_optimizer = copy.deepcopy(optimizer.state_dict())
            finally:
                channel.close()
            module, optimizer = fresh()
            module.load_state_dict(saved_model)
            optimizer.load_state_dict(saved_optimizer)
            channel = self.channel(strategy)
            try:
                if restore:
                    channel.gradient_sync(module).load_state_dict(st_load(payload))
                self.one_pass(module, batches, channel, optimizer, epoch=1)
            finally:
                channel.close()
            key = "restored" if restore else "not_restored"
            out[key] = [p.detach().clone() for p in module.parameters()]
            out[f"{key}_state_kinds"] = kinds
            out[f"{key}_state"] = {k: v.clone() for k, v in st_load(payload).items()}
        return out

    def check_fp16_scale(self) -> dict[str, Any]:
        module = linear_fp16_model()
        plan = fp16_batches(module)
        batches = [plan[s][self.rank] for s in range(len(plan))]
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)  # the point stays: gradients are comparable
        channel = self.channel("acc_fp16_grow2")
        sync = channel.gradient_sync(module)
        grads, scales, good = [], [], []

        def record(_: int) -> None:
            grads.append([p.grad.detach().clone() for p in module.parameters()])
            state = sync.state_dict()
            scales.append(float(state["fp16_scale"]))
            good.append(int(state["fp16_good_steps"]))

        try:
            self.one_pass(module, batches, channel, optimizer, on_step=record, loss=squared_error_sum)
        finally:
            channel.close()
        return {"grads": grads, "scales": scales, "good_steps": good}

    def check_plugin(self, strategy: str) -> dict[str, Any]:
        x, y = data(PLUGIN["n"], PLUGIN["dims"])
        batches = rank_batches(cut(x, y, PLUGIN["batch"]), self.rank)
        module = mlp(PLUGIN["dims"])
        optimizer = torch.optim.SGD(module.parameters(), lr=PLUGIN["lr"])
        log = self.plugins["logs"].setdefault(strategy, [])
        del log[:]
        channel = self.channel(strategy)
        try:
            loss = self.one_pass(module, batches, channel, optimizer, accumulate=PLUGIN["accumulate"])
        finally:
            channel.close()
        calls, examples, scales, handed = [], [], [], []
        for entry in log:
            if isinstance(entry, str):
                calls.append(entry)
            elif entry[0] == "step_examples":
                calls.append("step_examples")
                examples.append(list(entry[1:]))
            else:
                calls.append("reduce")
                scales.append(entry[1])
                handed.append(entry[2])
        return {
            "loss": loss,
            "calls": calls,
            "examples": examples,
            "scales": scales,
            "handed": handed,
            "params": [p.detach().clone() for p in module.parameters()],
        }

    def check_fsdp(self) -> dict[str, Any]:
        """The doc's one_epoch example of ``FullyShard`` (docs/strategies.md), on EXACT's batches."""
        from lamploop.distributed.process_group import new_process_group
        from lamploop.sync import Collectives, FullyShard
        from lamploop.sync.group_channel import ProcessGroupChannel

        x, y = data(EXACT["n"], EXACT["dims"])
        batches = rank_batches(cut(x, y, EXACT["batch"]), self.rank)
        module = mlp(EXACT["dims"])
        cpu = torch.device("cpu")
        group = new_process_group(
            self.store, rank=self.rank, nranks=NRANKS, device=cpu, timeout=TIMEOUT_S, prefix="fsdp"
        )
        collectives = Collectives(group, rank=self.rank, nranks=NRANKS, device=cpu, timeout=TIMEOUT_S)
        strategy = FullyShard()
        strategy.shard(collectives, module)
        optimizer = torch.optim.SGD(module.parameters(), lr=EXACT["lr"])
        channel = ProcessGroupChannel(collectives, strategy)
        try:
            losses = [
                self.one_pass(module, batches, channel, optimizer, epoch=e) for e in range(EXACT["passes"])
            ]
        finally:
            channel.close()
        params = [
            p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in module.parameters()
        ]
        return {"losses": losses, "params": params}

    # --- fit, with this harness as torchrun ------------------------------------------------

    def as_torchrun(self) -> Any:
        """A fresh torchrun-like store (rank 0 hosts it) and torchrun's variables pointing at it."""
        store = None
        port = [0]
        if self.rank == 0:
            store = self.dist.TCPStore(
                "127.0.0.1",
                0,
                NRANKS,
                True,
                timeout=datetime.timedelta(seconds=TIMEOUT_S),
                wait_for_workers=False,
            )
            port = [store.port]
        self.dist.broadcast_object_list(port, src=0)
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(NRANKS),
            LOCAL_RANK=str(self.rank),
            LOCAL_WORLD_SIZE=str(NRANKS),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port[0]),
        )
        return store

    def fit(
        self,
        strategy: str,
        max_epochs: int,
        checkpoint_dir: Path | None,
        *,
        shuffle: bool = True,
        optimizers: list[torch.optim.Optimizer] | None = None,
        **extra: Any,
    ) -> list[torch.Tensor]:
        import lamploop

        made = [] if optimizers is None else optimizers

        def factory(params: Any) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(params, lr=FIT["lr"], momentum=FIT["momentum"])
            made.append(optimizer)
            return optimizer

        store = self.as_torchrun()
        try:
            x, y = data(FIT["n"], FIT["dims"])
            module = mlp(FIT["dims"])
            lamploop.fit(
                model=lamploop.SupervisedModel(module),
                optimizer_factory=factory,
                train_batches=lamploop.tensor_batches(x, y, batch_size=FIT["batch"], shuffle=shuffle, seed=0),
                max_epochs=max_epochs,
                checkpoint_dir=checkpoint_dir,
                keep_last=None,
                strategy=strategy,
                device="cpu",
                reporters=[],
                collective_timeout=TIMEOUT_S,
                **extra,
            )
            return [p.detach().clone() for p in module.parameters()]
        finally:
            self.dist.barrier()
            del store

    def check_fit_resume(self, strategy: str) -> dict[str, Any]:
        """Two epochs in one run; one epoch, then a second run resuming it (docs: Checkpoints)."""
        root = self.out / f"fit-{strategy}"
        whole = self.fit(strategy, 2, root / "whole")
        # rank 1 is given a directory of its own, where no checkpoint ever is: the root sends it its state
        mine = root / ("resumed" if self.rank == 0 else "resumed-elsewhere-rank1")
        first = self.fit(strategy, 1, mine)
        resumed = self.fit(strategy, 2, mine)
        files = {}
        if self.rank == 0:
            for epoch_dir in sorted((root / "whole").glob("epoch-*")):
                files[epoch_dir.name] = sorted(p.name for p in epoch_dir.iterdir())
        written = sorted(p.name for p in mine.iterdir()) if mine.exists() else []
        return {
            "whole": whole,
            "first": first,
            "resumed": resumed,
            "files": files,
            "root": str(root),
            "written": written,
        }

    def check_fit_plugin(self) -> dict[str, Any]:
        return {"params": self.fit("acc_float64_all_reduce", 1, None, shuffle=False)}

    def check_fit_reduce_to_root(self) -> dict[str, Any]:
        optimizers: list[torch.optim.Optimizer] = []
        params = self.fit("reduce_to_root", 1, None, shuffle=False, optimizers=optimizers)
        return {"params": params, "optimizer_states": [len(o.state) for o in optimizers]}

    def check_fit_auto(self) -> dict[str, Any]:
        optimizers: list[torch.optim.Optimizer] = []
        params = self.fit("auto", 1, None, shuffle=False, optimizers=optimizers)
        return {"params": params, "optimizer_states": [len(o.state) for o in optimizers]}

    def check_reduce_to_root_momentum(self) -> dict[str, Any]:
        return self.train("reduce_to_root", {**EXACT, "momentum": 0.9})

    def expect_error(self, run: Callable[[], object]) -> dict[str, Any]:
        started = time.monotonic()
        try:
            run()
        except Exception as error:  # the test judges the type and message
            return {
                "type": type(error).__name__,
                "mro": [c.__name__ for c in type(error).__mro__],
                "message": str(error),
                "seconds": time.monotonic() - started,
            }
        return {"type": None, "message": "", "seconds": time.monotonic() - started}

    def check_fit_refusals(self) -> dict[str, Any]:
        out = {}
        for strategy in STATEFUL:
            for setting, value in (("checkpoint_every_n_steps", 2), ("checkpoint_every_seconds", 1.0)):
                directory = self.out / f"refused-{strategy}-{setting}"
                out[f"{strategy}/{setting}"] = self.expect_error(
                    lambda: self.fit(strategy, 1, directory, **{setting: value})  # noqa: B023
                )
        return out

    def check_fit_mismatch(self) -> dict[str, Any]:
        mine = "all_reduce" if self.rank == 0 else "powersgd1"
        return {"asked": mine, **self.expect_error(lambda: self.fit(mine, 1, None))}


def checks(rank: Rank) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    out: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for strategy in EXACT_STRATEGIES:
        out.append((f"exact/{strategy}", lambda s=strategy: rank.check_exact(s)))
    for strategy, hook, dtype in (
        ("all_reduce", "allreduce", torch.float64),
        ("acc_powersgd_full", "powersgd_full", torch.float64),
        ("all_reduce_bf16", "bf16", torch.float32),
        ("all_reduce_fp16", "fp16", torch.float32),
    ):
        out.append((f"even/{strategy}", lambda s=strategy, d=dtype: rank.check_even(s, d)))
        out.append((f"ddp/{hook}", lambda h=hook, d=dtype: rank.check_ddp(h, d)))
    for strategy in ("powersgd1", "powersgd4"):
        out.append((f"powersgd/{strategy}", lambda s=strategy: rank.check_powersgd(s, POWER)))
    out.append(("powersgd_conv/powersgd1", lambda: rank.check_powersgd("powersgd1", POWER_CONV)))
    for strategy in LOCAL_STRATEGIES:
        out.append((f"local/{strategy}", lambda s=strategy: rank.check_local(s)))
    for strategy in ("all_reduce", "powersgd1", "local_sgd8"):
        out.append((f"buffers/{strategy}", lambda s=strategy: rank.check_buffers(s)))
    out.append(("linear_flags", rank.check_linear_flags))
    for strategy in (*STATEFUL, "acc_fp16_grow2"):
        out.append((f"roundtrip/{strategy}", lambda s=strategy: rank.check_roundtrip(s)))
    out.append(("fp16_scale", rank.check_fp16_scale))
    for strategy in ("acc_recording", "acc_recording_linear"):
        out.append((f"plugin/{strategy}", lambda s=strategy: rank.check_plugin(s)))
    for strategy in STATEFUL:
        out.append((f"fit_resume/{strategy}", lambda s=strategy: rank.check_fit_resume(s)))
    out.append(("fit_plugin", rank.check_fit_plugin))
    out.append(("fit_reduce_to_root", rank.check_fit_reduce_to_root))
    out.append(("fit_auto", rank.check_fit_auto))
    out.append(("reduce_to_root_momentum", rank.check_reduce_to_root_momentum))
    out.append(("fit_refusals", rank.check_fit_refusals))
    out.append(("fit_mismatch", rank.check_fit_mismatch))
    out.append(("fsdp", rank.check_fsdp))
    return out


def main() -> None:
    rank_index, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    only = set(sys.argv[4].split(",")) if len(sys.argv) > 4 else None
    rank = Rank(rank_index, port, out)
    results: dict[str, Any] = {}
    try:
        for name, check in checks(rank):
            if only is not None and name not in only and name.split("/")[0] not in only:
                continue
            started = time.monotonic()
            try:
                results[name] = check()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name]["wall_s"] = time.monotonic() - started
            rank.dist.barrier()  # the next check starts together (a failed one ended on both)
    finally:
        save_record(results, out / f"rank{rank_index}.json")
    rank.dist.destroy_process_group()


if __name__ == "__main__":
    main()
