"""Where traffic goes: Slurm's root host and per-job port, the interface that reaches the root,
and whether the control token may be published in torchrun's store."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lamploop.distributed.launch import LaunchEnv, _token_to_publish, launch_env
from lamploop.distributed.network import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    local_address_towards,
    slurm_first_host,
    slurm_job_port,
)
from lamploop.errors import ConfigurationError

SLURM = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1",
    "LAMPLOOP_TOKEN": "secret",
}


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node[01-03,07],gpu-a[1-2]", "node01"),
        ("n1,n2", "n1"),
        ("c1-[2-4]", "c1-2"),
        ("rack[1-2]-node[01-03]", "rack1-node01"),
        ("single", "single"),
        ("gpu-a[007,9]", "gpu-a007"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert slurm_first_host(nodelist) == first


@given(
    prefix=st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
    width=st.integers(1, 4),
    numbers=st.lists(st.integers(0, 999), min_size=1, max_size=4),
    tail=st.lists(st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True), max_size=3),
)
def test_the_first_host_is_the_first_number_of_the_first_item(
    prefix: str, width: int, numbers: list[int], tail: list[str]
) -> None:
    ranges = ",".join(
        f"{n:0{width}d}-{n + 1:0{width}d}" if i % 2 else f"{n:0{width}d}" for i, n in enumerate(numbers)
    )
    nodelist = ",".join([f"{prefix}[{ranges}]", *tail])
    assert slurm_first_host(nodelist) == f"{prefix}{numbers[0]:0{width}d}"


@pytest.mark.parametrize("bad", ["", "node[01", "node]01[", "node[]", ",n1"])
def test_a_malformed_node_list_is_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="SLURM_JOB_NODELIST"):
        slurm_first_host(bad)


def test_slurm_root_and_port_come_from_the_job() -> None:
    env = launch_env({**SLURM, "SLURM_JOB_NODELIST": "gpu[12-15]", "SLURM_JOB_ID": "4242"})
    assert env is not None
    assert env.root_host == "gpu12"
    assert env.control_port == SLURM_PORT_BASE + 4242
    other = launch_env({**SLURM, "SLURM_JOB_NODELIST": "gpu[12-15]", "SLURM_JOB_ID": "4243"})
    assert other is not None
    assert other.control_port != env.control_port  # two jobs on one node: two ports
    explicit = launch_env(
        {**SLURM, "SLURM_JOB_ID": "4242", "LAMPLOOP_ROOT_ADDR": "head", "LAMPLOOP_CONTROL_PORT": "7000"}
    )
    assert explicit is not None
    assert (explicit.root_host, explicit.control_port) == ("head", 7000)


def test_slurm_job_ports_stay_in_their_range() -> None:
    assert {slurm_job_port(j) for j in (0, SLURM_PORT_SPAN)} == {SLURM_PORT_BASE}
    assert all(
        SLURM_PORT_BASE <= slurm_job_port(j) < SLURM_PORT_BASE + SLURM_PORT_SPAN
        for j in range(0, 10**6, 9973)
    )
    with pytest.raises(ConfigurationError, match="SLURM_JOB_ID"):
        slurm_job_port("abc")


def test_the_address_towards_the_root() -> None:
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("localhost") in ("127.0.0.1", "::1")
    with pytest.raises(ConfigurationError, match="cannot resolve"):
        local_address_towards("no-such-host.invalid")


def _torchrun(root: str, token: str | None = None) -> LaunchEnv:
    return LaunchEnv(rank=0, world_size=2, local_rank=0, launcher="torchrun", root_host=root, token=token)


def test_the_token_is_published_in_torchruns_store_only_where_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAMPLOOP_PUBLISH_TOKEN", raising=False)
    assert _token_to_publish(_torchrun("127.0.0.1"), "fresh") == "fresh"  # one machine
    assert _token_to_publish(_torchrun("localhost"), "fresh") == "fresh"
    assert _token_to_publish(_torchrun("10.0.0.5", token="set"), "set") == ""  # every rank has it
    with pytest.raises(ConfigurationError, match="LAMPLOOP_TOKEN on every rank"):
        _token_to_publish(_torchrun("10.0.0.5"), "fresh")
    monkeypatch.setenv("LAMPLOOP_PUBLISH_TOKEN", "1")
    assert _token_to_publish(_torchrun("10.0.0.5"), "fresh") == "fresh"  # the user opted in
