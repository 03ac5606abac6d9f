"""Buffers (BatchNorm running statistics) made alike on every rank at the end of each training pass.

Each rank updates its buffers from its own batches, so after a pass they differ.  Before
the pass's loss is returned (and so before validation and any checkpoint), floating-point
buffers become their mean over the ranks, which for BatchNorm's running mean is the
running mean of all the ranks' batches (for the running variance, the mean of the ranks'
running variances); integer buffers (``num_batches_tracked``) take the root's, which every
rank counts alike.  One all-reduce per dtype and one broadcast, once per epoch: nothing per
step.  DistributedDataParallel instead broadcasts the root's buffers before every forward.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from lamploop.sync.collectives import Collectives

__all__ = ["average_buffers"]


def average_buffers(collectives: Collectives, module: torch.nn.Module) -> None:
    """Floating buffers of ``module`` become their mean over the ranks; integer ones the root's."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    integers = []
    for buffer in module.buffers():
        if buffer.is_floating_point() or buffer.is_complex():
            by_dtype[(buffer.dtype, buffer.device)].append(buffer)
        else:
            integers.append(buffer)
    for (_, device), buffers in by_dtype.items():
        flat = torch.cat([b.detach().reshape(-1) for b in buffers]).to(collectives.device)
        collectives.wait(collectives.all_reduce([flat]), "sum of the model's buffers")
        flat.div_(collectives.nranks)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b).to(device))
                offset += b.numel()
    if integers:
        collectives.broadcast_tensors(integers, "root's integer buffers")
