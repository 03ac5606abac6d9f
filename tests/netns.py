"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for multi-node tests.

``two_hosts()`` creates namespaces ``<tag>a`` (10.200.0.1/30) and ``<tag>b`` (10.200.0.2/30),
joined by a veth pair, and removes both whatever happens.  Only these addresses, inside
namespaces the test made, are ever used.  ``Hosts.run(which, argv)`` is the command line
that runs ``argv`` in one of them; ``Hosts.cut()`` takes the link down (a partition: every
packet between the two is lost, both ways), ``Hosts.shape(...)`` adds delay and a rate.
Where namespaces cannot be made (not root, no ``ip``), ``two_hosts`` skips the test and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import pytest

ADDRESSES = {"a": "10.200.0.1", "b": "10.200.0.2"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@attrs.frozen
class Hosts:
    tag: str

    def namespace(self, which: str) -> str:
        return f"{self.tag}{which}"

    def run(self, which: str, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``which`` ("a" or "b")."""
        return ["ip", "netns", "exec", self.namespace(which), *argv]

    def cut(self) -> None:
        """Take the link down on both ends: nothing passes, no connection is reset."""
        for which in "ab":
            _ip("-n", self.namespace(which), "link", "set", f"v{self.tag}{which}", "down")

    def shape(self, *, delay_ms: float, rate_mbit: float) -> None:
        """Delay and rate on both ends of the link (``tc netem``)."""
        for which in "ab":
            device = f"v{self.tag}{which}"
            netem = ["netem", "delay", f"{delay_ms}ms", "rate", f"{rate_mbit}mbit"]
            command = ["tc", "qdisc", "add", "dev", device, "root", *netem]
            subprocess.run(self.run(which, command), check=True, capture_output=True, timeout=10)


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the `ip` command")
    hosts = Hosts(tag=f"ll{os.getpid() % 100000}")
    a, b = hosts.namespace("a"), hosts.namespace("b")
    try:
        try:
            _ip("netns", "add", a)
            _ip("netns", "add", b)
            _ip(
                "link",
                "add",
                f"v{hosts.tag}a",
                "netns",
                a,
                "type",
                "veth",
                "peer",
                "name",
                f"v{hosts.tag}b",
                "netns",
                b,
            )
            for which, ns in (("a", a), ("b", b)):
                _ip("-n", ns, "addr", "add", f"{ADDRESSES[which]}/30", "dev", f"v{hosts.tag}{which}")
                _ip("-n", ns, "link", "set", f"v{hosts.tag}{which}", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode(errors='replace').strip()}")
        yield hosts
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10, check=False)
