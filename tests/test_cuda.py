"""CUDA paths: NCCL with one rank, device batches. Skipped where there is no CUDA device."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist

import lamploop
from lamploop.distributed.process_group import new_process_group
from lamploop.sync.group_channel import ProcessGroupChannel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _fsdp2_missing() -> str | None:
    """Why this torch cannot run strategy 'fsdp' (its FSDP2 lacks a method), or None."""
    from lamploop.errors import ConfigurationError
    from lamploop.sync.fsdp import check_fsdp2_api

    try:
        check_fsdp2_api()
    except ConfigurationError as error:
        return str(error)
    return None


_FSDP2_MISSING = _fsdp2_missing()
needs_fsdp2 = pytest.mark.skipif(_FSDP2_MISSING is not None, reason=str(_FSDP2_MISSING))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(256, 16, generator=generator, dtype=torch.float64), torch.randint(
        0, 4, (256,), generator=generator
    )


def _train(module: torch.nn.Module, channel: lamploop.sync.TensorChannel | None, device: str) -> list[float]:
    x, y = _data()
    batches = lamploop.tensor_batches(x, y, batch_size=32, seed=1)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    model = lamploop.SupervisedModel(module)
    losses: list[float] = []

    async def one(epoch: int) -> float:
        return await lamploop.one_epoch(
            model=model,
            batches=batches(lamploop.BatchContext(epoch)),
            channel=channel,
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=2,
            device=device,
        )

    for epoch in range(3):
        losses.append(anyio.run(one, epoch))
    return losses


@pytest.mark.timeout(120)
def test_nccl_with_one_rank_matches_cpu() -> None:
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    gpu = copy.deepcopy(cpu).to("cuda")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    device = torch.device("cuda", 0)
    group = new_process_group(store, rank=0, nranks=1, device=device, timeout=30, prefix="test")
    # The channel makes the model's sync at its first pass (gpu starts as cpu's copy: one rank
    # needs no broadcast of the initial state).
    channel = ProcessGroupChannel.of_group(group, rank=0, nranks=1, device=torch.device(device))
    gpu_losses = _train(gpu, channel, "cuda")
    cpu_losses = _train(cpu, None, "cpu")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-9)
    for p, q in zip(gpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-9, rtol=0)


@pytest.mark.timeout(120)
def test_fit_on_cuda_reaches_the_cpu_result() -> None:
    x, y = _data()
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        module = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
        ).double()
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            train_batches=lamploop.tensor_batches(x, y, batch_size=32),
            max_epochs=2,
            device=device,
        )
        assert state is not None
        results.append([entry.training_loss for entry in state.learning_curve])
    assert results[1] == pytest.approx(results[0], rel=1e-9)


@pytest.mark.timeout(120)
def test_fit_with_the_default_device_trains_on_cuda() -> None:
    """``device="auto"`` (the default) puts the model on ``cuda`` where torch has it."""
    x, y = _data()
    module = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    seen: list[torch.device] = []
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=32),
        max_epochs=1,
        on_epoch=lambda _: seen.append(next(module.parameters()).device),
    )
    assert state is not None
    assert [d.type for d in seen] == ["cuda"]


@pytest.mark.timeout(120)
@needs_fsdp2
def test_fully_sharded_on_one_nccl_rank_matches_cpu(tmp_path: Path) -> None:
    """:class:`~lamploop.sync.FullyShard` over NCCL (one rank: FSDP2's hooks, the stand-in rule,
    the sharded checkpoint) gives the CPU's plain training, and its checkpoint reads back whole."""
    from lamploop.checkpoint.sharded import read_full, save_sharded
    from lamploop.sync.collectives import Collectives
    from lamploop.sync.fsdp import FullyShard

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    gpu = copy.deepcopy(cpu).to("cuda")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    device = torch.device("cuda", 0)
    group = new_process_group(store, rank=0, nranks=1, device=device, timeout=30, prefix="fsdp")
    collectives = Collectives(group, rank=0, nranks=1, device=device, timeout=30)
    strategy = FullyShard()
    strategy.shard(collectives, gpu)
    channel = ProcessGroupChannel(collectives, strategy)
    gpu_losses = _train(gpu, channel, "cuda")
    cpu_losses = _train(cpu, None, "cpu")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-9)
    path = save_sharded(tmp_path, collectives=collectives, module=gpu, optimizer=None, epoch=3)
    saved, _, _ = read_full(path)
    for name, q in cpu.named_parameters():
        torch.testing.assert_close(saved[name], q.detach(), atol=1e-9, rtol=0)
    channel.close()


@pytest.mark.timeout(300)
@needs_fsdp2
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="fit(strategy='fsdp', world_size=2) needs 2 CUDA devices"
)
def test_fit_fsdp_over_nccl_equals_all_reduce(tmp_path: Path) -> None:
    """``fit(strategy="fsdp", world_size=2, device="cuda")``: NCCL, one device per rank; the
    model it ends with equals ``all_reduce``'s (float64) and its checkpoint verifies."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    worker = Path(__file__).parent / "workers" / "fsdp_fit.py"
    env = {**os.environ, "PYTHONPATH": str(worker.parents[2])}
    for strategy in ("fsdp", "all_reduce"):
        config = {"strategy": strategy, "world_size": 2, "max_epochs": 2, "device": "cuda"}
        config["checkpoint_dir"] = str(tmp_path / f"{strategy}-ck")
        out = tmp_path / strategy
        out.mkdir()
        done = subprocess.run(
            [sys.executable, str(worker), str(out), json.dumps(config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=280,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sharded, plain = (load_file(str(tmp_path / s / "params.safetensors")) for s in ("fsdp", "all_reduce"))
    for name, tensor in plain.items():
        torch.testing.assert_close(sharded[name], tensor, atol=1e-9, rtol=0)
    assert lamploop.checkpoint.verify_checkpoint(tmp_path / "fsdp-ck").ok
