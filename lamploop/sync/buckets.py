"""Gradient buckets: flat buffers reduced while backward still runs.

Each parameter's ``.grad`` becomes a view into a flat bucket buffer; a hook counts the
gradients as autograd accumulates them, and a full bucket's collective starts at once, in
a fixed bucket order on every rank (collectives must pair up across ranks).  Which
collective runs (all-reduce, reduce to the root...) is the strategy's choice:
:class:`BucketedReduction` takes it as a function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import torch

from lamploop.sync.collectives import Collectives, Work

__all__ = ["DEFAULT_BUCKET_CAP_MB", "BucketedReduction", "FlatBuckets", "bucket_layout"]

DEFAULT_BUCKET_CAP_MB: Final = 25.0
"""Gradient bucket size, as DistributedDataParallel's default."""

FIRST_BUCKET_CAP_MB: Final = 1.0
"""A small first bucket starts communication early, as DistributedDataParallel does."""


def bucket_layout(tensors: Sequence[torch.Tensor], cap_mb: float) -> list[list[int]]:
    """Indices of ``tensors`` in buckets, one dtype and device each.

    As in DistributedDataParallel a bucket closes once it holds ``cap_mb`` or more
    (:data:`FIRST_BUCKET_CAP_MB` for the first), so the small last layers start
    communicating early and a large tensor does not wait for its neighbours.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    cap = FIRST_BUCKET_CAP_MB * 2**20
    for i, t in enumerate(tensors):
        if current and (t.dtype != tensors[current[0]].dtype or t.device != tensors[current[0]].device):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += t.numel() * t.element_size()
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2**20
    if current:
        buckets.append(current)
    return buckets


class FlatBuckets:
    """Flat buffers with each tensor of a bucket given a view into its bucket's buffer."""

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


class BucketedReduction:
    """Reduce the gradients of ``parameters`` bucket by bucket during the step's last backward.

    Args:
        collectives: the process group's collectives.
        parameters: the trainable parameters.
        launch: starts the collective of one flat bucket (all-reduce, reduce to root...).
        keeps_result: whether this rank's buckets hold the reduced sum afterwards (and
            must be scaled).
        bucket_cap_mb: the bucket size.
    """

    def __init__(
        self,
        collectives: Collectives,
        parameters: Sequence[torch.nn.Parameter],
        *,
        launch: Callable[[list[torch.Tensor]], Work],
        keeps_result: bool,
        bucket_cap_mb: float,
    ) -> None:
        self._collectives = collectives
        self._launch_one = launch
        self._keeps_result = keeps_result
        params = [p for p in parameters if p.requires_grad]
        self.params = params
        # Gradients become ready roughly in reverse order of registration.
        backward_order = list(reversed(range(len(params))))
        groups = [
            [backward_order[j] for j in b]
            for b in bucket_layout([params[i] for i in backward_order], bucket_cap_mb)
        ]
        self._grads = FlatBuckets(params, groups)
        self._bucket_of = [0] * len(params)
        for b, members in enumerate(groups):
            for i in members:
                self._bucket_of[i] = b
        self._pending = [len(g) for g in groups]
        self._ready = [False] * len(groups)
        self._works: list[Work] = []
        self._armed = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for i, p in enumerate(params):
            p.grad = None
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        view = self._grads.views[index]

        def on_gradient(param: torch.Tensor) -> None:
            # A step starts with .grad = None, so autograd hands over a fresh gradient:
            # copy it into the bucket once (cheaper than zeroing the buckets and adding),
            # and later batches of the step add in place.
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

    def _launch_ready(self) -> None:
        while len(self._works) < len(self._ready) and self._ready[len(self._works)]:
            self._works.append(self._launch_one([self._grads.flats[len(self._works)]]))

    def bucket_bytes(self) -> list[int]:
        """The size of each gradient bucket in bytes, in launch order."""
        return [flat.numel() * flat.element_size() for flat in self._grads.flats]

    def arm(self) -> None:
        """The next backward is the step's last: launch buckets as they fill."""
        self._armed = True

    def reduce(self, scale: float) -> None:
        """Launch what is left, wait for every bucket, and scale the result."""
        if len(self._works) < len(self._ready):
            self._fill_missing_gradients()
        while len(self._works) < len(self._ready):
            self._works.append(self._launch_one([self._grads.flats[len(self._works)]]))
        for b, work in enumerate(self._works):
            self._collectives.wait(work, "gradient reduction")
            if self._keeps_result and scale != 1.0:
                self._grads.flats[b].mul_(scale)
        self._works.clear()
        self._armed = False
        self._ready = [False] * len(self._ready)
        self._pending = [len(g) for g in self._grads.groups]

    def _fill_missing_gradients(self) -> None:
        """Zero gradients for parameters that got none this step (unused, or no batch left)."""
        for i, p in enumerate(self.params):
            view = self._grads.views[i]
            if p.grad is not view:
                view.zero_()
                p.grad = view

    def clear(self) -> None:
        """Drop the gradients; the next step's first backward hands over fresh ones."""
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        """Remove the hooks and the gradients (whatever was in flight is dropped)."""
        for handle in self.handles:
            handle.remove()
        self._works.clear()
        self.clear()
