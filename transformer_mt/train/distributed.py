"""Processes and devices, set up in one place: the torchrun environment, collectives, the launcher.

``setup()`` reads what ``torchrun`` exports (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); without it the run is a single process. NCCL is used
on CUDA devices, gloo on CPU. Everything else takes the returned ``DistEnv``
explicitly; model code never asks which rank it is on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from transformer_mt.cpus import choose_threads
from transformer_mt.errors import UserError


class DistributedError(UserError):
    """A launch setting for several processes that cannot work; the message names the variable or flag."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs: its rank among ``world_size`` processes and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    peers: tuple[tuple[str, int], ...] = ()  # every rank's (host, pid), in rank order: who ended, when one does

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={value!r} is not an integer; is torchrun setting it?"
        ) from None


def setup(device: str | None = None) -> DistEnv:
    """Join the process group torchrun describes (or none), pick this rank's device and return the DistEnv.

    ``device`` forces a device type ("cpu" or "cuda"); by default CUDA is used when available.
    """
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda:
        dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    peers: list[tuple[str, int]] = [(socket.gethostname(), os.getpid())]
    if world_size > 1:
        peers = [tuple(p) for p in _gather(peers[0], world_size)]
    return DistEnv(rank, world_size, local_rank, dev, is_main=rank == 0, peers=tuple(peers))


def _gather(obj: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def cleanup(env: DistEnv) -> None:
    """Leave the process group (after the last collective)."""
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few scalars over ranks in one collective (float64, on the rank's device for NCCL)."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum ``t`` over ranks in place, on its device: unlike `all_reduce_sum`, the host does not wait for it."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's ``obj``, in rank order (used for per-rank RNG states)."""
    return _gather(obj, env.world_size) if env.distributed else [obj]


# What gloo says, on a rank's next collective, when the process of another rank has ended.
_PEER_ENDED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_ended(error: BaseException, env: DistEnv) -> DistributedError | None:
    """The one-line error for a collective cut short because another rank's process ended; None for any other.

    A rank killed (out of memory, a signal, a crash) takes its sockets with it,
    and every other rank's next collective fails with a transport error that
    names an address, not a rank. The ranks' pids, gathered at `setup`, tell
    which process on this host is gone; that rank's own output says why.
    """
    if not env.distributed or not any(s in str(error) for s in _PEER_ENDED):
        return None
    host = socket.gethostname()
    others = [(r, h, pid) for r, (h, pid) in enumerate(env.peers) if r != env.rank]
    ended = _ended([(r, pid) for r, h, pid in others if h == host])
    if ended:
        who = ", ".join(f"rank {r} (pid {pid})" for r, pid in ended) + (" has" if len(ended) == 1 else " have")
        who += " ended"
    elif any(h != host for _, h, _ in others):
        who = "a rank on " + ", ".join(sorted({h for _, h, _ in others if h != host})) + " ended or became unreachable"
    else:
        who = "another rank's process ended"
    return DistributedError(
        f"rank {env.rank} stopped: {who}, so training cannot go on (its own output says why). Fix that cause and "
        "run the same command again: training resumes from the newest checkpoint."
    )


def _ended(ranks: list[tuple[int, int]], wait: float = 2.0) -> list[tuple[int, int]]:
    """Those of (rank, pid) on this host whose process is gone or a zombie; waits a moment for a dying one."""
    deadline = time.monotonic() + wait
    while True:
        gone = [(r, pid) for r, pid in ranks if not _running(pid)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # zombie or dead: ended
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The command ``tmt train CONFIG --nproc-per-node N`` runs: torchrun on this host, a free port picked for us.

    Through `transformer_mt.train.launch`, which tells a rank's failure in one line instead of torchrun's traceback.
    """
    return [
        sys.executable,
        "-m",
        "transformer_mt.train.launch",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "transformer_mt",
        *args,
    ]


def launch_torchrun(nproc: int, args: list[str]) -> int:
    """Run torchrun ``--nproc-per-node N -m transformer_mt <args>`` (`torchrun_command`); returns its exit code.

    One host only (``--standalone``); for several hosts run torchrun yourself
    with ``--nnodes`` and a rendezvous endpoint (docs/training.md).
    """
    if nproc < 1:
        raise DistributedError(f"--nproc-per-node must be at least 1, got {nproc}")
    return subprocess.call(torchrun_command(nproc, args), env=rank_environment(nproc))


def rank_environment(nproc: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ranks' environment: ``OMP_NUM_THREADS`` shares this host's usable CPUs among the ``nproc`` ranks
    (`transformer_mt.cpus.choose_threads`; torchrun itself would give each one thread), unless the user set it."""
    threads = choose_threads(environ=environ, ranks=nproc)
    return {**environ, "OMP_NUM_THREADS": str(threads.count)}
