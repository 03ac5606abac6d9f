"""A process's RNG states, and their on-disk form (scalars in the descriptor, arrays as tensors)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

# --------------------------------------------------------------------------------------------
# RNG states


@attrs.frozen(eq=False)
class RngStates:
    """The random-number generator states of one process, as plain values and tensors.

    Attributes:
        torch_cpu: ``torch.get_rng_state()``, a uint8 tensor.
        torch_cuda: ``torch.cuda.get_rng_state_all()``; empty without CUDA.
        numpy: numpy's legacy global state, ``np.random.get_state()``:
            ``(algorithm, keys, pos, has_gauss, cached_gaussian)``.
        python: ``random.getstate()``: ``(version, internal state, gauss_next)``.
    """

    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...]
    numpy: tuple[str, np.ndarray[Any, Any], int, int, float]
    python: tuple[Any, ...]

    @classmethod
    def capture(cls) -> RngStates:
        """The current states of every generator this class knows."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
        algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        return cls(
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
            numpy=(str(algorithm), np.array(keys, copy=True), int(pos), int(has_gauss), float(cached)),
            python=random.getstate(),
        )

    def restore(self) -> None:
        """Set every generator to these states.

        CUDA states are restored on the devices that exist here, in order: a
        state saved on a machine with more GPUs than this one is ignored beyond
        ``torch.cuda.device_count()``.
        """
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda and torch.cuda.is_available():
            for device, state in enumerate(self.torch_cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, device)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@attrs.frozen
class _PythonRngRecord:
    version: int
    gauss_next: float | None


@attrs.frozen
class _NumpyRngRecord:
    algorithm: str
    pos: int
    has_gauss: int
    cached_gaussian: float


@attrs.frozen
class _RngRecord:
    python: _PythonRngRecord
    numpy: _NumpyRngRecord
    cuda_devices: int


def _rng_to_disk(rng: RngStates) -> tuple[_RngRecord, dict[str, torch.Tensor]]:
    version, internal, gauss_next = rng.python
    algorithm, keys, pos, has_gauss, cached = rng.numpy
    tensors = {
        "torch.cpu": rng.torch_cpu.detach().cpu().contiguous(),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "python.state": torch.tensor(list(internal), dtype=torch.int64),
    }
    for device, state in enumerate(rng.torch_cuda):
        tensors[f"torch.cuda.{device}"] = state.detach().cpu().contiguous()
    record = _RngRecord(
        python=_PythonRngRecord(version=int(version), gauss_next=gauss_next),
        numpy=_NumpyRngRecord(algorithm=algorithm, pos=pos, has_gauss=has_gauss, cached_gaussian=cached),
        cuda_devices=len(rng.torch_cuda),
    )
    return record, tensors


def _rng_names(record: _RngRecord) -> list[str]:
    return ["torch.cpu", "numpy.keys", "python.state"] + [
        f"torch.cuda.{d}" for d in range(record.cuda_devices)
    ]


def _rng_from_disk(record: _RngRecord, tensors: Mapping[str, torch.Tensor]) -> RngStates:
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    return RngStates(
        torch_cpu=tensors["torch.cpu"],
        torch_cuda=tuple(tensors[f"torch.cuda.{d}"] for d in range(record.cuda_devices)),
        numpy=(
            record.numpy.algorithm,
            keys,
            record.numpy.pos,
            record.numpy.has_gauss,
            record.numpy.cached_gaussian,
        ),
        python=(
            record.python.version,
            tuple(int(v) for v in tensors["python.state"].tolist()),
            record.python.gauss_next,
        ),
    )
