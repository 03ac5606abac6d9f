"""Shared helpers for the benchmark scripts in this folder.

Every script takes ``--json PATH`` (write raw timings and a summary there) and
``--quick`` (fewer repetitions and steps, for CI smoke runs).

Measurement discipline: the machines these run on are small and shared, so a
script never compares two numbers taken minutes apart.  It alternates the two
contenders (A B, B A, A B, ...) inside the same run with :func:`alternate`, and
summarises the *per-pair* ratios with their median, which cancels slow drifts
and shrugs off the odd pair spoiled by a neighbour's burst of work.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Pair",
    "alternate",
    "fmt_seconds",
    "machine_info",
    "make_parser",
    "print_table",
    "ratio_summary",
    "summarize",
    "write_json",
]

Measure = Callable[[], float]
"""Runs one repetition and returns its elapsed time in seconds.

The callable does its own set-up (copies of the model, a fresh optimizer...)
and times only the part that is being compared, so set-up never counts."""

Pair = tuple[float, float]


def make_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark script shares."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write raw timings and the summary to PATH")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions (smoke run)")
    return parser


def alternate(
    a: Measure,
    b: Measure,
    *,
    pairs: int,
    warmup: int = 1,
    min_pairs: int | None = None,
    budget_s: float | None = None,
) -> list[Pair]:
    """Time ``a`` and ``b`` alternately and return up to ``pairs`` (time_a, time_b) tuples.

    ``warmup`` rounds of both run first and are discarded (allocator, caches,
    lazy initialisation).  The order flips every pair (AB, BA, AB, ...) so that
    neither side always runs first after a garbage collection or a warm cache.
    A full collection runs before each timed repetition; the collector stays
    enabled during it, as in a real run.

    On a loaded machine a repetition can take many times longer than usual.
    With ``budget_s``, no new pair starts once the warm-up and the pairs so far
    have taken that long, but at least ``min_pairs`` (default: ``pairs``) pairs
    always run.  ``len(result) < pairs`` tells that the budget cut it short.
    """
    if pairs < 1:
        msg = f"alternate: pairs must be >= 1, got {pairs}"
        raise ValueError(msg)
    floor = pairs if min_pairs is None else max(1, min(min_pairs, pairs))
    started = time.perf_counter()
    for _ in range(warmup):
        a()
        b()
    result: list[Pair] = []
    for i in range(pairs):
        if i >= floor and budget_s is not None and time.perf_counter() - started > budget_s:
            break
        gc.collect()
        if i % 2 == 0:
            ta = a()
            gc.collect()
            tb = b()
        else:
            tb = b()
            gc.collect()
            ta = a()
        result.append((ta, tb))
    return result


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (NumPy's default) of already-sorted values."""
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low))


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, IQR, min and max of ``values``."""
    ordered = sorted(values)
    q1, q3 = _quantile(ordered, 0.25), _quantile(ordered, 0.75)
    return {
        "n": len(ordered),
        "median": float(statistics.median(ordered)),
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "min": float(ordered[0]),
        "max": float(ordered[-1]),
    }


def ratio_summary(pairs: Sequence[Pair]) -> dict[str, float]:
    """Summary of the per-pair ratios ``b / a`` (the second contender over the first)."""
    return summarize([tb / ta for ta, tb in pairs])


def fmt_seconds(seconds: float) -> str:
    """A duration with a unit that keeps three significant-ish digits."""
    magnitude = abs(seconds)
    if magnitude >= 1.0:
        return f"{seconds:.3f} s"
    if magnitude >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, file: Any = None) -> None:
    """Print a plain-text table; the first column is left-aligned, the others right-aligned."""
    out = file if file is not None else sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    print(line(cells[0]), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells[1:]:
        print(line(row), file=out)


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Versions, thread counts and the machine, to store next to any timing."""
    import torch  # local: _common stays importable without torch for tooling

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads_env": os.environ.get("MKL_NUM_THREADS"),
        "git_commit": _git_commit(),
        "timestamp_unix": time.time(),
    }
    try:
        import anyio

        info["anyio"] = getattr(anyio, "__version__", None) or _distribution_version("anyio")
    except ImportError:
        info["anyio"] = None
    try:
        import lamploop

        info["lamploop"] = lamploop.__version__
    except ImportError:
        info["lamploop"] = None
    return info


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` plus ``machine`` (see :func:`machine_info`) to ``path``, creating parent folders."""
    document = {"machine": machine_info(), **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
