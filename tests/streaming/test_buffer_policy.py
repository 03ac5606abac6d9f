"""Buffer policies on their own (plain slots, a twin generator, no buffer), and ``StreamBuffer(policy=...)``.

A policy's four decisions (full, insert, pick, leaves) are checked here against the draws the
module docstring of :mod:`lamploop.streaming.buffer_policy` spells out; the buffers built on
them are checked against an independent reference model in ``test_stream_buffers.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import MutableSequence
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lamploop.errors import ConfigurationError, StreamEnded
from lamploop.streaming.buffer_policy import FifoPolicy, FiroPolicy, Policy, ReservoirPolicy, Slot
from lamploop.streaming.buffers import FifoBuffer, FiroBuffer, ReservoirBuffer, StreamBuffer
from lamploop.streaming.sample import Sample


def _slot(seq: int, seen: int = 0) -> Slot:
    return Slot(Sample("a", seq, {"x": torch.tensor([float(seq)])}), seen)


def _seqs(slots: MutableSequence[Slot]) -> list[int]:
    return [slot.sample.seq for slot in slots]


def _rng(seed: int = 5) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


# --------------------------------------------------------------------------------------------
# The four decisions, policy by policy


def test_fifo_policy_reads_the_front_and_requeues_at_the_tail() -> None:
    policy = FifoPolicy()
    slots = policy.storage([_slot(0), _slot(1)])
    assert isinstance(slots, deque)
    assert (policy.name, policy.draws, policy.default_max_reads, policy.unlimited_reads) == (
        "fifo",
        False,
        1,
        False,
    )
    assert not policy.full(1, 2)
    assert policy.full(2, 2)
    rng = _rng()
    before = rng.bit_generator.state
    assert policy.insert(slots, _slot(2), 3, rng) is None
    assert policy.pick(slots, rng) == 0
    assert rng.bit_generator.state == before  # FIFO draws nothing
    policy.after_read(slots, 0, left=False)  # s0 stays: back in behind s2
    assert _seqs(slots) == [1, 2, 0]
    policy.after_read(slots, 0, left=True)  # s1 leaves
    assert _seqs(slots) == [2, 0]
    assert policy.leaves(2, 2, closed=False)
    assert not policy.leaves(1, 2, closed=True)


def test_firo_policy_draws_an_index_and_swap_removes_a_sample_that_leaves() -> None:
    policy, twin = FiroPolicy(), _rng()
    rng = _rng()
    slots = policy.storage([_slot(seq) for seq in range(5)])
    assert isinstance(slots, list)
    assert (policy.name, policy.draws, policy.default_max_reads, policy.unlimited_reads) == (
        "firo",
        True,
        1,
        False,
    )
    assert not policy.full(4, 5)
    assert policy.full(5, 5)
    assert policy.insert(slots, _slot(5), 7, rng) is None
    assert _seqs(slots) == [0, 1, 2, 3, 4, 5]
    for _ in range(10):
        assert policy.pick(slots, rng) == int(twin.integers(len(slots)))
    policy.after_read(slots, 1, left=False)  # stays in its slot
    assert _seqs(slots) == [0, 1, 2, 3, 4, 5]
    policy.after_read(slots, 1, left=True)  # the last slot's sample takes slot 1
    assert _seqs(slots) == [0, 5, 2, 3, 4]
    policy.after_read(slots, 4, left=True)  # the last slot itself: just removed
    assert _seqs(slots) == [0, 5, 2, 3]
    assert policy.leaves(1, 1, closed=True)
    assert not policy.leaves(1, 2, closed=True)


def test_reservoir_policy_never_waits_and_evicts_a_drawn_resident() -> None:
    policy, twin = ReservoirPolicy(), _rng(9)
    rng = _rng(9)
    assert (policy.name, policy.draws, policy.default_max_reads, policy.unlimited_reads) == (
        "reservoir",
        True,
        None,
        True,
    )
    assert not policy.full(10**6, 1)
    slots = policy.storage()
    for seq in range(3):
        assert policy.insert(slots, _slot(seq, seen=seq), 3, rng) is None  # room: appended, no draw
    assert rng.bit_generator.state == twin.bit_generator.state
    i = int(twin.integers(3))
    evicted = policy.insert(slots, _slot(3), 3, rng)
    assert evicted is not None
    assert (evicted.sample.seq, evicted.seen) == (i, i)
    assert _seqs(slots)[i] == 3
    assert len(slots) == 3
    assert not policy.leaves(5, None, closed=False)  # unlimited reads: stays
    assert policy.leaves(1, None, closed=True)  # a closed reservoir drains: every read leaves
    assert policy.leaves(2, 2, closed=False)


def test_policies_compare_by_kind() -> None:
    assert FifoPolicy() == FifoPolicy()
    assert hash(FifoPolicy()) == hash(FifoPolicy())
    assert FifoPolicy() != FiroPolicy()
    assert FiroPolicy() != ReservoirPolicy()
    assert repr(ReservoirPolicy()) == "ReservoirPolicy()"
    with pytest.raises(TypeError):
        Policy()  # type: ignore[abstract]


# --------------------------------------------------------------------------------------------
# StreamBuffer(policy=...): the named buffers are it, declared once


def test_the_named_buffers_only_pick_a_policy() -> None:
    for kind, policy in (
        (FifoBuffer, FifoPolicy()),
        (FiroBuffer, FiroPolicy()),
        (ReservoirBuffer, ReservoirPolicy()),
    ):
        assert "__init__" not in vars(kind)  # one constructor, StreamBuffer's
        assert kind.fixed_policy == policy
        assert kind(capacity=2, watermark=1, seed=0).policy == policy
    assert FifoBuffer(capacity=2, watermark=1).max_reads == 1  # FIFO: seed 0, max_reads 1 by default
    assert FiroBuffer(capacity=2, watermark=1, seed=3).max_reads == 1
    assert ReservoirBuffer(capacity=2, watermark=1, seed=3).max_reads is None
    assert StreamBuffer(capacity=2, watermark=1, seed=3, policy=ReservoirPolicy()).max_reads is None
    assert StreamBuffer(capacity=2, watermark=1, policy=FifoPolicy(), max_reads=3).max_reads == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StreamBuffer(capacity=2, watermark=1), r"StreamBuffer: policy= is required"),
        (
            lambda: FifoBuffer(capacity=2, watermark=1, policy=FiroPolicy()),
            r"FifoBuffer: policy=FiroPolicy\(\), but a FifoBuffer's is FifoPolicy\(\)",
        ),
        (
            lambda: StreamBuffer(capacity=2, watermark=1, policy="fifo"),  # type: ignore[arg-type]
            "policy must be a .*Policy, got 'fifo'",
        ),
        (lambda: FiroBuffer(capacity=2, watermark=1), "FiroBuffer: seed is required: the firo policy draws"),
        (
            lambda: StreamBuffer(capacity=2, watermark=1, policy=ReservoirPolicy()),
            "StreamBuffer: seed is required: the reservoir policy draws",
        ),
        (
            lambda: StreamBuffer(capacity=2, watermark=1, policy=FifoPolicy(), max_reads=None),
            "StreamBuffer: max_reads=None .* only for ReservoirBuffer",
        ),
    ],
)
def test_a_buffer_without_a_fitting_policy_or_seed_is_refused(make: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()  # type: ignore[operator]


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["fifo", "firo", "reservoir"]),
    seed=st.integers(0, 2**32),
    ops=st.lists(st.sampled_from(["put", "get"]), max_size=40),
)
def test_a_named_buffer_and_a_stream_buffer_with_its_policy_draw_alike(
    kind: str, seed: int, ops: list[str]
) -> None:
    named = {"fifo": FifoBuffer, "firo": FiroBuffer, "reservoir": ReservoirBuffer}[kind]
    a = named(capacity=3, watermark=2, seed=seed, max_reads=2)
    b = StreamBuffer(capacity=3, watermark=2, seed=seed, max_reads=2, policy=named.fixed_policy)
    for seq, op in enumerate(ops):
        if op == "put":
            assert a.try_put(_slot(seq).sample) == b.try_put(_slot(seq).sample)
        else:
            got_a, got_b = a.try_get(), b.try_get()
            assert (got_a and got_a.key) == (got_b and got_b.key)
    assert a.stats() == b.stats()
    assert a.state_dict()[1] == b.state_dict()[1]  # the same state: one restores into the other
    b.load_state_dict(*a.state_dict())


class _NewestFirst(Policy):
    """A policy of a user's own: last in, first out; a put into a full buffer waits (the default)."""

    name: ClassVar[str] = "newest-first"
    draws: ClassVar[bool] = False

    def pick(self, slots: MutableSequence[Slot], rng: np.random.Generator) -> int:
        return len(slots) - 1

    def after_read(self, slots: MutableSequence[Slot], index: int, left: bool) -> None:
        if left:
            del slots[index]


def test_a_policy_of_ones_own_gets_the_buffers_limits_waits_and_checkpoints() -> None:
    buffer = StreamBuffer(capacity=3, watermark=2, max_reads=2, policy=_NewestFirst())
    assert buffer.try_put(_slot(0).sample)
    assert buffer.try_get() is None  # the watermark applies
    for seq in (1, 2):
        assert buffer.try_put(_slot(seq).sample)
    assert not buffer.try_put(_slot(3).sample)  # full: the policy says wait
    tensors, meta = buffer.state_dict()
    assert meta["policy"] == "newest-first"
    restored = StreamBuffer(capacity=3, watermark=2, max_reads=2, policy=_NewestFirst())
    restored.load_state_dict(tensors, meta)
    buffer.close()
    restored.close()
    order = [buffer.try_get().seq for _ in range(6)]  # type: ignore[union-attr]
    assert order == [2, 2, 1, 1, 0, 0]  # max_reads applies
    assert [restored.try_get().seq for _ in range(6)] == order  # type: ignore[union-attr]
    with pytest.raises(StreamEnded):
        buffer.try_get()
