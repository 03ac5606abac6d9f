"""Every registered strategy against a reference lamploop did not write.

Written from the docs and the public API only (docs/strategies.md, docs/distributed.md,
docs/architecture.md, docs/loop.md, the docstrings), never from lamploop/sync's
implementations.  lamploop trains through :func:`lamploop.local_data_parallel_training_loop`
(2 CPU replicas, one thread each, real Gloo groups); the PyTorch references run in two
worker processes of their own with a real 2-rank Gloo group
(``tests/strategy_reference_support.py``).  Same model (MLP 64-64-10), data (scikit-learn
digits, 1437 training / 360 validation images), seeds and batches (32 per rank, batch ``i``
to rank ``i % 2``, so rank 1 has no batch in the last step of a pass: the uneven-stream
rule is exercised at the end of every pass).

| test | reference | tolerance |
| --- | --- | --- |
| ``all_reduce`` (k = 1, 2) | ``DistributedDataParallel`` (``no_sync`` for accumulation) | 1e-12, float64 |
| ``powersgd1``, ``powersgd4`` | DDP + ``powerSGD_hook`` (rank, warm start, error feedback) | 2 points |
| ``powersgd1``, ``powersgd4`` | error feedback's conservation law, every step of 3 passes | 1e-6, float64 |
| ``all_reduce_bf16``, ``_fp16`` | DDP + ``bf16/fp16_compress_hook``, teacher-forced | 16-bit rounding |
| ``all_reduce_fp16`` | no full-width resend at a pass's first step | 0 fallbacks |
| ``local_sgd8`` | ``PostLocalSGDOptimizer`` + ``PeriodicModelAverager`` (even windows) | 1e-12, float64 |
| ``local_sgd8``, ``diloco8`` | a float64 reference written here (weights, dry rank, outer step) | 1e-12 |
| every registered name but ``fsdp`` | ``all_reduce``'s validation accuracy, lr 0.05 and 0.1 | 2 points |
| ``fsdp`` | refused by the threaded loop, naming why (trained by ``fit`` in tests/sync/test_fsdp.py) | |
| the registry | every name the docs and docstrings mention | equal sets |
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file
from strategy_reference_support import (
    accuracy,
    digits,
    mlp,
    rank_batches,
    run_references,
    step_plan,
)
from support import ROOT
from torch import nn

import lamploop
from lamploop.sync import strategy_named

RUN_TIMEOUT_S = 120.0
EXACT_ATOL = 1e-12
MOMENTUM = 0.9
MODEL_SEED, DATA_SEED = 3, 11
CONVERGENCE_EPOCHS = 10
ACCURACY_POINTS = 0.02
CONSERVATION_ATOL = 1e-6
BF16_UNIT, FP16_UNIT = 2.0**-8, 2.0**-11
REPO = ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # two reference processes, ~40 CPU-seconds in all

# The built-in names, as registered when the tests are collected (before any test registers
# one of its own): what the convergence matrix runs.
BUILTIN_STRATEGIES = lamploop.strategy_names()


# --- lamploop's side ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _registry_as_it_was() -> Iterator[None]:
    """Leave the registry as this module found it (the watched strategies are registered under
    names of their own; other modules' tests list every registered name).  The public API has no
    way to unregister, so this one piece of hygiene reaches into the registry's dict."""
    from lamploop.sync import strategy as registry

    saved = dict(getattr(registry, "_REGISTRY", {}))
    yield
    live = getattr(registry, "_REGISTRY", None)
    if isinstance(live, dict):
        live.clear()
        live.update(saved)


def digits_batches(x: torch.Tensor, y: torch.Tensor, n: int) -> lamploop.BatchStreamFactory:
    """The batch plan of strategy_reference_support.rank_batches, as a lamploop stream factory."""

    def make(context: lamploop.BatchContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in rank_batches(n, context.epoch, context.rank, context.nranks, DATA_SEED):
            yield x[idx], y[idx]

    return lamploop.iterable_batches(make)


def run_loop(
    strategy: str,
    modules: Sequence[nn.Module],
    dtype: torch.dtype,
    *,
    lr: float,
    epochs: int,
    k: int = 1,
    n: int | None = None,
) -> lamploop.LoopState:
    """``modules`` as 2 replicas, SGD(lr, momentum 0.9), batches of 32 per rank (the first ``n`` images)."""
    x, y, _, _ = digits(dtype)
    n = len(y) if n is None else n
    batches = digits_batches(x[:n], y[:n], n)

    async def run() -> lamploop.LoopState:
        with anyio.fail_after(RUN_TIMEOUT_S):
            return await lamploop.local_data_parallel_training_loop(
                [(lamploop.SupervisedModel(m, lamploop.cross_entropy_loss), batches, None) for m in modules],
                lambda params: torch.optim.SGD(params, lr=lr, momentum=MOMENTUM),
                epochs,
                accumulate_gradient_over_n_batches=k,
                strategy=strategy,
                collective_timeout=60.0,
            )

    return anyio.run(run)


def train(
    strategy: str, *, dtype: torch.dtype, lr: float, epochs: int, k: int = 1, n: int | None = None
) -> tuple[lamploop.LoopState, list[nn.Module]]:
    """:func:`run_loop` on fresh replicas (MLP 64-64-10, seeded); the state and both replicas' modules."""
    modules = [mlp(dtype, MODEL_SEED) for _ in range(2)]
    return run_loop(strategy, modules, dtype, lr=lr, epochs=epochs, k=k, n=n), modules


@functools.cache
def digits_accuracy(strategy: str, lr: float) -> float:
    """Validation accuracy after 10 epochs (float32), shared by the PowerSGD and the convergence tests."""
    _, modules = train(strategy, dtype=torch.float32, lr=lr, epochs=CONVERGENCE_EPOCHS)
    _, _, xv, yv = digits(torch.float32)
    return accuracy(modules[0], xv, yv)


class ObservedSync:
    """A registered strategy's own :class:`~lamploop.sync.GradientSync`, watched at every ``reduce``.

    Everything else (``reduces_linearly``, ``step_examples``, ...) is the wrapped sync's, so
    the loop drives it exactly as it drives the registered strategy.
    """

    def __init__(self, inner: Any, parameters: Sequence[nn.Parameter], watch: Callable[..., None]) -> None:
        self._inner = inner
        self._parameters = list(parameters)
        self._watch = watch
        self.passes = -1
        self.steps = 0

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)

    def begin_pass(self) -> None:
        self.passes += 1
        self.steps = 0
        self._inner.begin_pass()

    def last_backward(self) -> None:
        self._inner.last_backward()

    def reduce(self, scale: float) -> None:
        self._watch(self, scale, lambda: self._inner.reduce(scale))
        self.steps += 1

    def after_step(self) -> None:
        self._inner.after_step()

    def end_pass(self) -> None:
        self._inner.end_pass()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._inner.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._inner.load_state_dict(state)

    def close(self, *, abandon: bool) -> None:
        self._inner.close(abandon=abandon)


class ObservedStrategy:
    """``strategy_named(of)`` under another name, its syncs wrapped in :class:`ObservedSync`."""

    def __init__(self, of: str, name: str, watch: Callable[..., None]) -> None:
        self._inner = strategy_named(of)
        self._name = name
        self._watch = watch
        self.syncs: list[ObservedSync] = []

    def __getattr__(self, item: str) -> Any:  # keeps_state, optimizer_state_per_rank
        return getattr(self._inner, item)

    @property
    def name(self) -> str:
        return self._name

    @property
    def steps_on_every_rank(self) -> bool:
        return bool(self._inner.steps_on_every_rank)

    def gradient_sync(
        self,
        collectives: Any,
        parameters: Sequence[nn.Parameter],
        modules: Sequence[nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> ObservedSync:
        inner = self._inner.gradient_sync(collectives, parameters, modules, bucket_cap_mb=bucket_cap_mb)
        sync = ObservedSync(inner, parameters, self._watch)
        self.syncs.append(sync)
        return sync


def rank_of(sync: ObservedSync, modules: Sequence[nn.Module]) -> int:
    """Which replica's parameters ``sync`` was made for."""
    first = sync._parameters[0]
    return next(r for r, m in enumerate(modules) if any(p is first for p in m.parameters()))


def grads(parameters: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in parameters]


# --- the PyTorch references -----------------------------------------------------------------------

PLAIN_JOBS: list[dict[str, Any]] = [
    *(
        {
            "kind": "ddp",
            "name": f"ddp-k{k}",
            "hook": "none",
            "dtype": "float64",
            "lr": 0.05,
            "k": k,
            "epochs": 2,
        }
        for k in (1, 2)
    ),
    *(
        {
            "kind": "ddp",
            "name": f"powersgd{rank}-lr{lr}",
            "hook": "powersgd",
            "powersgd_rank": rank,
            "dtype": "float32",
            "lr": lr,
            "epochs": CONVERGENCE_EPOCHS,
        }
        for rank in (1, 4)
        for lr in (0.05, 0.1)
    ),
    {
        "kind": "post_local_sgd",
        "name": "post-local-sgd8",
        "period": 8,
        "subset": 1024,  # 32 batches: 16 steps per rank per pass, so the windows of 8 end with the pass
        "dtype": "float64",
        "lr": 0.05,
        "epochs": 2,
    },
]
for _job in PLAIN_JOBS:
    _job.update(momentum=MOMENTUM, model_seed=MODEL_SEED, data_seed=DATA_SEED)


@pytest.fixture(scope="module")
def sixteen_bit_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lamploop's ``all_reduce_bf16`` (1 pass) and ``all_reduce_fp16`` (4 passes), float32, lr 0.1.

    Recorded at every ``reduce`` of the first pass: each rank's parameters before the step and
    its reduced gradient (the teacher-forced comparison replays the parameters in DDP); for
    fp16 at every reduce of every pass, how many buckets the sync resent in full width.
    """
    rundir = tmp_path_factory.mktemp("torch-references")
    _, y, _, _ = digits(torch.float32)
    out: dict[str, Any] = {"rundir": rundir, "steps": len(step_plan(len(y), 0, 2, DATA_SEED))}
    out["recorded"], out["fallbacks"] = {}, []
    for wire, epochs in (("bf16", 1), ("fp16", 4)):
        modules: list[nn.Module] = []
        per_rank: dict[int, dict[str, torch.Tensor]] = {0: {}, 1: {}}

        def watch(
            sync: ObservedSync,
            scale: float,
            reduce: Callable[[], None],
            modules: list[nn.Module] = modules,
            per_rank: dict[int, dict[str, torch.Tensor]] = per_rank,
            wire: str = wire,
        ) -> None:
            before = [p.detach().clone() for p in sync._parameters]
            resent = getattr(sync._inner, "fallbacks", None)
            reduce()
            rank = rank_of(sync, modules)
            if wire == "fp16":
                after = getattr(sync._inner, "fallbacks", None)
                count = None if resent is None or after is None else int(after) - int(resent)
                out["fallbacks"].append((rank, sync.passes, sync.steps, count))
            if sync.passes == 0:
                for i, (p, g) in enumerate(zip(before, grads(sync._parameters), strict=True)):
                    per_rank[rank][f"step{sync.steps}.p{i}"] = p
                    per_rank[rank][f"step{sync.steps}.g{i}"] = g

        name = f"test_observed_all_reduce_{wire}"
        lamploop.register_strategy(ObservedStrategy(f"all_reduce_{wire}", name, watch), replace=True)
        modules.extend(mlp(torch.float32, MODEL_SEED) for _ in range(2))
        run_loop(name, modules, torch.float32, lr=0.1, epochs=epochs)
        out["recorded"][wire] = per_rank
        params = {k: v for k, v in per_rank[0].items() if ".p" in k}
        save_file(params, str(rundir / f"lamploop-{wire}.safetensors"))
    return out


@pytest.fixture(scope="module")
def torch_reference(
    sixteen_bit_runs: dict[str, Any],
) -> Callable[[str, int], tuple[dict[str, torch.Tensor], Any]]:
    """Every job of :data:`PLAIN_JOBS` and the 16-bit replays, run once by two reference worker processes."""
    replays = [
        {
            "kind": "replay",
            "name": f"replay-{wire}-{hook}",
            "hook": hook,
            "params_file": f"lamploop-{wire}.safetensors",
            "dtype": "float32",
            "epoch": 0,
            "steps": sixteen_bit_runs["steps"],
            "model_seed": MODEL_SEED,
            "data_seed": DATA_SEED,
        }
        for wire in ("bf16", "fp16")
        for hook in (wire, "none")
    ]
    rundir = run_references(sixteen_bit_runs["rundir"], [*PLAIN_JOBS, *replays])

    def result(name: str, rank: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
        tensors = load_file(str(rundir / f"{name}.rank{rank}.safetensors"))
        return tensors, json.loads((rundir / f"{name}.rank{rank}.json").read_text())

    return result


def params_of(tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[f"p{i}"] for i in range(len(tensors))]


def _parameter_message(what: str, index: int, message: str) -> str:
    return f"{what}, parameter {index}: {message}"


def assert_params_close(module: nn.Module, expected: Sequence[torch.Tensor], atol: float, what: str) -> None:
    for i, (got, want) in enumerate(zip(module.parameters(), expected, strict=True)):
        torch.testing.assert_close(
            got.detach(), want, atol=atol, rtol=0, msg=functools.partial(_parameter_message, what, i)
        )


# --- 1. all_reduce against DistributedDataParallel ------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_all_reduce_equals_distributed_data_parallel(k: int, torch_reference: Any) -> None:
    """float64, 2 epochs, SGD with momentum; with ``k = 2`` DDP accumulates under ``no_sync``."""
    state, modules = train("all_reduce", dtype=torch.float64, lr=0.05, epochs=2, k=k)
    tensors, numbers = torch_reference(f"ddp-k{k}")
    other, _ = torch_reference(f"ddp-k{k}", 1)
    for a, b in zip(params_of(tensors), params_of(other), strict=True):
        assert torch.equal(a, b)  # DDP's ranks agree (the reference is sound)
    for rank, module in enumerate(modules):
        assert_params_close(module, params_of(tensors), EXACT_ATOL, f"k={k}, rank {rank}")
    curve = [entry.training_loss for entry in state.learning_curve]
    assert curve == pytest.approx(numbers["losses"], abs=EXACT_ATOL, rel=0)
    first, start = modules[0][0], mlp(torch.float64, MODEL_SEED)[0]  # type: ignore[index]
    moved = float((first.weight - start.weight).detach().abs().max())
    assert moved > 1e-2  # it trained


# --- 2. PowerSGD against PyTorch's powerSGD_hook, and its error feedback --------------------------


@pytest.mark.parametrize("lr", [0.05, 0.1])
@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_accuracy_matches_torch_powersgd_hook(rank: int, lr: float, torch_reference: Any) -> None:
    """10 epochs on digits: validation accuracy within 2 points of DDP with ``powerSGD_hook``.

    The designs differ, so the trajectories do: PyTorch runs plain all-reduce for its first
    2 iterations (the least it allows with error feedback and warm start) and keeps as error
    a rank's input minus the *averaged* approximation; lamploop compresses from the first
    step and keeps each rank's own residual (as in the PowerSGD paper).
    """
    _, numbers = torch_reference(f"powersgd{rank}-lr{lr}")
    expected = numbers["accuracies"][-1]
    got = digits_accuracy(f"powersgd{rank}", lr)
    assert expected > 0.9  # the reference trains
    assert abs(got - expected) <= ACCURACY_POINTS, (
        f"powersgd{rank} at lr {lr}: validation accuracy {got:.4f}, torch's powerSGD_hook {expected:.4f}"
    )


@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_error_feedback_conserves_every_gradient(rank: int) -> None:
    """applied + owed = given, at every step of 3 passes (float64, digits, SGD with momentum).

    Per parameter, after step ``t`` (counted from the start of the run, over pass ends):

        sum_{s <= t} applied_s + sum_r owed_r(t) = sum_{s <= t} sum_r given_{r,s} * scale_s

    ``given_{r,s}`` is rank ``r``'s ``.grad`` handed to ``reduce(scale_s)`` (the contract:
    the sum of its batches' gradients of ``loss_sum / expected``, so ``given * scale`` is its
    share of the gradient of the step's mean loss), ``applied_s`` the gradient the optimizer
    then steps on (the same on every rank), ``owed_r(t)`` rank ``r``'s error feedback
    (``state_dict()["error.<i>"]``, for parameter ``i`` of the sync) after that reduce: all in
    the units of the step's mean loss, which is what the optimizer sees.  Uncompressed
    tensors (biases) owe nothing.
    """
    name = f"test_observed_powersgd{rank}"
    modules: list[nn.Module] = []
    records: dict[int, list[dict[str, Any]]] = {0: [], 1: []}

    def watch(sync: ObservedSync, scale: float, reduce: Callable[[], None]) -> None:
        given = grads(sync._parameters)
        reduce()
        state = sync.state_dict()
        owed = {}
        for key, value in state.items():
            match = re.fullmatch(r"error\.(\d+)", key)
            if match:
                i = int(match.group(1))
                assert value.numel() == sync._parameters[i].numel(), f"{key} is not parameter {i}'s error"
                owed[i] = value.detach().clone().reshape(sync._parameters[i].shape).double()
        records[rank_of(sync, modules)].append(
            {
                "at": (sync.passes, sync.steps),
                "scale": scale,
                "given": [g.double() * scale for g in given],
                "applied": [g.double() for g in grads(sync._parameters)],
                "owed": owed,
            }
        )

    lamploop.register_strategy(ObservedStrategy(f"powersgd{rank}", name, watch), replace=True)
    modules.extend(mlp(torch.float64, MODEL_SEED) for _ in range(2))
    run_loop(name, modules, torch.float64, lr=0.05, epochs=3)
    _, y, _, _ = digits(torch.float64)
    steps = len(step_plan(len(y), 0, 2, DATA_SEED))
    assert len(records[0]) == len(records[1]) == 3 * steps
    assert {len(r["owed"]) for r in records[0]} == {2}  # both weight matrices are compressed
    parameters = list(modules[0].parameters())
    applied = [torch.zeros_like(p, dtype=torch.float64) for p in parameters]
    given = [torch.zeros_like(p, dtype=torch.float64) for p in parameters]
    worst: tuple[float, Any, Any] = (0.0, None, None)
    first_off: tuple[Any, float] | None = None
    largest_owed = 0.0
    for r0, r1 in zip(records[0], records[1], strict=True):
        assert r0["at"] == r1["at"]
        for i in range(len(parameters)):
            torch.testing.assert_close(r0["applied"][i], r1["applied"][i], atol=EXACT_ATOL, rtol=0)
            applied[i] += r0["applied"][i]
            given[i] += r0["given"][i] + r1["given"][i]
            owed = r0["owed"].get(i, 0.0) + r1["owed"].get(i, 0.0)
            largest_owed = max(largest_owed, float(torch.as_tensor(owed).abs().max()))
            gap = float((applied[i] + owed - given[i]).abs().max())
            if gap > worst[0]:
                worst = (gap, r0["at"], i)
            if gap > CONSERVATION_ATOL and first_off is None:
                first_off = (r0["at"], gap)
    gap, at, i = worst
    assert gap <= CONSERVATION_ATOL, (
        f"powersgd{rank}: applied + owed - given reaches {gap:.3g} at (pass, step) {at}, parameter {i} "
        f"(first off at (pass, step), by: {first_off}); "
        f"scales handed to reduce at each pass's first step: "
        f"{sorted({r['scale'] for r in records[0] if r['at'][1] == 0})}"
    )
    assert largest_owed > 1e-4  # it does approximate: something was owed


# --- 3. bf16 / fp16 against DDP's compression hooks -----------------------------------------------


def test_compressed_all_reduce_matches_ddp_compress_hooks(
    sixteen_bit_runs: dict[str, Any], torch_reference: Any
) -> None:
    """Teacher-forced, the first pass (23 steps, float32, lr 0.1): at lamploop's parameters of
    every step, DDP with ``bf16_compress_hook`` / ``fp16_compress_hook`` / no hook computes the
    step's reduced gradient; lamploop's must match the hook's within 16-bit rounding.

    Tolerances, per parameter tensor and step, with ``m`` the largest element of the exact
    (fp32) reduced gradient and ``R = 2`` ranks: each side is within ``(R + 1) * u * m`` of the
    exact sum (every rank's gradient rounded once, every partial sum once more; ``u = 2^-8``
    for bf16, ``2^-11`` for fp16), so the two are within ``2 (R + 1) u m``; fp16 adds
    ``(R + 1) 2^-24`` per element for the hook's values below fp16's normal range (lamploop's
    travel multiplied by a factor, the hook's do not).
    """
    steps = sixteen_bit_runs["steps"]
    for wire, unit in (("bf16", BF16_UNIT), ("fp16", FP16_UNIT)):
        hook, _ = torch_reference(f"replay-{wire}-{wire}")
        exact, _ = torch_reference(f"replay-{wire}-none")
        ours = sixteen_bit_runs["recorded"][wire]
        assert len(ours[0]) == len(ours[1]) == steps * 8
        rounded = False
        for s in range(steps):
            for i in range(4):
                key = f"step{s}.g{i}"
                assert torch.equal(ours[0][key], ours[1][key]), f"{wire}: ranks differ at step {s}"
                m = float(exact[key].abs().max())
                floor = 3 * 2.0**-24 if wire == "fp16" else 0.0
                ours_error = float((ours[0][key] - exact[key]).abs().max())
                assert ours_error <= 3 * unit * m + 1e-30, f"{wire} step {s} p{i}: {ours_error:.3g} from fp32"
                gap = float((ours[0][key] - hook[key]).abs().max())
                bound = 2 * 3 * unit * m + floor + 1e-30
                assert gap <= bound, f"{wire} step {s} p{i}: {gap:.3g} from DDP's hook (bound {bound:.3g})"
                rounded = rounded or ours_error > 0
        assert rounded, f"{wire}: every gradient equals the fp32 sum, nothing was rounded"


def test_fp16_never_resends_at_full_width_at_the_first_step_of_a_pass(
    sixteen_bit_runs: dict[str, Any],
) -> None:
    """Digits, 4 passes, float32, lr 0.1: the first step of every pass sends fp16, no bucket falls back.

    docs/strategies.md: fp16 "overflowing buckets are resent in 32 bits".  That happens when
    a gradient times the factor (from 2^16) over the ranks overflows 65504; gradients of the
    step's mean loss here are far below that.  The count of resent buckets is read from the
    sync's ``fallbacks`` (the attribute tests/sync/test_strategies_compression.py reads; the docs
    do not name it).
    """
    events = sixteen_bit_runs["fallbacks"]  # (rank, pass, step, buckets resent by that reduce)
    assert all(n is not None for *_, n in events), "the fp16 sync does not say how many buckets it resent"
    assert {(p, s) for _, p, s, _ in events} >= {(p, 0) for p in range(4)}
    first_steps = [(rank, p, n) for rank, p, s, n in events if s == 0 and n > 0]
    assert not first_steps, f"(rank, pass, buckets resent in 32 bits) at a pass's first step: {first_steps}"
    assert sum(n for *_, n in events) == 0, f"fallbacks anywhere: {[e for e in events if e[3]]}"


# --- 4 and 5. local SGD and DiLoCo ----------------------------------------------------------------


def test_local_sgd8_equals_torch_post_local_sgd(torch_reference: Any) -> None:
    """1024 training images (16 steps per rank per pass, windows of 8 end with the pass, every
    rank's window has as many examples): ``PostLocalSGDOptimizer`` with
    ``PeriodicModelAverager(period=8)`` averaging after steps 8, 16, ... is what ``local_sgd8``
    documents; float64, 2 passes, SGD with momentum (optimizer state never averaged)."""
    _, modules = train("local_sgd8", dtype=torch.float64, lr=0.05, epochs=2, n=1024)
    tensors, _ = torch_reference("post-local-sgd8")
    other, _ = torch_reference("post-local-sgd8", 1)
    for a, b in zip(params_of(tensors), params_of(other), strict=True):
        assert torch.equal(a, b)  # averaged at the end
    for rank, module in enumerate(modules):
        assert_params_close(module, params_of(tensors), EXACT_ATOL, f"local_sgd8, rank {rank}")


def local_sgd_reference(
    *, every: int, outer: tuple[float, float] | None, epochs: int, lr: float
) -> list[torch.Tensor]:
    """The documented local SGD / DiLoCo, by hand, float64, both ranks in this process.

    Each rank steps its own SGD (momentum 0.9, state never shared) on the mean loss of its
    own batch; a rank with no batch does not step.  After every ``every`` steps of a pass and
    at the end of every pass (a window then restarts), the parameters become the average of
    the ranks' weighted by the examples each trained on in the window.  With ``outer = (lr,
    momentum)`` (DiLoCo, Douillard et al. 2023, Algorithm 1) the average is not taken as it
    is: the outer gradient is ``anchor - average`` (``anchor`` the parameters every rank
    started the window from), the outer SGD with Nesterov momentum steps the anchor on it
    (``v = mu v + g; anchor -= lr (g + mu v)``), and every rank continues from the new anchor.
    """
    x, y, _, _ = digits(torch.float64)
    models = [mlp(torch.float64, MODEL_SEED) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=MOMENTUM) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    velocity = [torch.zeros_like(p) for p in anchor]
    seen = [0, 0]
    in_window = 0

    def average() -> None:
        nonlocal in_window
        total = sum(seen)
        mean = [
            sum(seen[r] * p.detach() for r, p in zip(range(2), ps, strict=True)) / total
            for ps in zip(*(m.parameters() for m in models), strict=True)
        ]
        if outer is None:
            new = mean
        else:
            outer_lr, mu = outer
            new = []
            for a, v, avg in zip(anchor, velocity, mean, strict=True):
                g = a - avg
                v.mul_(mu).add_(g)
                new.append(a - outer_lr * (g + mu * v))
        for m in models:
            with torch.no_grad():
                for p, value in zip(m.parameters(), new, strict=True):
                    p.copy_(value)
        for a, value in zip(anchor, new, strict=True):
            a.copy_(value)
        seen[0] = seen[1] = 0
        in_window = 0

    for epoch in range(epochs):
        for step in step_plan(len(y), epoch, 2, DATA_SEED):
            for r in range(2):
                if not step[r]:
                    continue
                (idx,) = step[r]
                opts[r].zero_grad()
                nn.functional.cross_entropy(models[r](x[idx]), y[idx]).backward()
                opts[r].step()
                seen[r] += len(idx)
            in_window += 1
            if in_window == every:
                average()
        if in_window:
            average()
    return [p.detach().clone() for p in models[0].parameters()]


@pytest.mark.parametrize(
    ("strategy", "outer"),
    [("local_sgd8", None), ("diloco8", (0.7, 0.5))],
)
def test_local_sgd_and_diloco_equal_a_float64_reference(
    strategy: str, outer: tuple[float, float] | None
) -> None:
    """All 1437 images (23 steps per pass: windows of 8, 8 and 7; rank 1 has no batch in the
    last step, so the last window's weights are 221 and 192 examples), 2 passes, float64,
    against :func:`local_sgd_reference` (DiLoCo's outer step with the documented lr 0.7 and
    momentum 0.5 of the registered ``diloco8``).  Both ranks end every pass with the same parameters."""
    _, modules = train(strategy, dtype=torch.float64, lr=0.05, epochs=2)
    expected = local_sgd_reference(every=8, outer=outer, epochs=2, lr=0.05)
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(a, b)
    for rank, module in enumerate(modules):
        assert_params_close(module, expected, EXACT_ATOL, f"{strategy}, rank {rank}")
    plain = local_sgd_reference(every=8, outer=None if outer else (0.7, 0.9), epochs=2, lr=0.05)
    outer_matters = max(float((a - b).abs().max()) for a, b in zip(expected, plain, strict=True))
    assert outer_matters > 1e-3  # the other variant ends elsewhere: the comparison can tell them apart


# --- 6. convergence of every registered strategy -------------------------------------------------

# Strategies this module's loop (local_data_parallel_training_loop: ranks are threads of this
# process) cannot train, each with the reason; test_strategies_the_threads_cannot_train_are_refused
# checks that each is refused, naming it, and the test named here trains it in processes instead.
NOT_IN_THREADS = {
    "fsdp": (
        "FSDP2 shards over one process per rank; tests/sync/test_fsdp.py::"
        "test_fit_fsdp_equals_fit_all_reduce trains it through fit(world_size=2)"
    ),
}


@pytest.mark.parametrize("lr", [0.05, 0.1])
@pytest.mark.parametrize(
    "strategy", [s for s in BUILTIN_STRATEGIES if s != "all_reduce" and s not in NOT_IN_THREADS]
)
def test_every_registered_strategy_trains_like_all_reduce(strategy: str, lr: float) -> None:
    """MLP 64-64-10, SGD momentum 0.9, batches of 32 on 2 ranks, 10 epochs: validation accuracy
    within 2 points of ``all_reduce``'s at the same learning rate."""
    expected = digits_accuracy("all_reduce", lr)
    got = digits_accuracy(strategy, lr)
    assert expected > 0.9
    assert got >= expected - ACCURACY_POINTS, f"{strategy} at lr {lr}: {got:.4f}, all_reduce {expected:.4f}"


@pytest.mark.parametrize("strategy", sorted(NOT_IN_THREADS))
def test_strategies_the_threads_cannot_train_are_refused(strategy: str) -> None:
    """Excluded from the convergence check above only because the threaded loop refuses them,
    up front and naming the strategy; each one's reason names the test that trains it."""
    assert strategy in BUILTIN_STRATEGIES
    assert "tests/sync/test_fsdp.py::" in NOT_IN_THREADS[strategy]
    refused = rf"strategy '{strategy}'.*local_data_parallel"
    with pytest.raises(lamploop.errors.ConfigurationError, match=refused):
        train(strategy, dtype=torch.float32, lr=0.05, epochs=1, n=64)


# --- 7. the registry against the docs ------------------------------------------------------------

# A strategy's name, in the shapes the docs give them: "all_reduce", "reduce_to_root",
# "all_reduce_<wire>", "powersgd<rank>", "local_sgd<H>", "diloco<H>", "fsdp".
STRATEGY_NAME = r"(?:all_reduce(?:_bf16|_fp16)?|reduce_to_root|powersgd\d+|local_sgd\d+|diloco\d+|fsdp)"
INLINE_NAME = re.compile(rf"(?<!`)``?({STRATEGY_NAME})``?(?!`)")


def markdown_prose(text: str) -> str:
    """``text`` without its fenced code blocks (examples register names of their own)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def docstring_prose(text: str) -> str:
    """``text`` without its literal blocks (``Example::`` and what is indented under it)."""
    out, literal_indent = [], None
    for line in inspect.cleandoc(text).splitlines():
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if not line.strip() or indent > literal_indent:
                continue
            literal_indent = None
        out.append(line)
        if line.rstrip().endswith("::"):
            literal_indent = indent
    return "\n".join(out)


def documented_names() -> dict[str, list[str]]:
    """Every strategy name the docs and the public docstrings mention, and where."""
    where: dict[str, list[str]] = {}

    def scan(text: str, source: str) -> None:
        for name in INLINE_NAME.findall(text):
            where.setdefault(name, []).append(source)

    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        scan(markdown_prose(path.read_text()), str(path.relative_to(REPO)))
    objects: dict[str, Any] = {"lamploop": lamploop, "lamploop.sync": lamploop.sync}
    for name in lamploop.__all__:
        objects[f"lamploop.{name}"] = getattr(lamploop, name)
    for name in lamploop.sync.__all__:
        objects[f"lamploop.sync.{name}"] = getattr(lamploop.sync, name)
    for info in pkgutil.iter_modules(lamploop.sync.__path__):
        module = importlib.import_module(f"lamploop.sync.{info.name}")
        objects[module.__name__] = module
        for name in getattr(module, "__all__", []):
            objects[f"{module.__name__}.{name}"] = getattr(module, name)
    for source, obj in objects.items():
        if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
            scan(docstring_prose(obj.__doc__ or ""), f"{source}.__doc__")
    return where


def test_the_documented_strategy_names_are_the_registered_ones() -> None:
    """Every name the docs or docstrings give as a strategy is registered, and every registered
    name is documented (the registry as a fresh interpreter has it, before any test registers)."""
    fresh = subprocess.run(
        [sys.executable, "-c", "import json, lamploop; print(json.dumps(lamploop.strategy_names()))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    registered = set(json.loads(fresh.stdout))
    documented = documented_names()
    assert {"all_reduce", "powersgd1", "diloco8"} <= set(documented)  # the scan finds names at all
    undocumented = sorted(registered - set(documented))
    unregistered = {name: sorted(set(where)) for name, where in documented.items() if name not in registered}
    assert not unregistered, f"documented as strategies but not registered: {unregistered}"
    assert not undocumented, f"registered but documented nowhere: {undocumented}"
