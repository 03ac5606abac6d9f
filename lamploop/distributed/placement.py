"""Where this process trains: its rank, the number of ranks, and its device (``fit``'s placement).

Under a launcher (torchrun, Slurm, lamploop's own spawner: :func:`~lamploop.distributed.launch.launch_env`)
the launcher's variables decide the rank and the world size; without one this process is
rank 0 of ``world_size`` (default 1).  The device is the one asked for, or with ``"auto"``
(:data:`AUTO_DEVICE`) the best one torch has here.
"""

from __future__ import annotations

import os

import attrs
import torch

from lamploop.checks import check_device
from lamploop.distributed.launch import LaunchEnv, launch_env
from lamploop.errors import ConfigurationError

__all__ = ["AUTO_DEVICE", "Placement", "checked_device", "place"]

AUTO_DEVICE = "auto"
"""``fit(device="auto")``: CUDA when torch has it (``cuda:LOCAL_RANK``, with NCCL), else MPS for
one rank where torch has it, else the CPU (with Gloo)."""


@attrs.frozen
class Placement:
    """This process's place in the run.

    Attributes:
        env: the launcher's environment (``None``: no launcher; this process is the root).
        nranks: the number of ranks.
        rank: this process's rank.
        device: where it trains.
    """

    env: LaunchEnv | None
    nranks: int
    rank: int
    device: torch.device


def place(world_size: int | None, device: torch.device | str) -> Placement:
    """This process's :class:`Placement` for ``fit(world_size=, device=)``.

    With several ranks on the CPU, each rank gets an equal share of the cores as torch threads.

    Raises:
        ConfigurationError: ``world_size`` is not an int >= 1 or disagrees with the launcher's,
            or the device is unknown, is CUDA where there is none, or "auto" finds fewer CUDA
            devices than local ranks.
    """
    env = launch_env()
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
    ):
        msg = f"fit: world_size must be None or an int >= 1, got {world_size!r}"
        raise ConfigurationError(msg)
    if env is not None and world_size is not None and world_size != env.world_size:
        msg = (
            f"fit: world_size={world_size}, but the launcher ({env.launcher}) started {env.world_size} ranks"
        )
        raise ConfigurationError(msg)
    nranks = env.world_size if env is not None else (world_size or 1)
    local_rank = env.local_rank if env is not None else 0
    torch_device = _auto_device(nranks, local_rank) if device == AUTO_DEVICE else checked_device(device)
    if torch_device.type == "cuda" and torch_device.index is None and nranks > 1:
        torch_device = torch.device("cuda", local_rank)
    if nranks > 1 and torch_device.type == "cpu":
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // min(nranks, cores)))
    return Placement(env, nranks, env.rank if env is not None else 0, torch_device)


def _auto_device(nranks: int, local_rank: int) -> torch.device:
    """The device ``"auto"`` picks for this rank (see :data:`AUTO_DEVICE`)."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            msg = (
                f"fit: device='auto' picks CUDA, but this rank's local rank is {local_rank} and there "
                f"are {count} CUDA devices: start one rank per device, or pass device='cpu'"
            )
            raise ConfigurationError(msg)
        return torch.device("cuda", local_rank if nranks > 1 else torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if nranks == 1 and mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def checked_device(device: torch.device | str, where: str = "fit") -> torch.device:
    """``device`` as a ``torch.device``, one that torch knows and that exists here.

    Raises:
        ConfigurationError: torch does not know ``device``, or it does not exist here (CUDA
            where there is none, a CUDA index past the last device, a backend this build of
            torch or this machine lacks), or it is ``meta`` (no data).
    """
    torch_device = check_device(where, device)
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            msg = (
                f"{where}: device={str(device)!r}, but CUDA is not available here (torch "
                f"{torch.__version__}, {torch.cuda.device_count()} CUDA devices); pass device='cpu'"
            )
            raise ConfigurationError(msg)
        count = torch.cuda.device_count()
        if torch_device.index is not None and torch_device.index >= count:
            msg = (
                f"{where}: device={str(device)!r}, but this machine has {count} CUDA devices (0..{count - 1})"
            )
            raise ConfigurationError(msg)
    elif torch_device.type == "meta":
        msg = (
            f"{where}: device={str(device)!r} holds no data (shapes only): training needs a device that "
            "computes, e.g. 'cpu' or 'cuda'"
        )
        raise ConfigurationError(msg)
    elif torch_device.type != "cpu":
        try:  # another backend (mps, xpu, ...): whether this build of torch and this machine have it
            torch.empty(0, device=torch_device)
        except (RuntimeError, AssertionError) as exc:
            # torch's message runs to pages: its first sentence says it
            why = (str(exc).splitlines() or [type(exc).__name__])[0].split(". ")[0][:300]
            msg = f"{where}: device={str(device)!r} cannot be used here (torch {torch.__version__}): {why}"
            raise ConfigurationError(msg) from None
    return torch_device
