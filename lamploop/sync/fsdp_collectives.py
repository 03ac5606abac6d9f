"""FSDP2's side of the ``fsdp`` strategy: the device mesh over lamploop's group, and the
all-gather and reduce-scatter that a frozen peer cannot hang (see :mod:`lamploop.sync.fsdp`).

Kept apart from :mod:`lamploop.sync.fsdp` because defining these imports FSDP2 and DTensor
(about 1.4 s of start-up on a 2-core machine, sympy among them): every rank and every
process that imports lamploop would pay it, though only a model that is sharded needs it.
:meth:`~lamploop.sync.fsdp.FullyShard.shard` imports this module.

.. versionadded:: 0.3
   split from :mod:`lamploop.sync.fsdp`.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import GroupName

# The interfaces of FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (public
# methods) live in a private module of torch 2.13.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lamploop.errors import ConfigurationError
from lamploop.sync.collectives import Collectives

__all__ = ["AbortableAllGather", "AbortableReduceScatter", "mesh_of"]

_names = itertools.count()
_meshes_lock = threading.Lock()
_meshes: weakref.WeakKeyDictionary[Collectives, DeviceMesh] = weakref.WeakKeyDictionary()


def mesh_of(collectives: Collectives) -> DeviceMesh:
    """The one-dimensional device mesh over ``collectives``' process group (made once per ``collectives``).

    The group is registered under a name of its own for as long as the mesh lives (the
    sharded module's parameters hold it); nothing here keeps it alive longer.

    Raises:
        ConfigurationError: a device that is neither ``cpu`` (Gloo) nor ``cuda`` (NCCL).
    """
    with _meshes_lock:
        mesh = _meshes.get(collectives)
        if mesh is None:
            mesh = _new_mesh(collectives)
            _meshes[collectives] = mesh
        return mesh


def _new_mesh(collectives: Collectives) -> DeviceMesh:
    device_type = collectives.device.type
    if device_type == "cpu":
        backend_type = dist.ProcessGroup.BackendType.GLOO
    elif device_type == "cuda":
        backend_type = dist.ProcessGroup.BackendType.NCCL
    else:
        msg = f"strategy 'fsdp': device type {device_type!r} is not supported (cpu or cuda)"
        raise ConfigurationError(msg)
    name = GroupName(f"lamploop-fsdp-{os.getpid()}-{next(_names)}")
    # A ProcessGroup around lamploop's backend object: FSDP2 and DTensor look groups up by
    # name (functional collectives) and ask them for ranks and sizes.
    wrapper = dist.ProcessGroup(dist.HashStore(), collectives.rank, collectives.nranks)
    wrapper._set_default_backend(backend_type)
    wrapper._register_backend(torch.device(device_type), backend_type, collectives.group)
    wrapper._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, wrapper)
    ranks = torch.arange(collectives.nranks, dtype=torch.int)
    mesh = DeviceMesh(device_type, ranks, _init_backend=False, _rank=collectives.rank)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = wrapper
    # Released with the mesh, during the run, not while the interpreter finalizes (where a
    # Gloo group's destruction can abort the process, see lamploop.sync.abandon).
    weakref.finalize(mesh, torch._C._distributed_c10d._unregister_process_group, name)
    return mesh


class _WaitedBySlices:
    """What FSDP2's custom collectives share here: the rank's collectives, and plain buffers."""

    def __init__(self, collectives: Collectives) -> None:
        self._collectives = collectives

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _wait(self, work: dist.Work | None, tensors: list[torch.Tensor], what: str) -> None:
        assert work is not None  # started with async_op=True
        self._collectives.wait(self._collectives.track(work, tensors), what)


class AbortableAllGather(_WaitedBySlices, AllGather):
    """FSDP2's all-gather, waited for by :meth:`Collectives.wait`: sliced, ended by the abort signal.

    Started as FSDP2's default does (``torch.distributed.all_gather_single`` on the unit's
    group, which wraps ``collectives``' group), always asynchronously, and waited for before
    returning: FSDP2 then takes it for a synchronous collective (it is one on the CPU anyway).
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        self._wait(work, [output_tensor, input_tensor], "FSDP all-gather of a unit's parameters")
        return None


class AbortableReduceScatter(_WaitedBySlices, ReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients, waited for by :meth:`Collectives.wait`.

    See :class:`AbortableAllGather`.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        self._wait(work, [output_tensor, input_tensor], "FSDP reduce-scatter of a unit's gradients")
        return None
