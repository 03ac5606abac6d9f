"""Shared fixtures: anyio runs every async test on asyncio; which modules run alone or apart.

``nox -s tests`` runs the suite: every test marked neither ``serial`` nor ``soak``, on several
pytest-xdist workers side by side (most multi-process tests spend their time waiting for
processes to start and for timeouts, not computing).  ``nox -s stress`` (CI runs it after
``tests``) runs the rest: the ``soak`` modules on the workers, then the ``serial`` ones alone,
one after the other.  ``serial``: the modules assert a tight bound on a detection, a stop or a
heartbeat (a second or a few), or load the CPU on purpose, and must not share the machine with
other tests.  ``soak``: fault scenarios run end to end, again and again or through whole
launchers (a dozen SIGKILLs, runs stopped and resumed, torchrun restarts, two network
namespaces, a terminal's Ctrl-C): a third of the parallel phase's time, apart so that the
suite stays under 10 minutes on two cores.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Hypothesis's per-example deadline (200 ms) is a speed check, and a loaded CI machine (three
# workers on two cores) can miss it without any bug; the suite's time bounds are pytest-timeout's.
settings.register_profile("lamploop", deadline=None)
settings.load_profile("lamploop")

# One OpenMP thread per process, set before this process or any it starts imports torch: the
# suite runs three workers and their ranks on two cores, where more threads only contend; and
# with more, `import torch` starts an OpenMP thread, and the warm server that forks the tests'
# workers (tests/workers/warm_server.py) forks only while it has one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

SERIAL_MODULES = frozenset(
    {
        "test_collective_errors",
        "test_control_tcp",
        "test_fault",
        "test_fsdp_liveness",
        "test_federated_faults",
        "test_liveness_defaults",
        "test_local_parallel_faults",
        "test_reliability",
        "test_stop_while_waiting",
    }
)

SOAK_MODULES = frozenset(
    {
        "test_acceptance_docs_launch",
        "test_acceptance_docs_reliability",
        "test_acceptance_leaks",
        "test_acceptance_no_hangs",
        "test_acceptance_no_hangs_r2",
        "test_acceptance_no_hangs_r3",
        "test_acceptance_hostile_r5",
        "test_acceptance_hostile_r7",
        "test_acceptance_docs_r6",
        "test_follower_failures",
        "test_graceful_stop",
        "test_multinode",
        "test_sigkills",
        "test_stop_dataloader",
        "test_stream_resume",
        "test_terminal",
    }
)
"""The fault scenarios ``nox -s stress`` runs apart (the module docstring); 800 s of the parallel
phase's 2,600 s of test time (its workers' sum, 2026-11-29), and the faults whose process must
end (test_acceptance_no_hangs: 110 s; its second round, federated runs, pipelines, the CLI and
the control channel: 4-5 minutes alone).  With the signals to DataLoader workers
(test_stop_dataloader), the SIGKILLed stream trainer (test_stream_resume) and the followers that
fail as they start (test_follower_failures), 140 s more of the suite's 1,650 s of test time
(2026-11-29), whose wall time had reached 10:24 on 3 workers.  What a run leaves behind
(test_acceptance_leaks: processes of a dozen runs each) went there too: its first group took
45 s of the suite in CI run 18, which ran 8:48 on a slow day."""


SLOWEST_MODULES = (
    "test_sigkills",
    "test_graceful_stop",
    "test_fsdp",
    "test_terminal",
    "test_strategy_references",
    "test_multinode",
    "test_stop_dataloader",
    "test_acceptance_docs_reliability",
    "test_acceptance_docs_fsdp",
    "test_acceptance_docs_cli",
    "test_sync_state",
    "test_acceptance_docs_streaming_r2",
    "test_stream_ranks",
    "test_cli",
    "test_acceptance_rows_window",
)
"""The modules that took longest in the parallel phase (40-106 s each, 2026-11-28 and -29),
slowest first. They run first: pytest-xdist's ``loadfile`` hands out modules in collection order, and
one of these handed out last would leave the other workers idle while it runs."""


def _module_name(item: pytest.Item) -> str:
    return item.module.__name__.rpartition(".")[2] if item.module is not None else ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _module_name(item) in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        elif _module_name(item) in SOAK_MODULES:
            item.add_marker(pytest.mark.soak)
    first = {name: index for index, name in enumerate(SLOWEST_MODULES)}
    # A stable sort: every other module keeps its place, and each module's tests their order.
    items.sort(key=lambda item: first.get(_module_name(item), len(first)))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
