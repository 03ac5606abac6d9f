"""What a stop-aware batch stream costs per batch (``lamploop.loop.stop_aware``).

Usage::

    python benchmarks/bench_stop_aware.py [--batches 20000] [--rounds 7] [--json PATH] [--quick]

``fit`` and the replicas wrap every async batch stream but lamploop's in-memory ones, so that a
stop request ends a wait for data (DESIGN.md section 8).  This times iterating ``--batches``
batches that are ready at once (an async generator yielding a constant: no data, no model), so
what is left is the wrapper's own cost:

* ``bare``: the async generator itself, unwrapped (what ``tensor_batches`` costs);
* ``own, watched``: a ``StopAwareOwnStream`` inside ``watching()``, as the passes iterate it
  (one watcher task per pass, a cancel scope per batch);
* ``ending, watched``: the same for a ``StopAwareStream`` (an ``EndingBatchStream``);
* ``ending, alone``: a ``StopAwareStream`` iterated outside ``watching()``: a task per batch,
  which is what every wrapped batch cost before the passes watched their streams.

Each round times every contender once, in a rotating order, after a full collection; the
table gives the median per batch over rounds with its range, and each wrapper's extra cost
over ``bare`` (per batch, the round's own ``bare`` subtracted).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_parser, print_table, write_json

from lamploop.loop.stop_aware import StopAwareOwnStream, StopAwareStream, watching


class _NeverSet:
    def is_set(self) -> bool:
        return False


async def _ready(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


class _Ending:
    """An ``EndingBatchStream`` over ``_ready``."""

    source_ended = False

    def __init__(self, n: int) -> None:
        self.n = n

    def __aiter__(self) -> AsyncIterator[int]:
        return _ready(self.n)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def _bare(n: int) -> None:
    await _drain(_ready(n))


async def _own_watched(n: int) -> None:
    stream = StopAwareOwnStream(_ready(n), _NeverSet())
    async with watching(stream):
        await _drain(stream)


async def _ending_watched(n: int) -> None:
    stream = StopAwareStream(_Ending(n), _NeverSet())
    async with watching(stream):
        await _drain(stream)


async def _ending_alone(n: int) -> None:
    await _drain(StopAwareStream(_Ending(n), _NeverSet()))


CONTENDERS: dict[str, Callable[[int], Awaitable[None]]] = {
    "bare": _bare,
    "own, watched": _own_watched,
    "ending, watched": _ending_watched,
    "ending, alone": _ending_alone,
}


async def _timed(run: Callable[[int], Awaitable[None]], n: int) -> float:
    gc.collect()
    began = time.perf_counter()
    await run(n)
    return (time.perf_counter() - began) / n


async def _measure(batches: int, rounds: int) -> dict[str, list[float]]:
    names = list(CONTENDERS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # a warm-up of each
        await CONTENDERS[name](min(batches, 1000))
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(await _timed(CONTENDERS[name], batches))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0] if __doc__ else "bench_stop_aware")
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    batches = 2_000 if args.quick else args.batches
    rounds = 3 if args.quick else args.rounds
    times = anyio.run(_measure, batches, rounds)
    bare = times["bare"]
    rows = []
    summary: dict[str, Any] = {}
    for name, values in times.items():
        extra = [value - base for value, base in zip(values, bare, strict=True)]
        median, low, high = statistics.median(values), min(values), max(values)
        rows.append(
            [
                name,
                f"{median * 1e6:.2f} [{low * 1e6:.2f}-{high * 1e6:.2f}]",
                "" if name == "bare" else f"{statistics.median(extra) * 1e6:.2f}",
            ]
        )
        summary[name] = {"per_batch_s": values, "extra_over_bare_s": extra}
    print(f"stop-aware streams: {batches} ready batches, {rounds} rounds")
    print_table(["contender", "µs per batch, median [min-max]", "extra over bare, µs"], rows)
    if args.json is not None:
        write_json(args.json, {"benchmark": "stop_aware", "batches": batches, "rounds": rounds, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
