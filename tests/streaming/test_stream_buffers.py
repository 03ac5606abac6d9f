"""The streaming buffers (FIFO, FIRO, Reservoir): policies, limits, checkpoints, async waits.

The random policies are checked against a reference model written here from the documented
draw algorithm (its own numpy Generator with the same seed), over random operation sequences.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.streaming.buffers import (
    BufferClosedError,
    BufferStats,
    DuplicateSampleError,
    FifoBuffer,
    FiroBuffer,
    ReservoirBuffer,
    StreamBuffer,
    StreamEnded,
)
from lamploop.streaming.sample import Sample

POLICIES: dict[str, Callable[..., StreamBuffer]] = {
    "fifo": FifoBuffer,
    "firo": FiroBuffer,
    "reservoir": ReservoirBuffer,
}

Key = tuple[str, int]


def _sample(producer: str, seq: int) -> Sample:
    value = float(seq) + (0.5 if producer == "b" else 0.0)
    return Sample(producer, seq, {"x": torch.tensor([value, -value]), "y": torch.tensor(seq)})


def _make(
    policy: str, capacity: int, watermark: int, seed: int, max_reads: int | None, **callbacks: Any
) -> StreamBuffer:
    return POLICIES[policy](
        capacity=capacity, watermark=watermark, seed=seed, max_reads=max_reads, **callbacks
    )


class Reference:
    """The documented policies, written independently: a list of ``[key, seen]`` and a Generator."""

    def __init__(self, policy: str, capacity: int, watermark: int, seed: int, max_reads: int | None) -> None:
        self.policy, self.capacity, self.watermark, self.max_reads = policy, capacity, watermark, max_reads
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.items: list[list[Any]] = []
        self.received = self.read_total = 0
        self.evicted: list[tuple[Key, int]] = []
        self.closed = False

    def put(self, key: Key) -> bool:
        if len(self.items) == self.capacity:
            if self.policy != "reservoir":
                return False
            i = int(self.rng.integers(len(self.items)))
            self.evicted.append((self.items[i][0], self.items[i][1]))
            self.items[i] = [key, 0]
        else:
            self.items.append([key, 0])
        self.received += 1
        return True

    def get(self) -> Key | str | None:
        if not self.items:
            return "ended" if self.closed else None
        if self.received < self.watermark and not self.closed:
            return None
        self.read_total += 1
        if self.policy == "fifo":
            entry = self.items.pop(0)
            entry[1] += 1
            if entry[1] < self.max_reads:
                self.items.append(entry)
            key: Key = entry[0]
            return key
        i = int(self.rng.integers(len(self.items)))
        entry = self.items[i]
        entry[1] += 1
        done = (self.policy == "reservoir" and self.closed) or (
            self.max_reads is not None and entry[1] == self.max_reads
        )
        if done:
            self.items[i] = self.items[-1]
            self.items.pop()
        drawn: Key = entry[0]
        return drawn

    def seen(self) -> list[tuple[Key, int]]:
        return [(key, seen) for key, seen in self.items]


def _get(buffer: StreamBuffer) -> Key | str | None:
    try:
        sample = buffer.try_get()
    except StreamEnded:
        return "ended"
    if sample is None:
        return None
    _check_tensors(sample)
    return sample.key


def _check_tensors(sample: Sample) -> None:
    expected = _sample(sample.producer, sample.seq)
    assert set(sample.tensors) == {"x", "y"}
    for name, tensor in expected.tensors.items():
        assert torch.equal(sample.tensors[name], tensor)


def _round_trip(buffer: StreamBuffer, fresh: StreamBuffer) -> StreamBuffer:
    """``fresh`` restored from ``buffer``'s state as it would be on disk (safetensors bytes, JSON)."""
    tensors, meta = buffer.state_dict()
    data = safetensors.torch.save({name: t.contiguous() for name, t in tensors.items()})
    fresh.load_state_dict(safetensors.torch.load(data), json.loads(json.dumps(meta)))
    return fresh


# --------------------------------------------------------------------------------------------
# Random operation sequences against the reference model


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        capacity=st.integers(1, 6),
        data=st.data(),
    )
    def setup(self, policy: str, capacity: int, data: st.DataObject) -> None:
        watermark = data.draw(st.integers(1, capacity), label="watermark")
        seed = data.draw(st.integers(0, 2**64 - 1), label="seed")
        reads = st.integers(1, 3) | st.none() if policy == "reservoir" else st.integers(1, 3)
        max_reads = data.draw(reads, label="max_reads")
        self.config = (policy, capacity, watermark, seed, max_reads)
        self.reads: Counter[Key] = Counter()
        self.evicted: list[tuple[Key, int]] = []
        self.buffer = self._new()
        self.model = Reference(*self.config)
        self.next_seq = {"a": 0, "b": 0}
        self.put_keys: list[Key] = []

    def _new(self) -> StreamBuffer:
        return _make(
            *self.config,
            on_read=lambda key, seen: self._on_read(key, seen),
            on_evict=lambda key, seen: self.evicted.append((key, seen)),
        )

    def _on_read(self, key: Key, seen: int) -> None:
        self.reads[key] += 1
        assert seen == self.reads[key]  # a key never comes back (seqs only grow): its own count

    @rule(producer=st.sampled_from("ab"), gap=st.integers(0, 2))
    def put(self, producer: str, gap: int) -> None:
        seq = self.next_seq[producer] + gap
        if self.model.closed:
            with pytest.raises(BufferClosedError, match="after close"):
                self.buffer.try_put(_sample(producer, seq))
            return
        taken = self.buffer.try_put(_sample(producer, seq))
        assert taken == self.model.put((producer, seq))
        if taken:
            self.next_seq[producer] = seq + 1
            self.put_keys.append((producer, seq))

    @precondition(lambda self: not self.model.closed and any(self.next_seq.values()))
    @rule(data=st.data())
    def put_duplicate(self, data: st.DataObject) -> None:
        producer = data.draw(st.sampled_from([p for p, n in self.next_seq.items() if n > 0]))
        seq = data.draw(st.integers(0, self.next_seq[producer] - 1))
        with pytest.raises(DuplicateSampleError, match=f"seq {seq} is not after"):
            self.buffer.try_put(_sample(producer, seq))

    @rule()
    def get(self) -> None:
        assert _get(self.buffer) == self.model.get()

    @rule(times=st.integers(1, 4))
    def get_several(self, times: int) -> None:
        for _ in range(times):
            self.get()

    @rule(chance=st.integers(0, 5))
    def close(self, chance: int) -> None:
        if chance == 0:
            self.buffer.close()
            self.model.closed = True

    @rule()
    def checkpoint(self) -> None:
        before = self.buffer.seen_counts()
        self.buffer = _round_trip(self.buffer, self._new())
        assert list(self.buffer.seen_counts().items()) == list(before.items())

    @invariant()
    def agrees_with_the_reference(self) -> None:
        assert list(self.buffer.seen_counts().items()) == self.model.seen()
        assert self.buffer.stats() == BufferStats(
            policy=self.config[0],
            capacity=self.config[1],
            fill=len(self.model.items),
            received=self.model.received,
            read_total=self.model.read_total,
            evicted=len(self.model.evicted),
            closed=self.model.closed,
        )
        assert self.evicted == self.model.evicted

    @invariant()
    def limits_hold(self) -> None:
        policy, capacity, _, _, max_reads = self.config
        seen = self.buffer.seen_counts()
        assert self.buffer.fill == len(seen) <= capacity
        assert self.buffer.received == len(self.put_keys)
        assert self.buffer.read_total == sum(self.reads.values())
        if max_reads is not None:
            assert all(n < max_reads for n in seen.values())
            assert all(n <= max_reads for n in self.reads.values())
        for key, n in seen.items():
            assert self.reads[key] == n
        assert self.buffer.seen_histogram() == dict(sorted(Counter(seen.values()).items()))
        if policy != "reservoir":
            assert self.buffer.evicted == 0
            # Every sample put is resident or was read max_reads times.
            gone = [key for key in self.put_keys if key not in seen]
            assert all(self.reads[key] == max_reads for key in gone)

    def teardown(self) -> None:
        if not hasattr(self, "buffer"):
            return
        self.buffer.close()
        self.model.closed = True
        while (got := _get(self.buffer)) != "ended":
            assert got == self.model.get()
        assert self.model.get() == "ended"
        policy, _, _, _, max_reads = self.config
        if policy == "reservoir":
            evicted = {key for key, _ in self.evicted}
            assert all(self.reads[key] >= 1 or key in evicted for key in self.put_keys)
        else:
            assert all(self.reads[key] == max_reads for key in self.put_keys)


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=70, stateful_step_count=30, deadline=None)


# --------------------------------------------------------------------------------------------
# Orders and draws


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.sampled_from(["a", "b", "get"]), max_size=40), capacity=st.integers(1, 5))
def test_fifo_reads_come_in_arrival_order(ops: list[str], capacity: int) -> None:
    buffer = FifoBuffer(capacity=capacity, watermark=1)
    seqs = {"a": 0, "b": 0}
    arrived: list[Key] = []
    read: list[Key] = []
    for op in ops:
        if op == "get":
            sample = buffer.try_get()
            if sample is not None:
                read.append(sample.key)
        elif buffer.try_put(_sample(op, seqs[op])):
            arrived.append((op, seqs[op]))
            seqs[op] += 1
    buffer.close()
    while not buffer.ended:
        read.append(buffer.try_get().key)  # type: ignore[union-attr]
    assert read == arrived


def test_fifo_max_reads_requeues_at_the_tail() -> None:
    buffer = FifoBuffer(capacity=3, watermark=1, max_reads=2)
    for seq in range(2):
        buffer.try_put(_sample("a", seq))
    assert buffer.try_get().key == ("a", 0)  # type: ignore[union-attr]
    buffer.try_put(_sample("a", 2))  # arrives behind the re-queued a0
    assert list(buffer.seen_counts().items()) == [(("a", 1), 0), (("a", 0), 1), (("a", 2), 0)]
    buffer.close()
    order = []
    while not buffer.ended:
        order.append(buffer.try_get().seq)  # type: ignore[union-attr]
    assert order == [1, 0, 2, 1, 2]


def test_firo_draws_follow_the_documented_algorithm() -> None:
    """Spelled out once without the reference model: index = rng.integers(len), swap-remove."""
    buffer = FiroBuffer(capacity=5, watermark=5, seed=1234)
    for seq in range(5):
        buffer.try_put(_sample("a", seq))
    rng = np.random.Generator(np.random.PCG64(1234))
    resident = [0, 1, 2, 3, 4]
    expected = []
    while resident:
        i = int(rng.integers(len(resident)))
        expected.append(resident[i])
        resident[i] = resident[-1]
        resident.pop()
    assert [buffer.try_get().seq for _ in range(5)] == expected  # type: ignore[union-attr]
    assert sorted(expected) == [0, 1, 2, 3, 4]


def test_reservoir_evicts_a_random_resident_and_producers_never_wait() -> None:
    evicted: list[tuple[Key, int]] = []
    buffer = ReservoirBuffer(capacity=3, watermark=1, seed=7, on_evict=lambda k, s: evicted.append((k, s)))
    for seq in range(3):
        assert buffer.try_put(_sample("a", seq))
    rng = np.random.Generator(np.random.PCG64(7))
    resident = [0, 1, 2]
    for seq in range(3, 50):
        assert buffer.try_put(_sample("a", seq))
        i = int(rng.integers(3))
        assert evicted[-1] == (("a", resident[i]), 0)
        resident[i] = seq
    assert [key[1] for key in buffer.seen_counts()] == resident
    assert buffer.evicted == 47
    # Reads do not remove (max_reads=None): many reads, the same residents.
    for _ in range(20):
        assert buffer.try_get() is not None
    assert [key[1] for key in buffer.seen_counts()] == resident
    assert sum(buffer.seen_counts().values()) == 20


def test_draws_touch_no_global_generator() -> None:
    np.random.seed(5)
    torch.manual_seed(5)
    state, torch_state = np.random.get_state(legacy=True), torch.get_rng_state()
    buffer = ReservoirBuffer(capacity=2, watermark=1, seed=0)
    for seq in range(10):
        buffer.try_put(_sample("a", seq))
        buffer.try_get()
    assert np.random.get_state(legacy=True)[1].tolist() == state[1].tolist()  # type: ignore[index]
    assert torch.equal(torch.get_rng_state(), torch_state)


# --------------------------------------------------------------------------------------------
# Checkpoints

_OPS = st.lists(st.sampled_from(["a", "b", "get", "get"]), max_size=30)


def _run(buffer: StreamBuffer, ops: list[str], seqs: dict[str, int]) -> list[Any]:
    out: list[Any] = []
    for op in ops:
        if op == "get":
            out.append(_get(buffer))
        else:
            taken = buffer.try_put(_sample(op, seqs[op]))
            seqs[op] += taken
            out.append(taken)
    return out


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 2**32),
    max_reads=st.integers(1, 3),
    before=_OPS,
    after=_OPS,
    close_at_checkpoint=st.booleans(),
)
def test_a_restored_buffer_continues_like_the_uninterrupted_one(
    policy: str, seed: int, max_reads: int, before: list[str], after: list[str], close_at_checkpoint: bool
) -> None:
    config = (policy, 4, 2, seed, max_reads)
    whole, cut = _make(*config), _make(*config)
    seqs_whole, seqs_cut = {"a": 0, "b": 0}, {"a": 0, "b": 0}
    assert _run(whole, before, seqs_whole) == _run(cut, before, seqs_cut)
    if close_at_checkpoint:
        whole.close()
        cut.close()
    restored = _round_trip(cut, _make(*config))
    for name in ("fill", "received", "read_total", "evicted", "closed"):
        assert getattr(restored, name) == getattr(whole, name)
    if close_at_checkpoint:
        after = [op for op in after if op == "get"]
    assert _run(restored, after, seqs_cut) == _run(whole, after, seqs_whole)
    assert list(restored.seen_counts().items()) == list(whole.seen_counts().items())
    assert restored.stats() == whole.stats()
    # The generators are in the same state, and duplicates are still refused.
    assert restored.state_dict()[1]["rng"] == whole.state_dict()[1]["rng"]
    if seqs_cut["a"] and not close_at_checkpoint:
        with pytest.raises(DuplicateSampleError):
            restored.try_put(_sample("a", seqs_cut["a"] - 1))


def test_state_dict_names_and_meta() -> None:
    buffer = FifoBuffer(capacity=3, watermark=1, max_reads=2)
    buffer.try_put(_sample("a", 0))
    buffer.try_put(Sample("b", 4, {"x.weird name": torch.zeros(2)}))
    buffer.try_get()
    tensors, meta = buffer.state_dict()
    assert sorted(tensors) == ["s0.x.weird name", "s1.x", "s1.y"]  # b4 first: a0 went back in behind it
    assert meta["samples"] == [
        {"producer": "b", "seq": 4, "seen": 0, "tensors": ["x.weird name"]},
        {"producer": "a", "seq": 0, "seen": 1, "tensors": ["x", "y"]},
    ]
    assert meta["last_seq"] == buffer.last_seqs() == {"a": 0, "b": 4}
    assert json.loads(json.dumps(meta)) == meta
    restored = _round_trip(buffer, FifoBuffer(capacity=3, watermark=1, max_reads=2))
    assert torch.equal(restored.try_get().tensors["x.weird name"], torch.zeros(2))  # type: ignore[union-attr]


def _edit(meta: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**json.loads(json.dumps(meta)), **changes}


def test_load_state_dict_refuses_other_buffers_and_malformed_states() -> None:
    buffer = FiroBuffer(capacity=3, watermark=2, seed=0, max_reads=2)
    buffer.try_put(_sample("a", 0))
    tensors, meta = buffer.state_dict()
    fresh = FiroBuffer(capacity=3, watermark=2, seed=0, max_reads=2)
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (FifoBuffer(capacity=3, watermark=2, max_reads=2), meta, "policy='firo'"),
        (FiroBuffer(capacity=4, watermark=2, seed=0, max_reads=2), meta, "capacity=3"),
        (FiroBuffer(capacity=3, watermark=2, seed=0), meta, "max_reads=2"),
        (fresh, _edit(meta, format="other/9"), "format 'other/9'"),
        (fresh, _edit(meta, received=-1), "received is -1"),
        (fresh, {k: v for k, v in meta.items() if k != "rng"}, "malformed buffer state"),
        (fresh, _edit(meta, samples=[{**meta["samples"][0], "seen": 2}]), "read 2 times, max_reads=2"),
    ]
    for target, bad_meta, message in cases:
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
            target.load_state_dict(tensors, bad_meta)
    with pytest.raises(CheckpointError, match=r"tensors \['s0.y'\] are missing"):
        fresh.load_state_dict({"s0.x": tensors["s0.x"]}, meta)
    with pytest.raises(CheckpointError, match="unexpected tensors"):
        fresh.load_state_dict({**tensors, "s9.x": torch.zeros(1)}, meta)
    assert fresh.fill == 0  # a refused state changes nothing


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ("fifo", {"capacity": 0, "watermark": 1}, "capacity must be an int >= 1, got 0"),
        ("firo", {"capacity": 2.0, "watermark": 1}, "capacity must be an int >= 1, got 2.0"),
        ("fifo", {"capacity": 2, "watermark": 0}, "watermark must be an int >= 1, got 0"),
        ("reservoir", {"capacity": 2, "watermark": 3}, "watermark=3 is above capacity=2"),
        ("firo", {"capacity": 2, "watermark": 1, "seed": -1}, "seed must be an int >= 0, got -1"),
        ("fifo", {"capacity": 2, "watermark": 1, "max_reads": 0}, "max_reads must be an int >= 1, got 0"),
        (
            "fifo",
            {"capacity": 2, "watermark": 1, "max_reads": True},
            "max_reads must be an int >= 1, got True",
        ),
        ("firo", {"capacity": 2, "watermark": 1, "max_reads": None}, "max_reads=None .* only for Reservoir"),
    ],
)
def test_bad_arguments_name_the_argument(policy: str, kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("seed", 0)
    with pytest.raises(ConfigurationError, match=message):
        POLICIES[policy](**kwargs)


def test_duplicates_and_puts_after_close_are_refused() -> None:
    buffer = FiroBuffer(capacity=4, watermark=1, seed=0)
    buffer.try_put(_sample("a", 3))
    with pytest.raises(DuplicateSampleError, match=r"\('a', 3\) refused: seq 3 is not after 3"):
        buffer.try_put(_sample("a", 3))
    with pytest.raises(DuplicateSampleError, match="seq 1 is not after 3"):
        buffer.try_put(_sample("a", 1))
    assert buffer.try_put(_sample("b", 1))  # another producer's seqs are its own
    assert buffer.try_put(_sample("a", 7))  # gaps are fine
    buffer.close()
    with pytest.raises(BufferClosedError, match=r"\('a', 8\) put after close"):
        buffer.try_put(_sample("a", 8))
    assert buffer.received == 3


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 2**32),
    capacity=st.integers(1, 6),
    steps=st.lists(st.one_of(st.integers(1, 8), st.just(0)), max_size=12),  # 0: a get, n: n puts
)
def test_try_put_many_is_try_put_on_each_until_one_does_not_fit(
    policy: str, seed: int, capacity: int, steps: list[int]
) -> None:
    """The same prefix taken, the same evictions, draws, counters and state as single puts."""
    evicted_many: list[tuple[Key, int]] = []
    evicted_one: list[tuple[Key, int]] = []
    many = _make(policy, capacity, 1, seed, 2, on_evict=lambda k, s: evicted_many.append((k, s)))
    one = _make(policy, capacity, 1, seed, 2, on_evict=lambda k, s: evicted_one.append((k, s)))
    seq = 0
    for step in steps:
        if step == 0:
            got_many, got_one = many.try_get(), one.try_get()
            assert (got_many and got_many.key) == (got_one and got_one.key)
            continue
        batch = [_sample("ab"[i % 2], seq + i) for i in range(step)]
        taken = many.try_put_many(batch)
        singles = 0
        while singles < step and one.try_put(batch[singles]):
            singles += 1
        assert taken == singles
        seq += taken
    assert evicted_many == evicted_one
    assert many.stats() == one.stats()
    assert list(many.seen_counts().items()) == list(one.seen_counts().items())
    assert many.state_dict()[1] == one.state_dict()[1]


def test_try_put_many_checks_every_sample_before_taking_any() -> None:
    buffer = FifoBuffer(capacity=4, watermark=1)
    buffer.try_put(_sample("a", 3))
    with pytest.raises(DuplicateSampleError, match="seq 2 is not after 3"):
        buffer.try_put_many([_sample("b", 0), _sample("a", 2)])
    with pytest.raises(DuplicateSampleError, match="seq 5 is not after 5, the last one put or listed"):
        buffer.try_put_many([_sample("a", 5), _sample("a", 5)])
    assert buffer.received == 1  # nothing taken from either batch
    assert buffer.try_put_many([]) == 0
    assert buffer.try_put_many([_sample("a", 4), _sample("b", 0), _sample("a", 9), _sample("a", 10)]) == 3
    buffer.close()
    with pytest.raises(BufferClosedError, match=r"\('a', 11\) put after close"):
        buffer.try_put_many([_sample("a", 11)])


async def _no_batch(buffer: StreamBuffer, n: int) -> None:
    await buffer.get_batch(n)


def test_get_batch_refuses_sizes_it_can_never_fill() -> None:
    buffer = FifoBuffer(capacity=3, watermark=1)
    with pytest.raises(ConfigurationError, match=r"get_batch\(n=4\) can never be filled, capacity=3"):
        anyio.run(_no_batch, buffer, 4)
    with pytest.raises(ConfigurationError, match="n must be an int >= 1, got 0"):
        anyio.run(_no_batch, buffer, 0)


# --------------------------------------------------------------------------------------------
# Async: waits, back-pressure, close, cancellation


@pytest.mark.anyio
async def test_a_put_into_a_full_fifo_waits_for_a_get() -> None:
    buffer = FifoBuffer(capacity=2, watermark=1)
    done: list[Key] = []

    async def producer() -> None:
        for seq in range(3):
            await buffer.put(_sample("a", seq))
            done.append(("a", seq))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await anyio.wait_all_tasks_blocked()
            assert done == [("a", 0), ("a", 1)]  # the third put waits
            assert buffer.fill == 2
            assert (await buffer.get()).key == ("a", 0)
    assert done == [("a", 0), ("a", 1), ("a", 2)]
    assert list(buffer.seen_counts()) == [("a", 1), ("a", 2)]


@pytest.mark.anyio
async def test_a_get_waits_for_the_watermark() -> None:
    buffer = FiroBuffer(capacity=4, watermark=3, seed=0)
    got: list[Sample] = []

    async def reader() -> None:
        got.append(await buffer.get())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            for seq in range(2):
                await buffer.put(_sample("a", seq))
                await anyio.wait_all_tasks_blocked()
                assert got == []
            await buffer.put(_sample("a", 2))
    assert len(got) == 1
    assert buffer.fill == 2


@pytest.mark.anyio
async def test_close_before_the_watermark_lets_readers_drain() -> None:
    buffer = FifoBuffer(capacity=4, watermark=4)
    await buffer.put(_sample("a", 0))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            got: list[Key] = []

            async def reader() -> None:
                got.extend([s.key async for s in buffer])

            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            buffer.close()
    assert got == [("a", 0)]
    with pytest.raises(StreamEnded, match="closed and drained"):
        await buffer.get()


@pytest.mark.anyio
@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_producers_and_readers_together_account_for_every_sample(policy: str) -> None:
    reads: Counter[Key] = Counter()
    max_reads = 2
    evicted: list[Key] = []
    buffer = _make(
        policy,
        3,
        2,
        11,
        max_reads,
        on_read=lambda key, seen: reads.update([key]),
        on_evict=lambda key, seen: evicted.append(key),
    )
    taken: list[Key] = []

    async def producer(name: str) -> None:
        for seq in range(20):
            await buffer.put(_sample(name, seq))
            if seq % 3 == 0:
                await anyio.lowlevel.checkpoint()

    async def reader() -> None:
        while True:
            try:
                batch = await buffer.get_batch(2)
            except StreamEnded:
                return
            assert 1 <= len(batch) <= 2
            for sample in batch:
                _check_tensors(sample)
            taken.extend(s.key for s in batch)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(reader)
            async with anyio.create_task_group() as producers:
                producers.start_soon(producer, "a")
                producers.start_soon(producer, "b")
            buffer.close()
    everything = {(p, s) for p in "ab" for s in range(20)}
    assert Counter(taken) == reads
    assert buffer.received == 40
    if policy == "reservoir":
        assert set(reads) | set(evicted) == everything
        assert all(n <= max_reads for n in reads.values())
    else:
        assert reads == dict.fromkeys(everything, max_reads)


@pytest.mark.anyio
async def test_a_cancelled_waiting_get_loses_nothing() -> None:
    buffer = FifoBuffer(capacity=2, watermark=1)
    with anyio.fail_after(5):
        with anyio.move_on_after(0.05) as scope:
            await buffer.get()
        assert scope.cancelled_caught
        await buffer.put(_sample("a", 0))
        assert (await buffer.get()).key == ("a", 0)


async def _cancellable_read(
    buffer: StreamBuffer, scope: anyio.CancelScope, batch: bool, got: list[Sample]
) -> None:
    with scope:
        if batch:
            got.extend(await buffer.get_batch(1))
        else:
            got.append(await buffer.get())


@pytest.mark.anyio
@pytest.mark.parametrize("batch", [False, True])
async def test_a_get_cancelled_as_a_sample_arrives_loses_nothing(batch: bool) -> None:
    buffer = FiroBuffer(capacity=2, watermark=1, seed=0)
    got: list[Sample] = []
    scope = anyio.CancelScope()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancellable_read, buffer, scope, batch, got)
            await anyio.wait_all_tasks_blocked()
            assert buffer.try_put(_sample("a", 0))  # wakes the reader...
            scope.cancel()  # ...which is cancelled before it runs
    # Either the reader took it (and has it) or it was cancelled and the sample is still there.
    if got:
        assert [s.key for s in got] == [("a", 0)]
        assert buffer.fill == 0
        assert buffer.read_total == 1
    else:
        assert scope.cancelled_caught
        assert list(buffer.seen_counts().items()) == [(("a", 0), 0)]
        assert buffer.read_total == 0


@pytest.mark.anyio
async def test_a_cancelled_put_puts_nothing_and_close_wakes_waiting_puts() -> None:
    buffer = FiroBuffer(capacity=1, watermark=1, seed=0)
    await buffer.put(_sample("a", 0))
    with anyio.fail_after(5):
        with anyio.move_on_after(0.05):
            await buffer.put(_sample("a", 1))
        assert buffer.received == 1
        assert list(buffer.seen_counts()) == [("a", 0)]
        failures: list[BaseException] = []

        async def producer() -> None:
            try:
                await buffer.put(_sample("a", 1))
            except BufferClosedError as e:
                failures.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await anyio.wait_all_tasks_blocked()
            buffer.close()
    assert len(failures) == 1
    assert [s.key async for s in buffer] == [("a", 0)]


@pytest.mark.anyio
async def test_get_batch_waits_for_n_samples_then_takes_them_at_once() -> None:
    buffer = FifoBuffer(capacity=4, watermark=1)
    got: list[list[Key]] = []

    async def reader() -> None:
        got.append([s.key for s in await buffer.get_batch(3)])

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            for seq in range(2):
                await buffer.put(_sample("a", seq))
            await anyio.wait_all_tasks_blocked()
            assert got == []
            await buffer.put(_sample("a", 2))
        await buffer.put(_sample("a", 3))
        buffer.close()
        assert [s.key for s in await buffer.get_batch(3)] == [("a", 3)]  # what is left after close
        with pytest.raises(StreamEnded):
            await buffer.get_batch(3)
    assert got == [[("a", 0), ("a", 1), ("a", 2)]]


@settings(max_examples=120, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 2**32),
    capacity=st.integers(1, 6),
    max_reads=st.sampled_from([1, 2, 3, None]),
    watermark=st.integers(1, 6),
    steps=st.lists(st.tuples(st.sampled_from(["put", "get", "close"]), st.integers(1, 8)), max_size=16),
)
def test_runs_of_puts_and_batches_of_reads_are_the_documented_single_steps(
    policy: str, seed: int, capacity: int, max_reads: int | None, watermark: int, steps: list[tuple[str, int]]
) -> None:
    """``try_put_many`` and ``get_batch`` without callbacks take the runs' fast paths (a frame's
    samples appended at once, a batch taken off a FIFO's front at once): the same samples in the
    same order, the same draws, evictions, counters and state as the reference's single steps."""
    if max_reads is None and policy != "reservoir":
        max_reads = 1
    watermark = min(watermark, capacity)
    buffer = _make(policy, capacity, watermark, seed, max_reads)
    reference = Reference(policy, capacity, watermark, seed, max_reads)
    seq = 0
    for op, n in steps:
        if op == "put":
            batch = [_sample("ab"[i % 2], seq + i) for i in range(n)]
            if buffer.closed:
                with pytest.raises(BufferClosedError):
                    buffer.try_put_many(batch)
                continue
            taken = buffer.try_put_many(batch)
            expected = 0
            while expected < n and reference.put(batch[expected].key):
                expected += 1
            assert taken == expected
            seq += taken
        elif op == "close":
            buffer.close()
            reference.closed = True
        else:
            n = min(n, capacity)
            readable = reference.items and (reference.received >= watermark or reference.closed)
            if not readable or (len(reference.items) < n and not reference.closed):
                continue  # get_batch would wait
            got = anyio.run(buffer.get_batch, n)
            want = []
            while len(want) < n and (key := reference.get()) not in (None, "ended"):
                want.append(key)
            assert [s.key for s in got] == want
            for sample in got:
                _check_tensors(sample)
        assert buffer.fill == len(reference.items)
        assert list(buffer.seen_counts().items()) == reference.seen()
        assert (buffer.received, buffer.read_total, buffer.evicted) == (
            reference.received,
            reference.read_total,
            len(reference.evicted),
        )
    # The generators are in the same state: the next draw is the same.
    assert int(buffer._rng.integers(1 << 30)) == int(reference.rng.integers(1 << 30))
