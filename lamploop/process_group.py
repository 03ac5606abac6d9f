"""The tensor channel over a ``torch.distributed`` process group.

Each channel owns a process-group *object* (Gloo for CPU devices, NCCL for CUDA
ones) built directly over a store, never the global default group, so several
channels can live in one process (one per thread in
``local_data_parallel_training_loop``) and nothing reads MASTER_ADDR.

Gradients are reduced in buckets while backward runs: each parameter's
``.grad`` is a view into a flat bucket buffer, a hook counts the gradients as
autograd accumulates them, and a full bucket is reduced at once, in a fixed
bucket order on every rank (collectives must match across ranks).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import torch
import torch.distributed as dist

from lamploop.control.commands import Rendezvous
from lamploop.errors import ConfigurationError, DistributedError

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "ProcessGroupChannel",
    "Strategy",
    "create_store",
    "new_process_group",
]

Strategy: TypeAlias = Literal["all_reduce", "reduce_to_root"]
Group: TypeAlias = Any
"""A process-group backend object (``ProcessGroupGloo`` or ``ProcessGroupNCCL``): their
common base is private and the CPU build of torch lacks the NCCL class."""
STRATEGIES: tuple[Strategy, ...] = ("all_reduce", "reduce_to_root")
DEFAULT_BUCKET_CAP_MB = 25.0
_FIRST_BUCKET_CAP_MB = 1.0
"""A small first bucket starts communication early, as DistributedDataParallel does."""


def check_strategy(strategy: str) -> Strategy:
    """Return ``strategy`` if it is one of :data:`STRATEGIES`, else raise ConfigurationError."""
    if strategy not in STRATEGIES:
        msg = f"strategy must be one of {STRATEGIES}, got {strategy!r}"
        raise ConfigurationError(msg)
    return strategy


def create_store(host: str, nranks: int, timeout: float) -> tuple[dist.TCPStore, Rendezvous]:
    """The root's store on a free port of ``host`` and its address for the followers."""
    store = dist.TCPStore(
        host, 0, nranks, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )
    return store, Rendezvous(host=host, port=int(store.port))


def connect_store(rendezvous: Rendezvous, nranks: int, timeout: float) -> dist.TCPStore:
    """A follower's client of the root's store."""
    try:
        return dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            nranks,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as exc:
        msg = f"cannot reach the root's store at {rendezvous.host}:{rendezvous.port}: {exc}"
        raise DistributedError(msg) from exc


def new_process_group(
    store: dist.Store, *, rank: int, nranks: int, device: torch.device, timeout: float, prefix: str
) -> Group:
    """A Gloo (CPU) or NCCL (CUDA) process group over ``store`` (blocks until every rank joins)."""
    scoped = dist.PrefixStore(prefix, store)
    span = datetime.timedelta(seconds=timeout)
    try:
        if device.type == "cuda":
            if not dist.is_nccl_available():
                msg = f"device {device} needs NCCL, which this build of torch lacks"
                raise DistributedError(msg)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = span
            return dist.ProcessGroupNCCL(scoped, rank, nranks, options)
        if device.type != "cpu":
            msg = f"device type {device.type!r} is not supported by the tensor channel (cpu or cuda)"
            raise ConfigurationError(msg)
        return dist.ProcessGroupGloo(scoped, rank, nranks, span)
    except RuntimeError as exc:
        msg = f"rank {rank} of {nranks} could not join the process group: {exc}"
        raise DistributedError(msg) from exc


def _wait(work: Any, what: str, rank: int) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        msg = f"rank {rank}: {what} failed (a peer died or timed out?): {exc}"
        raise DistributedError(msg) from exc


def _buckets(params: Sequence[torch.Tensor], cap_mb: float) -> list[list[int]]:
    """Indices of ``params`` in buckets, one dtype and device each.

    As in DistributedDataParallel a bucket closes once it holds ``cap_mb`` or
    more (1 MiB for the first), so the small last layers start communicating
    early and a large tensor does not wait for its neighbours to fill a bucket.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    cap = _FIRST_BUCKET_CAP_MB * 2**20
    for i, p in enumerate(params):
        if current and (p.dtype != params[current[0]].dtype or p.device != params[current[0]].device):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2**20
    if current:
        buckets.append(current)
    return buckets


class _FlatBuckets:
    """Flat buffers with each tensor of a bucket re-pointed at a view into it."""

    def __init__(self, tensors: Sequence[torch.Tensor], groups: list[list[int]]) -> None:
        self.groups = groups
        self.flats: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for group in groups:
            first = tensors[group[0]]
            flat = torch.zeros(sum(tensors[i].numel() for i in group), dtype=first.dtype, device=first.device)
            offset = 0
            for i in group:
                n = tensors[i].numel()
                self.views[i] = flat[offset : offset + n].view_as(tensors[i])
                offset += n
            self.flats.append(flat)


class _PendingSum:
    def __init__(self, work: Any, values: torch.Tensor, rank: int) -> None:
        self._work = work
        self._values = values
        self._rank = rank

    def wait(self) -> list[float]:
        _wait(self._work, "all-reduce of losses and counts", self._rank)
        return [float(v) for v in self._values.tolist()]


class BucketedGradients:
    """Bucketed gradient reduction overlapped with the last backward of each step.

    With ``all_reduce`` every rank ends with the summed gradients (replicated
    optimizers).  With ``reduce_to_root`` only rank 0 has them; it steps, and
    the parameters are broadcast from it in buckets whose arrival the next
    forward pass waits for module by module.
    """

    def __init__(
        self,
        group: Group,
        parameters: Sequence[torch.nn.Parameter],
        modules: Sequence[torch.nn.Module],
        *,
        rank: int,
        strategy: Strategy,
        bucket_cap_mb: float,
    ) -> None:
        self._group = group
        self._rank = rank
        self._strategy = strategy
        params = [p for p in parameters if p.requires_grad]
        self._params = params
        # Gradients become ready roughly in reverse order of registration.
        backward_order = list(reversed(range(len(params))))
        grad_groups = [
            [backward_order[j] for j in b]
            for b in _buckets([params[i] for i in backward_order], bucket_cap_mb)
        ]
        self._grads = _FlatBuckets(params, grad_groups)
        self._bucket_of = [0] * len(params)
        for b, members in enumerate(grad_groups):
            for i in members:
                self._bucket_of[i] = b
        self._pending = [len(g) for g in grad_groups]
        self._ready = [False] * len(grad_groups)
        self._works: list[Any] = []
        self._armed = False
        self._handles = []
        for i, p in enumerate(params):
            p.grad = None
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        self._broadcasts: dict[int, Any] = {}
        if strategy == "reduce_to_root":
            self._params_flat = _FlatBuckets(params, _buckets(params, bucket_cap_mb))
            with torch.no_grad():
                for i, p in enumerate(params):
                    self._params_flat.views[i].copy_(p)
                    p.data = self._params_flat.views[i]
            bucket_of_param = {}
            for b, members in enumerate(self._params_flat.groups):
                for i in members:
                    bucket_of_param[id(params[i])] = b
            for m in modules:
                needed = sorted(
                    {bucket_of_param[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of_param}
                )
                if needed:
                    self._handles.append(m.register_forward_pre_hook(self._await_parameters(needed)))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        view = self._grads.views[index]

        def on_gradient(param: torch.Tensor) -> None:
            # A step starts with .grad = None, so autograd hands over a fresh
            # gradient: copy it into the bucket once (cheaper than zeroing the
            # buckets and adding), and later batches of the step add in place.
            grad = param.grad
            if grad is not None and grad is not view:
                view.copy_(grad)
                param.grad = view
            if not self._armed:
                return
            b = self._bucket_of[index]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._ready[b] = True
                self._launch_ready()

        return on_gradient

    def _launch(self, b: int) -> None:
        flat = self._grads.flats[b]
        if self._strategy == "all_reduce":
            self._works.append(self._group.allreduce([flat]))
        else:
            options = dist.ReduceOptions()  # the default reduction is a sum
            options.rootRank = 0
            self._works.append(self._group.reduce([flat], options))

    def _launch_ready(self) -> None:
        while len(self._works) < len(self._ready) and self._ready[len(self._works)]:
            self._launch(len(self._works))

    def _await_parameters(self, needed: list[int]) -> Callable[..., None]:
        def before_forward(*_: object) -> None:
            for b in needed:
                work = self._broadcasts.pop(b, None)
                if work is not None:
                    _wait(work, "parameter broadcast", self._rank)

        return before_forward

    def arm(self) -> None:
        self._armed = True

    def finish(self, scale: float) -> None:
        if len(self._works) < len(self._ready):
            self._fill_missing_gradients()
        while len(self._works) < len(self._ready):
            self._launch(len(self._works))
        keep = self._strategy == "all_reduce" or self._rank == 0
        for b, work in enumerate(self._works):
            _wait(work, "gradient reduction", self._rank)
            if keep and scale != 1.0:
                self._grads.flats[b].mul_(scale)
        self._works.clear()
        self._armed = False
        self._ready = [False] * len(self._ready)
        self._pending = [len(g) for g in self._grads.groups]

    def _fill_missing_gradients(self) -> None:
        """Zero gradients for parameters that got none this step (unused, or no batch left)."""
        for i, p in enumerate(self._params):
            view = self._grads.views[i]
            if p.grad is not view:
                view.zero_()
                p.grad = view

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def after_step(self) -> None:
        self.zero_grad()
        if self._strategy == "reduce_to_root":
            options = dist.BroadcastOptions()
            options.rootRank = 0
            for b, flat in enumerate(self._params_flat.flats):
                self._broadcasts[b] = self._group.broadcast([flat], options)

    def flush(self) -> None:
        for b in sorted(self._broadcasts):
            _wait(self._broadcasts.pop(b), "parameter broadcast", self._rank)

    def close(self) -> None:
        self.flush()
        for handle in self._handles:
            handle.remove()
        for p in self._params:
            p.grad = None


class ProcessGroupChannel:
    """A :class:`~lamploop.tensors.TensorChannel` over one process group."""

    def __init__(
        self,
        group: Group,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        strategy: Strategy = "reduce_to_root",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        self._group = group
        self._rank = rank
        self._nranks = nranks
        self._device = device
        self._strategy = check_strategy(strategy)
        self._bucket_cap_mb = bucket_cap_mb
        self._syncs: dict[tuple[int, ...], BucketedGradients] = {}
        self._modules: Sequence[torch.nn.Module] = ()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def nranks(self) -> int:
        return self._nranks

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def attach(self, module: torch.nn.Module) -> None:
        """Tell the channel which module it trains (for waiting on parameter broadcasts)."""
        self._modules = list(module.modules())

    def gradient_sync(self, parameters: Sequence[torch.nn.Parameter]) -> BucketedGradients:
        key = tuple(id(p) for p in parameters)
        sync = self._syncs.get(key)
        if sync is None:
            sync = BucketedGradients(
                self._group,
                parameters,
                self._modules,
                rank=self._rank,
                strategy=self._strategy,
                bucket_cap_mb=self._bucket_cap_mb,
            )
            self._syncs[key] = sync
        return sync

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return self.begin_all_reduce_sum(values).wait()

    def begin_all_reduce_sum(self, values: Sequence[float]) -> _PendingSum:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._stats_device())
        return _PendingSum(self._group.allreduce([t]), t, self._rank)

    def _stats_device(self) -> torch.device:
        return self._device if self._device.type == "cuda" else torch.device("cpu")

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with rank 0's (same shapes everywhere)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for t in tensors:
            staging = t.detach().to(self._device).contiguous()
            _wait(self._group.broadcast([staging], options), "broadcast of the initial state", self._rank)
            with torch.no_grad():
                t.copy_(staging)

    def broadcast_json(self, value: Any) -> Any:
        """Rank 0's JSON-ready ``value`` on every rank (bytes over the tensor channel, no pickle)."""
        payload = json.dumps(value).encode() if self._rank == 0 else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self._stats_device())
        options = dist.BroadcastOptions()
        options.rootRank = 0
        _wait(self._group.broadcast([length], options), "broadcast of a length", self._rank)
        buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=self._stats_device())
        if self._rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        _wait(self._group.broadcast([buffer], options), "broadcast of a JSON value", self._rank)
        return json.loads(bytes(buffer.cpu().tolist()).decode())

    def check_agreement(self, label: str, value: str) -> None:
        """Raise DistributedError on every rank if the ranks hold different ``value`` for ``label``."""
        values = self.broadcast_json([value])
        mine = torch.tensor([int(values[0] == value)], dtype=torch.int64, device=self._stats_device())
        _wait(self._group.allreduce([mine]), f"check of {label}", self._rank)
        agreeing = int(mine.item())
        if agreeing != self._nranks:
            mismatch = "" if value == values[0] else f"; rank {self._rank} has {value!r}"
            msg = (
                f"the ranks disagree on {label}: {self._nranks - agreeing} of {self._nranks} differ "
                f"from rank 0's {values[0]!r}{mismatch}"
            )
            raise DistributedError(msg)

    def flush(self) -> None:
        """Wait for every communication still in flight."""
        for sync in self._syncs.values():
            sync.flush()

    def close(self) -> None:
        """Release the gradient buckets and hooks."""
        for sync in self._syncs.values():
            sync.close()
        self._syncs.clear()
