"""``fsdp``: fully sharded data parallel on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Every rank holds ``1/R`` of each parameter, of its gradient and of its optimizer state
(dim-0 shards, as FSDP2 cuts them); a forward all-gathers a unit's parameters, a backward
reduce-scatters its gradients.  The engine is PyTorch's own; this module puts it behind
lamploop's :class:`~lamploop.sync.strategy.GradientSync` contract:

- *Gradients are sums, scaled after.*  FSDP2 would average over ranks; lamploop's contract
  is the sum over ranks of each rank's ``d(loss_sum / expected)``, times ``reduce``'s scale
  (the mean over all examples of all ranks).  The units are told to divide by ``1``
  (``set_gradient_divide_factor``), and :meth:`FullyShardedSync.reduce` scales the local
  gradient shards: the sync reduces linearly.
- *Accumulation reduce-scatters every micro-batch* into the sharded ``.grad`` (which FSDP2
  accumulates), so a step with ``k`` batches never holds an unsharded gradient: memory
  stays at the sharded size, communication is ``k`` reduce-scatters.
- *Every rank runs every forward.*  Each forward and backward is a collective, so a rank
  whose stream ended must still run one when another rank has a batch.  The sync says so
  (``pads_steps = True``) and :func:`lamploop.one_epoch` then runs a *stand-in* (this
  rank's first batch of the pass, with its backward seeded by zero: no example, no
  gradient) in every micro-batch position that has no batch, and carries "has another
  batch" in the step's sum so that no rank starts a step nobody has data for.

The process group: lamploop builds its own Gloo/NCCL group object over a store (never the
global default group, see :mod:`lamploop.distributed.process_group`), and FSDP2 wants a
``DeviceMesh``.  :func:`mesh_of` wraps lamploop's group in a ``ProcessGroup`` registered
under a name of its own and builds a one-dimensional mesh over it; the c10d calls this needs
(``ProcessGroup._register_backend``, ``DeviceMesh(_init_backend=False, _rank=...)``) are
private, hence kept here, in one function.  FSDP2's collectives and lamploop's step sums then
share one group and are issued in the same order on every rank.

Use without the drivers (one process per rank, a group of your own)::

    collectives = Collectives(group, rank=rank, nranks=nranks, device=device, timeout=600)
    strategy = FullyShard()
    strategy.shard(collectives, module)                  # before making the optimizer
    optimizer = torch.optim.Adam(module.parameters())    # over the shards
    channel = ProcessGroupChannel(collectives, strategy)
    await one_epoch(model=model, batches=..., channel=channel, step_optimizer=optimizer.step)

*A frozen peer ends the step* (DESIGN.md section 5).  FSDP2 waits for its all-gathers and
reduce-scatters inside its own hooks, with Gloo's blocking ``wait()``, which nothing can
interrupt: a survivor left waiting by a frozen rank would hang until the collective timeout.
On Gloo, :meth:`FullyShard.shard` therefore gives every unit lamploop's own all-gather and
reduce-scatter (FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``): the same
``torch.distributed`` calls, whose waits are :meth:`Collectives.wait`'s, sliced and ended by
the rank's abort signal once the heartbeats declare a peer lost.  The ``DTensor`` collectives
that FSDP2 does not issue (the global norm of ``clip_grad_norm_``, a sharded model's
``full_tensor()``) still wait unsliced: the rank's abort signal is told so
(:meth:`~lamploop.sync.collectives.AbortSignal.allow_giving_up`, :data:`GIVE_UP_AFTER_S`), and
a training thread still blocked that long after the signal is given up on, its run ending
with the error that names the lost rank.  On NCCL, FSDP2's collectives are queued on the
device and the host waits only in lamploop's (sliced) collectives: FSDP2's own stand.

Checkpoints of a sharded model: :mod:`lamploop.checkpoint.sharded`.

.. versionadded:: 0.3
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeGuard

import attrs
import torch

from lamploop.errors import ConfigurationError
from lamploop.sync.collectives import Collectives
from lamploop.sync.strategy import GradientSync, register_strategy

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from lamploop.sync.fsdp_collectives import AbortableAllGather, AbortableReduceScatter, mesh_of

# FSDP2 and DTensor are imported when a model is sharded, not with lamploop (about 1.4 s of
# every process's start-up here): lamploop.sync.fsdp_collectives holds what subclasses them.
_LAZY = {"AbortableAllGather", "AbortableReduceScatter", "mesh_of"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from lamploop.sync import fsdp_collectives

        return getattr(fsdp_collectives, name)
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


__all__ = [
    "FSDP2_METHODS",
    "GIVE_UP_AFTER_S",
    "AbortableAllGather",
    "AbortableReduceScatter",
    "FullyShard",
    "FullyShardedSync",
    "check_fsdp2_api",
    "default_units",
    "is_dtensor",
    "is_sharded",
    "local_bytes",
    "mesh_of",
    "rebuild_optimizer",
]

GIVE_UP_AFTER_S: Final = 0.5
"""How long after its abort signal a sharded rank's training thread, blocked in a collective that
does not look at the signal (a ``DTensor``'s), is waited for before it is given up on.  Within the
bound a survivor ends in (the heartbeat timeout and a second), and long enough for a thread in a
sliced wait (:data:`~lamploop.sync.collectives.POLL_S`) to end by itself on a loaded machine."""

FSDP2_METHODS: Final = (
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
    "set_reduce_scatter_unused_params",
)
"""The methods of ``FSDPModule`` that :meth:`FullyShard.shard` calls: torch 2.13 has them all;
2.11 lacks ``set_reduce_scatter_unused_params`` (seen on a GPU machine's torch 2.11.0+cu130)."""

_DTYPES: dict[str, torch.dtype] = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}


def check_fsdp2_api(where: str = "FullyShard.shard") -> None:
    """Raise ConfigurationError if this torch's FSDP2 lacks a method the ``fsdp`` strategy needs.

    Without ``set_reduce_scatter_unused_params`` a parameter that one rank's forward did not
    use would make the ranks reduce-scatter different tensors (wrong sums, or a hang on NCCL):
    the strategy refuses such a torch before anything starts rather than train on it.
    """
    from torch.distributed.fsdp import FSDPModule

    missing = [name for name in FSDP2_METHODS if not hasattr(FSDPModule, name)]
    if missing:
        names = ", ".join(f"FSDPModule.{name}" for name in missing)
        msg = (
            f"{where}: strategy 'fsdp' needs FSDP2's {names}, which this torch ({torch.__version__}) "
            "lacks (torch 2.13 has it): upgrade torch, or train with strategy='all_reduce'"
        )
        raise ConfigurationError(msg)


def default_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units when none are named: each direct child of ``module`` that holds parameters.

    The root is always a unit too (it takes what no child holds).  For a stack of blocks pass
    ``units=lambda m: list(m.blocks)`` instead: one all-gather per block.
    """
    return [child for child in module.children() if next(child.parameters(), None) is not None]


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` was sharded by ``fully_shard`` (its root is an FSDP unit)."""
    # No FSDP unit exists before FSDP2 is imported: asked on every forward, this imports nothing.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor (a sharded parameter's type); imports nothing, as none
    exists before DTensor is imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes held by this rank for ``tensors``: a DTensor's local shard, a plain tensor's storage.

    Views of one storage count once (a flat buffer with parameter views, say).
    """
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() in seen and storage.data_ptr() != 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], module: torch.nn.Module
) -> torch.optim.Optimizer:
    """``optimizer``'s twin over ``module``'s sharded parameters, its state cut to this rank's shards.

    ``names`` maps ``id()`` of each parameter the optimizer was made over to its name in
    ``module`` (taken before sharding, which replaces every parameter).  Each param group
    keeps its options; a state tensor shaped like its parameter becomes that parameter's
    local shard, anything else (a step count) is kept as is.

    Raises:
        ConfigurationError: the optimizer holds a parameter that is not ``module``'s.
    """
    sharded = dict(module.named_parameters())
    old_to_new: dict[int, torch.nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in sharded:
                msg = (
                    "strategy 'fsdp': the optimizer holds a parameter that is not the model's "
                    f"(shape {tuple(p.shape)}); make it from model.parameters()"
                )
                raise ConfigurationError(msg)
            old_to_new[id(p)] = sharded[name]
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [old_to_new[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    rebuilt = type(optimizer)(groups, **optimizer.defaults)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            new = old_to_new[id(p)]
            rebuilt.state[new] = {key: _shard_like(value, p, new) for key, value in state.items()}
    return rebuilt


def _shard_like(value: Any, full: torch.Tensor, sharded: torch.nn.Parameter) -> Any:
    if isinstance(value, torch.Tensor) and is_dtensor(sharded) and value.shape == full.shape:
        from torch.distributed.tensor import distribute_tensor

        # Every rank holds the full tensor (broadcast from the root): cut locally, no collective.
        return distribute_tensor(
            value.detach().to(sharded.device), sharded.device_mesh, sharded.placements, src_data_rank=None
        )
    return value


class FullyShardedSync:
    """The :class:`~lamploop.sync.strategy.GradientSync` of :class:`FullyShard` (see the module doc)."""

    reduces_linearly = True  # sums reduce-scattered, scaled after: the loop may guess the count
    pads_steps = True  # each forward is a collective: every rank runs one per micro-batch

    def __init__(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        self._parameters = [p for p in parameters if p.requires_grad]

    def _clear(self) -> None:
        for p in self._parameters:
            p.grad = None

    def begin_pass(self) -> None:
        self._clear()

    def last_backward(self) -> None:
        """Every backward reduce-scatters already (see the module doc)."""

    def reduce(self, scale: float) -> None:
        """FSDP2 reduce-scattered the sums in backward; only the local shards are scaled."""
        if scale != 1.0:
            grads = [_local(p.grad) for p in self._parameters if p.grad is not None]
            torch._foreach_mul_(grads, scale)

    def after_step(self) -> None:
        self._clear()

    def end_pass(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of each backward: nothing in flight."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Stateless: the shards live in the module and the optimizer."""

    def close(self, *, abandon: bool) -> None:
        """FSDP2's hooks stay with the module, which stays sharded."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


@attrs.frozen(kw_only=True)
class FullyShard:
    """The ``fsdp`` strategy (registered by :mod:`lamploop.sync`): FSDP2 behind lamploop's contract.

    Attributes:
        name: the registered name.
        units: the submodules that become FSDP units (each all-gathers its parameters for
            its own forward and frees them after): :func:`default_units` when ``None``.
        reshard_after_forward: free a unit's gathered parameters after its forward and
            gather them again in backward (least memory); ``False`` keeps them until the
            backward (one all-gather less per unit and step).
        param_dtype: ``"bf16"`` or ``"16"`` to run forward and backward on parameters cast
            to that dtype (FSDP2's mixed precision; the shards and the optimizer stay in
            their own dtype); ``None``: the parameters' dtype.
        reduce_dtype: the dtype gradients are reduce-scattered in; ``None``: ``param_dtype``'s.
    """

    name: str = "fsdp"
    steps_on_every_rank: bool = True
    units: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.units is not None and not callable(self.units):
            msg = (
                "FullyShard: units must be None or a function module -> the submodules to shard, "
                f"got {type(self.units).__name__}"
            )
            raise ConfigurationError(msg)
        for field, value in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype)):
            if value is not None and value not in _DTYPES:
                msg = f"FullyShard: {field} must be None or one of {sorted(_DTYPES)}, got {value!r}"
                raise ConfigurationError(msg)

    def _policy(self) -> MixedPrecisionPolicy:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        param = _DTYPES[self.param_dtype] if self.param_dtype is not None else None
        reduce = _DTYPES[self.reduce_dtype] if self.reduce_dtype is not None else None
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)

    def shard(self, collectives: Collectives, module: torch.nn.Module) -> torch.nn.Module:
        """Shard ``module`` in place over ``collectives``' ranks (every rank alike); returns it.

        Every rank must hold the same parameters (the drivers broadcast the root's first).
        Make the optimizer afterwards, or rebuild it with :func:`rebuild_optimizer`:
        sharding replaces every parameter by a ``DTensor`` shard.

        Raises:
            ConfigurationError: ``collectives`` is not lamploop's :class:`Collectives` (a bare
                process group, say) or ``module`` no ``torch.nn.Module``; ``module`` is sharded
                already, the device is not supported, or this torch's FSDP2 lacks a method it
                needs (:func:`check_fsdp2_api`).
        """
        check_fsdp2_api()
        if not isinstance(collectives, Collectives):
            msg = (
                "FullyShard.shard(collectives, module): collectives must be lamploop.sync.Collectives "
                f"(which wraps the process group with its rank, device and timeout), got "
                f"{type(collectives).__name__}"
            )
            raise ConfigurationError(msg)
        if not isinstance(module, torch.nn.Module):
            what = type(module).__name__
            msg = f"FullyShard.shard(collectives, module): module must be a torch.nn.Module, got {what}"
            raise ConfigurationError(msg)
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from lamploop.sync.fsdp_collectives import AbortableAllGather, AbortableReduceScatter, mesh_of

        if is_sharded(module):
            msg = "strategy 'fsdp': the model is sharded already"
            raise ConfigurationError(msg)
        mesh = mesh_of(collectives)
        units = self.units(module) if self.units is not None else default_units(module)
        policy = self._policy()
        for unit in units:
            if unit is module:
                continue
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        abortable = collectives.device.type == "cpu"  # Gloo: FSDP2's own waits cannot be interrupted
        if abortable:
            collectives.abort.allow_giving_up(GIVE_UP_AFTER_S)
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                if abortable:
                    unit.set_custom_all_gather(AbortableAllGather(collectives))
                    unit.set_custom_reduce_scatter(AbortableReduceScatter(collectives))
                # Sums, not means (lamploop scales in reduce); zeros for a parameter a forward
                # did not use, so that every rank reduce-scatters the same tensors.
                unit.set_gradient_divide_factor(1.0)
                # A plain SUM collective: FSDP2 would use PREMUL_SUM(1 / factor) for float32 and
                # bfloat16, which Gloo refuses (and NCCL needs no scaling by 1 either).
                unit.set_force_sum_reduction_for_comms(True)
                unit.set_reduce_scatter_unused_params(True, recurse=False)
        return module

    def prepare(
        self,
        collectives: Collectives,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        names: Mapping[int, str] | None = None,
    ) -> torch.optim.Optimizer | None:
        """Shard ``module`` and rebuild ``optimizer`` over its shards (the drivers' set-up hook).

        ``names``: ``id()`` of each parameter ``optimizer`` holds to its name in ``module``
        (default: ``module``'s own parameters; pass it when the optimizer was made over a
        twin of ``module``, as the drivers do, see :mod:`lamploop.distributed.sharded_rank`).
        """
        if names is None:
            names = {id(p): name for name, p in module.named_parameters()}
        self.shard(collectives, module)
        return rebuild_optimizer(optimizer, names, module) if optimizer is not None else None

    def gradient_sync(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        bucket_cap_mb: float,
    ) -> GradientSync:
        """The sync of a model :meth:`shard` sharded (``modules[0]`` is its root).

        Raises:
            ConfigurationError: the model was not sharded first.
        """
        if not modules or not is_sharded(modules[0]):
            msg = (
                "strategy 'fsdp': the model is not sharded. fit(strategy='fsdp', world_size=n) and "
                "drive_/follow_distributed_training shard it (one process per rank); with "
                "one_epoch, shard the model first (FullyShard.shard(collectives, module)), then "
                "make its optimizer over the shards"
            )
            raise ConfigurationError(msg)
        return FullyShardedSync(parameters)


# Registered here rather than in lamploop.sync's __init__ beside the others: importing the
# sync package imports this module, so the name is there whenever a strategy is looked up.
register_strategy(FullyShard())
