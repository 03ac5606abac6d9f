"""Where a rank's traffic goes: the local address that reaches the root, and Slurm's root and port.

- :func:`local_address_towards` -- the address of the interface that routes to a host (a
  UDP ``connect`` sends nothing); Gloo binds there, so the common multi-node case needs no
  ``GLOO_SOCKET_IFNAME`` (which, when set, still wins);
- :func:`slurm_first_host` -- the first host of ``SLURM_JOB_NODELIST`` (``node[01-03,07]``
  style), where Slurm starts rank 0 under its default block distribution;
- :func:`slurm_job_port` -- a control port derived from ``SLURM_JOB_ID``, so that two jobs
  on one node do not both take the same port.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Final

from lamploop.errors import ConfigurationError

__all__ = [
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
    "local_address_towards",
    "slurm_first_host",
    "slurm_job_port",
]

SLURM_PORT_BASE: Final = 20000
SLURM_PORT_SPAN: Final = 20000
"""Slurm control ports are ``SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN``: two jobs share a
port only if their ids are equal modulo 20,000."""


def local_address_towards(host: str, port: int = 9) -> str:
    """This machine's address on the interface that routes to ``host`` (no packet is sent).

    Raises:
        ConfigurationError: ``host`` does not resolve, or no route leads to it.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        msg = f"cannot resolve the root's address {host!r}: {exc}"
        raise ConfigurationError(msg) from exc
    family, _, _, _, address = infos[0]
    if ipaddress.ip_address(address[0]).is_loopback:
        return str(address[0])
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(address)
        except OSError as exc:
            msg = f"no route from this machine to the root's address {host!r}: {exc}"
            raise ConfigurationError(msg) from exc
        return str(probe.getsockname()[0])


def gloo_interface() -> str | None:
    """``GLOO_SOCKET_IFNAME`` (the first of a comma-separated list), if the user set it."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    return names.split(",")[0] or None


def _first_of_brackets(text: str) -> str:
    """``'01-03,07'`` -> ``'01'``: the first value of a bracket's list of numbers and ranges."""
    return text.split(",")[0].split("-")[0]


def _top_level_items(nodelist: str) -> list[str] | None:
    """The comma-separated items of a node list (commas inside brackets belong to ranges)."""
    items, depth, start = [], 0, 0
    for position, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            return None
        if ch == "," and depth == 0:
            items.append(nodelist[start:position])
            start = position + 1
    items.append(nodelist[start:])
    return items if depth == 0 else None


def slurm_first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"node[01-03,07],gpu[1-2]"`` -> ``"node01"``.

    Raises:
        ConfigurationError: the list is empty or its brackets do not match.
    """
    items = _top_level_items(nodelist)
    if not items or not items[0].strip():
        msg = f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm node list (like node[01-03,07])"
        raise ConfigurationError(msg)
    host, rest = "", items[0].strip()
    while "[" in rest:
        before, _, after = rest.partition("[")
        inside, _, rest = after.partition("]")
        if not inside:
            msg = f"SLURM_JOB_NODELIST={nodelist!r} has an empty bracket"
            raise ConfigurationError(msg)
        host += before + _first_of_brackets(inside)
    return host + rest


def slurm_job_port(job_id: str | int) -> int:
    """The control port of Slurm job ``job_id``: ``SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN``.

    Raises:
        ConfigurationError: ``job_id`` is not a non-negative integer.
    """
    try:
        number = int(job_id)
    except ValueError:
        number = -1
    if number < 0:
        msg = f"SLURM_JOB_ID={job_id!r} is not a non-negative integer"
        raise ConfigurationError(msg)
    return SLURM_PORT_BASE + number % SLURM_PORT_SPAN
