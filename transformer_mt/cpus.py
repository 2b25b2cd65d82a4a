"""How many CPU threads a tmt process uses, and how they wait: sized by the CPUs the process may really use.

Why: torch sizes its intra-op pool by the CPUs of the affinity mask (libgomp's
count), never by a container's CPU quota, and libgomp's threads spin at every
barrier (300,000 rounds when ``OMP_WAIT_POLICY`` is unset). On a shared
machine a beam search's thousands of small parallel regions then wait for a
thread the kernel has descheduled, and each thread spins away the time its
peers need: decoding ran 20x slower than CTranslate2 beside two trainings,
training at 0.43x its fair share beside two busy processes, and a container
limited to one CPU still ran a thread per host core (benchmarks/README.md,
"A busy machine").

So every command sizes its pool by `usable_cpus` (the affinity mask, the
cgroup v1 or v2 quota along the process's cgroup and its parents, the host's
cores), and threads that find no work sleep instead of spinning
(`WAIT_SETTINGS`, applied by `prepare_openmp` before torch is imported:
libgomp reads it once, when it is loaded). ``--threads``,
``train.num_threads``, ``TMT_NUM_THREADS`` and ``OMP_NUM_THREADS`` override
the count, in that order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.errors import UserError

# A thread that finds no work sleeps at once instead of spinning (libgomp: 300,000 rounds by default). Idle, the
# beam search and training keep their speed within noise; beside two trainings the spinning default decoded 8x
# slower and trained 6x slower than this, and a short spin (10,000 rounds) still 1.7x and 1.4x slower
# (benchmarks/README.md, "A busy machine").
WAIT_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class Threads:
    """The intra-op thread count chosen for this process, and why (for ``--verbose`` and ``/health``)."""

    count: int
    why: str


def prepare_openmp(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set `WAIT_SETTINGS` in ``environ`` before torch (and libgomp) load, unless the user chose how threads wait:
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set (the latter overrides the former in libgomp)."""
    if not any(name in environ for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        environ.update(WAIT_SETTINGS)


def choose_threads(requested: int = 0, environ: Mapping[str, str] = os.environ, ranks: int = 1, **machine) -> Threads:
    """The thread count for one process: ``requested`` (a flag or config key) when above 0, else
    ``TMT_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the usable CPUs shared by the ``ranks`` processes of this
    host (torchrun's local world size), rounded to the nearest whole thread and at least 1. ``machine`` goes to
    `usable_cpus` (tests)."""
    if requested > 0:
        return Threads(requested, f"{requested} as asked (--threads or train.num_threads)")
    for name in ("TMT_NUM_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return Threads(int(value), f"{value} from {name}")
    cpus, why = usable_cpus(**machine)
    count = max(1, math.floor(cpus / ranks + 0.5))
    per_rank = f", shared by {ranks} processes" if ranks > 1 else ""
    return Threads(count, f"{count}: {why}{per_rank}")


def usable_cpus(root: Path = Path("/"), affinity: set[int] | None = None, host: int | None = None) -> tuple[float, str]:
    """The CPUs this process may use, and how that was found: the fewest of the host's cores, the affinity mask
    and the cgroup CPU quota. The arguments stand in for the real ones in tests: ``root`` for ``/`` (where
    /proc/self and the cgroup mounts are read), ``affinity`` for ``os.sched_getaffinity(0)``, ``host`` for
    ``os.cpu_count()``."""
    host = host or os.cpu_count() or 1
    if affinity is None and hasattr(os, "sched_getaffinity"):
        affinity = os.sched_getaffinity(0)
    found = [(float(host), f"{host} cores on the host")]
    if affinity is not None and len(affinity) < host:
        found.append((float(len(affinity)), f"{len(affinity)} CPUs in the affinity mask"))
    quota = cgroup_quota(root)
    if quota is not None:
        found.append(quota)
    cpus, _ = min(found, key=lambda item: item[0])
    return cpus, "; ".join(why for _, why in found)


def cgroup_quota(root: Path = Path("/")) -> tuple[float, str] | None:
    """The CPU quota of this process's cgroup and of its parents (the smallest: each limits all below it), as
    CPUs, with the file that set it; None without a quota or a readable cgroup. cgroup v2 (``cpu.max``) and v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) alike."""
    try:
        memberships = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for mount_point, inside, version in _cpu_cgroups(memberships, mounts):
        for depth in range(len(inside), -1, -1):  # the process's own cgroup first, then each parent up to the mount
            level = Path(mount_point, *inside[:depth])
            quota = _read_quota(root / level.relative_to("/"), version)
            if quota is not None:
                limits.append((quota, str(level / ("cpu.max" if version == 2 else "cpu.cfs_quota_us"))))
    if not limits:
        return None
    cpus, where = min(limits)
    return cpus, f"a CPU quota of {cpus:g} CPUs ({where})"


def _cpu_cgroups(
    memberships: list[str], mounts: list[str], controller: str = "cpu"
) -> list[tuple[str, tuple[str, ...], int]]:
    """Where this process's cpu (or ``controller``) cgroups are: (mount point, the cgroup's path below it, 2 for
    the unified hierarchy or 1 for v1's controller), from /proc/self/cgroup (``hierarchy:controllers:path``) and
    /proc/self/mountinfo (``... mount-root mount-point ... - fstype source super-options``)."""
    found = []
    for line in memberships:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = 2 if hierarchy == "0" and not controllers else 1
        if version == 1 and controller not in controllers.split(","):
            continue
        for mount in mounts:
            before, _, after = mount.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            if (version == 2 and tail[0] == "cgroup2") or (
                version == 1 and tail[0] == "cgroup" and controller in tail[2].split(",")
            ):
                mount_root, mount_point = fields[3], fields[4]
                # a cgroup namespace shows the process's path from its own root, which is then the mount's root
                inside = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
                found.append((mount_point, tuple(p for p in Path(inside).parts if p != "."), version))
                break
    return found


def _read_quota(directory: Path, version: int) -> float | None:
    """The quota set in ``directory`` in CPUs, or None where it sets none (``max``, ``-1``) or cannot be read."""
    try:
        if version == 2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1") or int(period) <= 0 or int(quota) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def available_memory(root: Path = Path("/")) -> tuple[int, str] | None:
    """Bytes this process may still allocate, and where that figure comes from; None when nothing says.

    The host's ``MemAvailable`` (/proc/meminfo), or less where a memory
    cgroup of this process or of a parent (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) leaves less above its usage: the kernel kills
    a process past its cgroup's limit whatever the host has free.
    """
    found = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
        memberships = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except (OSError, ValueError, IndexError):
        memberships = mounts = []
    for mount_point, inside, version in _cpu_cgroups(memberships, mounts, "memory"):
        for depth in range(len(inside), -1, -1):
            level = Path(mount_point, *inside[:depth])
            left = _memory_left(root / level.relative_to("/"), version)
            if left is not None:
                found.append((left, f"the memory cgroup limit of {level}"))
    return min(found) if found else None


def _memory_left(directory: Path, version: int) -> int | None:
    """What a memory cgroup's limit leaves above its usage, or None where it sets none or cannot be read."""
    limit_name, usage_name = ("memory.max", "memory.current") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes"
    )  # fmt: skip
    try:
        limit = (directory / limit_name).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2**63 - 1
            return None
        return max(0, int(limit) - int((directory / usage_name).read_text().strip()))
    except (OSError, ValueError):
        return None


def check_memory(needed: int, what: str, fix: str, error: type[UserError] = UserError) -> None:
    """Refuse, before allocating it, ``needed`` bytes that this process cannot have (`available_memory`):
    torch's allocator would fail with a traceback, or the kernel kill the process, after minutes of work.

    ``what`` says what would take them, ``fix`` what to change.
    """
    found = available_memory()
    if found is None or needed <= found[0]:
        return
    available, where = found
    raise error(f"{what} would take {_gb(needed)}, more than the {_gb(available)} of memory available ({where}); {fix}")


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def use_threads(requested: int = 0) -> Threads:
    """Choose the thread count (`choose_threads`) and give it to torch, whose pool has not started yet or is
    resized; returns the choice. Threads that run torch work later (`tmt serve`'s worker) take the same count
    at their first parallel region."""
    import torch

    threads = choose_threads(requested)
    torch.set_num_threads(threads.count)
    return threads
