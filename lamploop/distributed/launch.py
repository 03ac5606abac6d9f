"""Who am I? Rank, world size and the control channel's address from the launcher.

Three launchers are understood, checked in this order:

- lamploop itself: ``fit(world_size=n)`` run without a launcher becomes rank 0
  and starts ranks ``1..n-1`` by running the same command line again with
  ``LAMPLOOP_RANK``, ``LAMPLOOP_WORLD_SIZE``, ``LAMPLOOP_CONTROL`` (host:port)
  and ``LAMPLOOP_TOKEN`` set (and ``LAMPLOOP_FAILURE_FILE``, where such a rank's ``fit``
  writes the error it fails with, for the root to name once the rank has exited);
- ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``): rank 0 listens on a free port and publishes it in torchrun's own
  store.  Without ``LAMPLOOP_TOKEN`` it also publishes a fresh token there, but only when
  the store is on a loopback address (one machine) or ``LAMPLOOP_PUBLISH_TOKEN=1`` says
  so: anyone who can reach ``MASTER_PORT`` can read the store;
- Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``): the root is
  ``LAMPLOOP_ROOT_ADDR``, else the first host of ``SLURM_JOB_NODELIST`` (where rank 0
  runs), else ``SLURM_LAUNCH_NODE_IPADDR``; the port is ``LAMPLOOP_CONTROL_PORT``, else
  one derived from ``SLURM_JOB_ID`` (two jobs on one node do not collide), else 29511;
  ``LAMPLOOP_TOKEN`` is required.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import logging
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import anyio
import attrs
import torch.distributed as dist

from lamploop.control import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S
from lamploop.control.tcp import TcpControlFollower, TcpControlRoot
from lamploop.distributed.network import slurm_first_host, slurm_job_port
from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    LamploopError,
    PeerLostError,
    TrainingInterrupted,
    exception_leaves,
)
from lamploop.loop.stop_aware import StopFlag
from lamploop.loop.stop_request import SIGNAL_TURNS
from lamploop.modelspec import ModelSpec

__all__ = [
    "FAILED_FOLLOWER_EXIT_TIMEOUT_S",
    "FOLLOWER_EXIT_TIMEOUT_S",
    "FollowersEndedByTheStop",
    "LOCAL_HOST",
    "LaunchEnv",
    "default_launch_command",
    "launch_env",
    "noting_failure_for_the_root",
    "open_follower_control",
    "open_root",
    "open_root_control",
    "spawn_followers",
]

logger = logging.getLogger("lamploop.distributed")

FAILURE_FILE_VARIABLE = "LAMPLOOP_FAILURE_FILE"
P = ParamSpec("P")
T = TypeVar("T")
_FAILURE_NOTE_CHARS = 600

DEFAULT_SLURM_CONTROL_PORT = 29511
_STORE_TIMEOUT_S = 120.0


@attrs.frozen
class LaunchEnv:
    """This process's place in a launched job.

    Attributes:
        rank: this process's rank (0 is the root).
        world_size: the number of ranks.
        local_rank: the rank on this node (picks the CUDA device).
        launcher: ``"lamploop"``, ``"torchrun"`` or ``"slurm"``.
        root_host: the address of the root's node as the others reach it.
        control_port: the root's control port, when the launcher fixes it.
        token: the shared secret of the control channel, when known.
    """

    rank: int
    world_size: int
    local_rank: int
    launcher: str
    root_host: str
    control_port: int | None = None
    token: str | None = None
    store_port: int | None = None


def _int(environ: Mapping[str, str], name: str) -> int:
    if name not in environ:
        msg = f"environment variable {name} is not set"
        raise ConfigurationError(msg)
    try:
        return int(environ[name])
    except ValueError:
        msg = f"environment variable {name}={environ[name]!r} is not an integer"
        raise ConfigurationError(msg) from None


def _port(environ: Mapping[str, str], name: str) -> int:
    port = _int(environ, name)
    if not 1 <= port <= 65535:
        msg = f"environment variable {name}={environ[name]!r} must be a port in 1..65535"
        raise ConfigurationError(msg)
    return port


def _place(environ: Mapping[str, str], rank_name: str, size_name: str) -> tuple[int, int]:
    """``(rank, world_size)`` read from two variables, checked against each other."""
    rank, size = _int(environ, rank_name), _int(environ, size_name)
    if size < 1:
        msg = f"environment variable {size_name}={size} must be >= 1"
        raise ConfigurationError(msg)
    if not 0 <= rank < size:
        msg = f"environment variable {rank_name}={rank} must be in 0..{size - 1} ({size_name}={size})"
        raise ConfigurationError(msg)
    return rank, size


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launcher's view of this process, or ``None`` when no launcher started it.

    ``WORLD_SIZE`` without ``RANK``, or ``RANK`` beside ``MASTER_ADDR`` or ``MASTER_PORT``
    without ``WORLD_SIZE``, is torchrun's launch missing a variable; ``RANK`` alone is not a
    launcher's (other tools set it).

    Raises:
        ConfigurationError: a variable is malformed or a required one is missing.
    """
    env = os.environ if environ is None else environ
    if "LAMPLOOP_RANK" in env:
        host, _, port = env.get("LAMPLOOP_CONTROL", "").rpartition(":")
        if not host or not port.isdigit():
            msg = f"LAMPLOOP_CONTROL must be host:port, got {env.get('LAMPLOOP_CONTROL')!r}"
            raise ConfigurationError(msg)
        rank, size = _place(env, "LAMPLOOP_RANK", "LAMPLOOP_WORLD_SIZE")
        return LaunchEnv(
            rank=rank,
            world_size=size,
            local_rank=rank,
            launcher="lamploop",
            root_host=host,
            control_port=int(port),
            token=env.get("LAMPLOOP_TOKEN"),
        )
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env
    # WORLD_SIZE, or RANK beside torchrun's MASTER_ADDR / MASTER_PORT, is a launcher's: the
    # other of the pair missing is a misconfigured launch (named), not a process to train
    # alone.  RANK alone is not torchrun's: other tools set it.
    torchrun_meant = "WORLD_SIZE" in env or ("RANK" in env and ("MASTER_ADDR" in env or "MASTER_PORT" in env))
    if ("RANK" in env and "WORLD_SIZE" in env) or (torchrun_meant and not slurm):
        rank, size = _place(env, "RANK", "WORLD_SIZE")
        return LaunchEnv(
            rank=rank,
            world_size=size,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            launcher="torchrun",
            root_host=env.get("MASTER_ADDR", "127.0.0.1"),
            control_port=_port(env, "LAMPLOOP_CONTROL_PORT") if "LAMPLOOP_CONTROL_PORT" in env else None,
            token=env.get("LAMPLOOP_TOKEN"),
            store_port=_port(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
        )
    if slurm:
        nodelist = env.get("SLURM_JOB_NODELIST")
        root = (
            env.get("LAMPLOOP_ROOT_ADDR")
            or (slurm_first_host(nodelist) if nodelist else None)
            or env.get("SLURM_LAUNCH_NODE_IPADDR")
        )
        if not root:
            msg = "under Slurm set LAMPLOOP_ROOT_ADDR to the address of the node running rank 0"
            raise ConfigurationError(msg)
        if not env.get("LAMPLOOP_TOKEN"):
            msg = (
                "under Slurm set LAMPLOOP_TOKEN to a shared secret "
                "(e.g. `export LAMPLOOP_TOKEN=$(openssl rand -hex 16)`)"
            )
            raise ConfigurationError(msg)
        rank, size = _place(env, "SLURM_PROCID", "SLURM_NTASKS")
        return LaunchEnv(
            rank=rank,
            world_size=size,
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            launcher="slurm",
            root_host=root,
            control_port=_port(env, "LAMPLOOP_CONTROL_PORT")
            if "LAMPLOOP_CONTROL_PORT" in env
            else slurm_job_port(env["SLURM_JOB_ID"])
            if "SLURM_JOB_ID" in env
            else DEFAULT_SLURM_CONTROL_PORT,
            token=env["LAMPLOOP_TOKEN"],
        )
    return None


def _launcher_store(env: LaunchEnv) -> dist.TCPStore:
    if env.store_port is None:
        msg = "torchrun did not set MASTER_PORT; set LAMPLOOP_CONTROL_PORT and LAMPLOOP_TOKEN instead"
        raise ConfigurationError(msg)
    return dist.TCPStore(
        env.root_host, env.store_port, is_master=False, timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S)
    )


def _restart_key(name: str) -> str:
    # torchrun restarts reuse the store: scope the keys to this attempt.
    return f"lamploop/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


@asynccontextmanager
async def open_root_control(
    env: LaunchEnv,
    *,
    model_spec: ModelSpec,
    bind_host: str | None = None,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> AsyncIterator[TcpControlRoot]:
    """The root's TCP control channel, its address published where the followers look."""
    token = env.token or secrets.token_hex(16)
    port = env.control_port or 0
    async with TcpControlRoot(
        host=bind_host or env.root_host,
        port=port,
        nranks=env.world_size,
        token=token,
        model_spec=model_spec,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
    ) as root:
        if env.launcher == "torchrun" and env.control_port is None:
            published = _token_to_publish(env, token)
            store = await anyio.to_thread.run_sync(_launcher_store, env)
            store.set(_restart_key("control"), f"{root.address[1]}:{published}")
        yield root


def _token_to_publish(env: LaunchEnv, token: str) -> str:
    """The token to put in torchrun's store: none if every rank has it; a fresh one only where safe."""
    if env.token is not None:
        return ""
    loopback = env.root_host == "localhost" or _is_loopback(env.root_host)
    if loopback or os.environ.get("LAMPLOOP_PUBLISH_TOKEN") == "1":
        return token
    msg = (
        f"torchrun's store at {env.root_host} can be read by anyone who reaches MASTER_PORT, so "
        "lamploop does not publish a token there: set LAMPLOOP_TOKEN on every rank "
        "(e.g. `export LAMPLOOP_TOKEN=$(openssl rand -hex 16)`), or LAMPLOOP_PUBLISH_TOKEN=1 "
        "if that network is trusted"
    )
    raise ConfigurationError(msg)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@asynccontextmanager
async def open_follower_control(
    env: LaunchEnv,
    *,
    model_spec: ModelSpec,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> AsyncIterator[TcpControlFollower]:
    """A follower's TCP control channel to the root named by the launcher."""
    port, token = env.control_port, env.token
    if port is None:
        store = await anyio.to_thread.run_sync(_launcher_store, env)
        try:
            published = (await anyio.to_thread.run_sync(store.get, _restart_key("control"))).decode()
        except RuntimeError as exc:
            msg = f"rank {env.rank}: the root did not publish its control address in torchrun's store: {exc}"
            raise ControlChannelError(msg) from exc
        port_text, _, published_token = published.partition(":")
        port, token = int(port_text), token or published_token
    if not token:
        msg = f"rank {env.rank}: no control-channel token; set LAMPLOOP_TOKEN on every rank"
        raise ConfigurationError(msg)
    async with TcpControlFollower(
        host=env.root_host,
        port=port,
        rank=env.rank,
        nranks=env.world_size,
        token=token,
        model_spec=model_spec,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
    ) as follower:
        yield follower


LOCAL_HOST = "127.0.0.1"
"""Where the root listens when it starts its followers itself (they run on this machine)."""

FOLLOWER_EXIT_TIMEOUT_S = 60.0
"""How long the followers this process started get to exit after the run, before they are killed."""

FAILED_FOLLOWER_EXIT_TIMEOUT_S = 10.0
"""How long they get after the root failed: told why by the channel's close, they end at once
(naming a lost rank), unless one is stuck."""


@attrs.define
class _Ending:
    """How a follower's failing exit is taken.  While the root runs, it is a lost rank
    (``lost``: the root's channel fails naming it, and the root tells the other followers);
    after the root failed, it is expected; after the run, an error of its own."""

    lost: Callable[[int, str, str], None] | None = None
    root_failed: bool = False
    children: dict[int, anyio.CancelScope] = attrs.Factory(dict)
    """Each follower's process, by rank: cancelling its scope kills it."""
    stop: StopFlag | None = None
    """This process's stop request (SIGINT, SIGTERM), if it handles them."""
    joined: Callable[[], Sequence[int]] | None = None
    """The ranks that joined the root so far (while the root runs)."""
    ended_by_the_stop: dict[int, str] = attrs.Factory(dict)
    """The followers that ended before they joined as this process was asked to stop, and how."""

    async def ended_by_a_stop(self, rank: int, how: str) -> bool:
        """Whether rank ``rank``'s failing exit (``how``) came with this process's stop request.

        A Ctrl-C (or ``kill -- -PGID``) reaches the whole process group: a follower that still
        starts (importing torch, or in its script's code before ``fit``) cannot handle it yet
        and dies of it, or of what it broke (an import cut in half).  A follower that never
        joined and ended while this process was asked to stop is that, not a lost rank.
        """
        if self.stop is None or self.joined is None or rank in self.joined():
            return False
        for _ in range(SIGNAL_TURNS):  # the same signal may still wait for this loop's handler
            await anyio.lowlevel.checkpoint()
        if self.stop.is_set():
            self.ended_by_the_stop[rank] = how
            return True
        return False

    def only_stopped_ranks_lost(self, failure: BaseException) -> bool:
        """Whether ``failure`` is only that of followers that ended with the stop request
        (:meth:`ended_by_a_stop`)."""
        if not self.ended_by_the_stop:
            return False
        leaves = exception_leaves(failure)
        return all(isinstance(leaf, PeerLostError) and leaf.rank in self.ended_by_the_stop for leaf in leaves)

    def kill_the_frozen(self, failure: BaseException) -> None:
        """Kill the followers that ``failure`` names as silent (frozen: SIGSTOPped, or cut off).

        They cannot be told to end, and a stopped process does not take a SIGTERM: waiting for
        them held the root's error for :data:`FAILED_FOLLOWER_EXIT_TIMEOUT_S` (12 s after the
        fault instead of the heartbeat timeout's 4).
        """
        for leaf in exception_leaves(failure):
            if isinstance(leaf, PeerLostError) and leaf.how == "silent" and leaf.rank in self.children:
                logger.info("killing rank %d: it was lost silent (frozen or cut off)", leaf.rank)
                self.children[leaf.rank].cancel()


@asynccontextmanager
async def open_root(
    env: LaunchEnv | None,
    nranks: int,
    *,
    model_spec: ModelSpec,
    command: Sequence[str] | None = None,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    stop: StopFlag | None = None,
) -> AsyncIterator[tuple[TcpControlRoot | None, str]]:
    """The root's control channel (``None`` alone) and the host its tensor store listens on.

    One rank needs no channel; under a launcher the channel is published where the
    launcher's followers look (:func:`open_root_control`); otherwise this process starts
    ranks ``1..nranks-1`` itself (:func:`spawn_followers`, running ``command``) and, once
    the block is left, gives them :data:`FOLLOWER_EXIT_TIMEOUT_S` to exit before they are killed.

    ``stop`` is this process's stop request: a follower that ends before it joined while this
    process is asked to stop (a Ctrl-C to the group, which kills it as it still imports torch)
    is no lost rank but the stop; the run then fails with :class:`FollowersEndedByTheStop`.
    """
    if nranks == 1:
        yield None, LOCAL_HOST
        return
    if env is not None:
        async with open_root_control(
            env,
            model_spec=model_spec,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        ) as launched:
            yield launched, env.root_host
        return
    token = secrets.token_hex(16)
    stopped: TrainingInterrupted | None = None
    failed: Exception | None = None
    ending = _Ending(stop=stop)
    async with anyio.create_task_group() as followers:
        try:
            async with TcpControlRoot(
                host=LOCAL_HOST,
                nranks=nranks,
                token=token,
                model_spec=model_spec,
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
            ) as root:
                ending.lost, ending.joined = root.fail_peer, root.peers
                spawn_followers(
                    followers,
                    world_size=nranks,
                    control_address=root.address,
                    token=token,
                    command=command,
                    ending=ending,
                )
                try:
                    yield root, LOCAL_HOST
                except TrainingInterrupted as exc:
                    # A graceful stop: the followers got Stop at the same step boundary and end
                    # by themselves (a second signal cancels this at once instead).
                    stopped = exc
                except BaseException:
                    # Before the root's close tells the followers: their failing exits are
                    # expected from then on, not a second error.
                    ending.root_failed = True
                    raise
                finally:
                    ending.lost = ending.joined = None
        except Exception as exc:
            # The root failed, and closing its channel told the followers why (a lost rank is
            # named to them): each ends by itself, naming that rank, as a follower that a
            # launcher started does.  Their failing exits are expected; killed only if they linger.
            failed = exc
            ending.root_failed = True
            ending.kill_the_frozen(exc)
            followers.cancel_scope.deadline = anyio.current_time() + FAILED_FOLLOWER_EXIT_TIMEOUT_S
        else:
            # The followers got Stop; give them a bounded time to exit before they are killed.
            followers.cancel_scope.deadline = anyio.current_time() + FOLLOWER_EXIT_TIMEOUT_S
    if failed is not None:
        if ending.only_stopped_ranks_lost(failed):
            ended = ", ".join(f"rank {rank} {how}" for rank, how in sorted(ending.ended_by_the_stop.items()))
            msg = f"{ended} before it joined, as the stop came"
            raise FollowersEndedByTheStop(msg, ranks=sorted(ending.ended_by_the_stop)) from failed
        raise failed
    if stopped is not None:
        raise stopped


class FollowersEndedByTheStop(LamploopError):
    """Followers this process started ended before they joined, as this process was asked to
    stop (a SIGINT or SIGTERM to the process group reaches them while they still start): the
    run stops, no rank is lost.

    Attributes:
        ranks: those followers.
    """

    def __init__(self, message: str, *, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def default_launch_command(world_size: int) -> list[str]:
    """This process's command line, which starts ranks ``1..world_size-1`` when run again.

    Raises:
        ConfigurationError: this process cannot be run again to join the run: a notebook
            kernel, ``python -c`` or the interactive interpreter; the message says what to do.
    """
    script = sys.argv[0] if sys.argv else ""
    if script in ("", "-c") or Path(script).name in _KERNELS:
        what = "a notebook kernel" if script not in ("", "-c") else "an interactive session"
        msg = (
            f"fit(world_size={world_size}) starts ranks 1..{world_size - 1} by running this process's "
            f"command line again, but this is {what} ({' '.join(sys.orig_argv)[:80]!r}), which cannot "
            "be run again; put the code that calls fit in a script, then either run that script "
            "(python train.py) or pass launch_command=[sys.executable, 'train.py'] here (the script "
            "calls fit with the same arguments; only rank 0 returns the state)"
        )
        raise ConfigurationError(msg)
    return list(sys.orig_argv)


_KERNELS = ("ipykernel_launcher.py", "ipykernel_launcher", "kernel_launcher.py")


def spawn_followers(
    tasks: anyio.abc.TaskGroup,
    *,
    world_size: int,
    control_address: tuple[str, int],
    token: str,
    command: Sequence[str] | None = None,
    ending: _Ending | None = None,
) -> None:
    """Start ranks ``1..world_size-1`` as child processes running ``command`` (default: this one).

    The children are supervised by ``tasks``: one that exits with an error
    fails the task group (unless ``ending`` says the root failed first), and cancelling the
    group kills them.
    """
    argv = list(command) if command is not None else list(sys.orig_argv)
    host, port = control_address
    for rank in range(1, world_size):
        env = dict(os.environ)
        env.update(
            LAMPLOOP_RANK=str(rank),
            LAMPLOOP_WORLD_SIZE=str(world_size),
            LAMPLOOP_CONTROL=f"{host}:{port}",
            LAMPLOOP_TOKEN=token,
        )
        tasks.start_soon(_run_child, argv, env, rank, ending or _Ending())


def noting_failure_for_the_root(
    run: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """``run`` (``fit_async``), which on a rank that ``fit(world_size=n)`` started also writes the
    error it fails with to ``LAMPLOOP_FAILURE_FILE``, for the root to name: a rank that fails
    before it joined the run is otherwise only an exit status to the root."""

    @functools.wraps(run)
    async def noting(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await run(*args, **kwargs)
        except Exception as exc:
            _note_failure(exc)
            raise

    return noting


def _note_failure(error: Exception) -> None:
    """``error`` into ``LAMPLOOP_FAILURE_FILE``, on a rank that ``fit(world_size=n)`` started (a few
    hundred bytes, once: written from the event loop's thread)."""
    path = os.environ.get(FAILURE_FILE_VARIABLE) if "LAMPLOOP_RANK" in os.environ else None
    if path:
        with suppress(OSError):
            Path(path).write_text(f"{type(error).__name__}: {error}"[:_FAILURE_NOTE_CHARS])


def _failure_note(path: str) -> str:
    """What a rank wrote to its failure file (``""`` if nothing); the file is removed."""
    try:
        return Path(path).read_text(errors="replace").strip()[:_FAILURE_NOTE_CHARS]
    except OSError:
        return ""
    finally:
        with suppress(OSError):
            os.unlink(path)


async def _run_child(argv: list[str], env: dict[str, str], rank: int, ending: _Ending) -> None:
    descriptor, failure_file = tempfile.mkstemp(prefix=f"lamploop-rank{rank}-", suffix=".failure")
    os.close(descriptor)
    try:
        with anyio.CancelScope() as process:  # cancelled: anyio kills the process and waits for it
            ending.children[rank] = process
            result = await anyio.run_process(
                argv, env={**env, FAILURE_FILE_VARIABLE: failure_file}, stdout=None, stderr=None, check=False
            )
    finally:
        said = _failure_note(failure_file)
    if process.cancelled_caught:
        return
    if result.returncode == 0 and ending.lost is not None and ending.joined is not None:
        if rank not in ending.joined():  # it ended without joining (not the run's script?): no wait
            ending.lost(rank, "died", f"exited with status 0 before it joined the run: {' '.join(argv)}")
        return
    if result.returncode != 0:
        if ending.root_failed:
            logger.info("rank %d exited with status %d after the root failed", rank, result.returncode)
            return
        how = f"status {result.returncode}"
        if -result.returncode in signal.valid_signals():
            how += f" ({signal.Signals(-result.returncode).name})"
        if said:
            how += f", failing with {said!r}"
        if await ending.ended_by_a_stop(rank, f"exited with {how}"):
            logger.info("rank %d exited with %s before it joined, as this run was asked to stop", rank, how)
            if ending.lost is not None:  # the root runs: it stops now, not at the join timeout
                ending.lost(rank, "died", f"exited with {how} as the run was asked to stop: {' '.join(argv)}")
            return
        if ending.lost is not None:  # the root runs: a lost rank, which it names to every rank
            ending.lost(rank, "died", f"exited with {how}: {' '.join(argv)}")
            return
        msg = f"rank {rank} exited with {how}: {' '.join(argv)}"
        raise ControlChannelError(msg)
