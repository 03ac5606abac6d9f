"""A rank frozen (SIGSTOP) inside a sharded step ends every survivor within the heartbeat bound, naming it.

DESIGN.md section 5 and issue 23: FSDP2 issues its all-gathers and reduce-scatters inside its
own hooks, in the middle of a forward or a backward; lamploop gives it collectives whose waits
are sliced and look at the rank's abort signal (:mod:`lamploop.sync.fsdp`), so a survivor
left waiting in one of them by a frozen peer gives up once the heartbeats declare that peer
lost, as with every other strategy.  Real processes (``tests/workers/fsdp_freeze.py``, started
by ``benchmarks/stress_fsdp_liveness.py``, which runs the scenarios repeatedly), Gloo,
the TCP control channel with its default heartbeat settings, three ranks: rank 1 first
computes for longer than the heartbeat timeout inside a backward (slow but alive: nobody may be
declared lost), then stops itself with SIGSTOP inside a later backward.  Ranks 0 (the root) and
2 (a follower) must both end with ``PeerLostError`` naming rank 1 within
:data:`END_WITHIN_S` of the SIGSTOP, and exit.  A rank that SIGKILLs itself inside a backward
is named too (two ranks).

The global norm of ``clip_grad_norm_`` over a sharded model is a ``DTensor`` all-reduce, whose
wait nothing interrupts: a rank frozen just before it leaves the other blocked there, and that
rank's training thread is given up on (:data:`lamploop.sync.fsdp.GIVE_UP_AFTER_S` after its
abort signal) so that it too ends within the bound (two ranks).

Timing-sensitive (a bound of seconds): in ``tests/conftest.py``'s serial modules.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

from lamploop.control import DEFAULT_HEARTBEAT_TIMEOUT_S

sys.path.insert(0, str(ROOT / "benchmarks"))
from stress_fsdp_liveness import END_WITHIN_S, EXITED_WITHIN_S, HEARTBEAT_TIMEOUT_S, SLOW_S, freeze_run, logs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_the_bound_is_the_default_heartbeat_timeout_and_a_second() -> None:
    assert HEARTBEAT_TIMEOUT_S == DEFAULT_HEARTBEAT_TIMEOUT_S
    assert SLOW_S > DEFAULT_HEARTBEAT_TIMEOUT_S  # the long step would be taken for lost by a timer


def _assert_named_within_the_bound(
    result: dict[str, Any], workdir: Path, survivors: list[int], how: tuple[str, ...] = ("silent",)
) -> None:
    context = f"{json.dumps(result, indent=1)}\n{logs(workdir, list(range(len(survivors) + 1)))}"
    assert sorted(result["survivors"]) == survivors, context
    for survivor in result["survivors"].values():
        assert (survivor["error"], survivor["named"]) == ("PeerLostError", 1), context
        assert survivor["how"] in how, context
        assert survivor["failed_after_s"] < END_WITHIN_S, context
        assert survivor["status"] == 1, context
        assert survivor["exited_after_s"] is not None, context
        assert survivor["exited_after_s"] < EXITED_WITHIN_S, context


def test_a_rank_frozen_inside_a_sharded_step_is_named_by_every_survivor_within_the_bound(
    tmp_path: Path,
) -> None:
    result = freeze_run(tmp_path)
    assert result["slow_step_s"] >= SLOW_S, result  # the long step happened, nobody was lost meanwhile
    _assert_named_within_the_bound(result, tmp_path, [0, 2])


def test_a_rank_frozen_before_the_global_norm_of_clipping_is_named_within_the_bound(tmp_path: Path) -> None:
    result = freeze_run(tmp_path, nranks=2, slow_s=0.0, freeze_in="clip")
    _assert_named_within_the_bound(result, tmp_path, [0])


def test_a_rank_killed_inside_a_sharded_step_is_named_at_once(tmp_path: Path) -> None:
    """SIGKILL: its connections close, the survivors learn it from the control channel at once."""
    result = freeze_run(tmp_path, nranks=2, slow_s=0.0, kill="SIGKILL")
    _assert_named_within_the_bound(result, tmp_path, [0], how=("closed", "died"))
