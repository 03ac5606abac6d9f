"""The refusals of rank extras, sync states and stream states (the multi-rank paths are in
tests/streaming/test_stream_ranks.py and tests/sync/test_sync_state.py)."""

from __future__ import annotations

import anyio
import pytest
import torch

from lamploop.distributed.rank_extras import RankExtras, SyncState, _decode
from lamploop.errors import CheckpointError, ConfigurationError, DistributedError
from lamploop.streaming import FifoBuffer, StreamState
from lamploop.sync.all_reduce import AllReduceSync


def test_damaged_extras_from_a_follower_are_named() -> None:
    with pytest.raises(DistributedError, match="rank 1's checkpoint extras arrived damaged"):
        _decode(b"\x00\x00\x00\x05garbage", 1)


def test_a_resume_without_every_rank_s_sync_state_is_refused_before_any_collective() -> None:
    extras = RankExtras({}, rank=0, nranks=2, saved_sync={"sync": ({}, {})})
    state = SyncState(AllReduceSync.__new__(AllReduceSync))
    with pytest.raises(CheckpointError, match=r"no sync state 'sync.rank1' for rank 1"):
        extras.keep_sync_state(None, state)  # type: ignore[arg-type]  # refused before it is used


def test_a_sync_state_without_the_rank_s_optimizer_state_is_refused() -> None:
    class Stateless:
        def load_state_dict(self, state: object) -> None:
            """Nothing kept."""

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    state = SyncState(Stateless(), optimizer)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="no optimizer state for this rank"):
        state.load_state_dict({}, {})


def test_a_stream_state_refuses_a_meta_that_is_not_one_and_a_second_receiver() -> None:
    async def main() -> None:
        stream = StreamState(FifoBuffer(capacity=4, watermark=1, seed=0))
        with pytest.raises(CheckpointError, match="expected the keys buffer and producers_done"):
            stream.load_state_dict({}, {"last_seq": {}})
        stream.open_receiver(token="t" * 32, producers=["a"])
        with pytest.raises(ConfigurationError, match="open_receiver was called before"):
            stream.open_receiver(token="t" * 32, producers=["a"])

    anyio.run(main)


def test_the_root_refuses_to_hand_producers_to_a_rank_without_a_receiver() -> None:
    async def main() -> None:
        stream = StreamState(FifoBuffer(capacity=4, watermark=1, seed=0))
        async with stream.open_receiver(token="t" * 32, producers=["a", "b"], nranks=2) as receiver:
            with pytest.raises(ConfigurationError, match=r"ranks \[1\] opened no receiver"):
                stream.ranks_joined([list(receiver.address), None], 0)

    anyio.run(main)
