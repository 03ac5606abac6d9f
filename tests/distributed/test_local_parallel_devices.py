"""``local_data_parallel_training_loop`` checks where each replica is before any thread starts.

A replica on a device the tensor channel cannot carry (``meta``), or spread over several,
used to fail from inside a rank's set-up without saying which replica it was; replicas on CPU
and CUDA at once would each make a group of another kind (Gloo, NCCL) and wait for the other.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import lamploop
from lamploop.errors import ConfigurationError

pytestmark = pytest.mark.timeout(60)


def _run(modules: list[torch.nn.Module]) -> None:
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    batches = lamploop.tensor_batches(x, y, batch_size=8)
    replicas = [(lamploop.SupervisedModel(module), batches, batches) for module in modules]
    anyio.run(
        lambda: lamploop.local_data_parallel_training_loop(
            replicas, lambda params: torch.optim.SGD(params, lr=0.1), 1
        )
    )


def test_a_replica_on_the_meta_device_is_named() -> None:
    with pytest.raises(ConfigurationError) as raised:
        _run([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2, device="meta")])
    assert str(raised.value) == (
        "local_data_parallel_training_loop: replica 1's parameters are on device 'meta'; a replica "
        "trains on cpu or cuda (its gradients cross Gloo or NCCL)"
    )


def test_a_replica_spread_over_two_devices_is_named() -> None:
    spread = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, device="meta"))
    with pytest.raises(ConfigurationError) as raised:
        _run([spread, torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))])
    assert str(raised.value) == (
        "local_data_parallel_training_loop: replica 0's parameters are on several devices "
        "(cpu, meta); a replica trains on one"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replicas_on_cpu_and_cuda_at_once_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="on cpu and cuda at once"):
        _run([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2, device="cuda")])
