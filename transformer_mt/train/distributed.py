"""Processes and devices, set up in one place: the torchrun environment, collectives, the launcher.

``setup()`` reads what ``torchrun`` exports (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); without it the run is a single process. NCCL is used
on CUDA devices, gloo on CPU. Everything else takes the returned ``DistEnv``
explicitly; model code never asks which rank it is on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, is_main=rank == 0)


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
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The command ``tmt train CONFIG --nproc-per-node N`` runs: torchrun on this host, a free port picked for us."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "transformer_mt",
        *args,
    ]


def launch_torchrun(nproc: int, args: list[str]) -> int:
    """Run ``python -m torch.distributed.run --nproc-per-node N -m transformer_mt <args>``; returns its exit code.

    One host only (``--standalone``); for several hosts run torchrun yourself
    with ``--nnodes`` and a rendezvous endpoint (docs/training.md).
    """
    if nproc < 1:
        raise DistributedError(f"--nproc-per-node must be at least 1, got {nproc}")
    return subprocess.call(torchrun_command(nproc, args))
