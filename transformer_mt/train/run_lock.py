"""One trainer per run directory: a lock on ``save_dir/.lock``, held by rank 0 for the whole run.

Two trainers writing one ``save_dir`` would overwrite and prune each other's
checkpoints and lose each other's metrics, so the second one is refused before
it writes anything. The lock is ``fcntl.flock`` on ``save_dir/.lock``: the
kernel releases it when its holder exits in any way, ``kill -9`` included, so
a lock left by a dead trainer is never mistaken for a live one and needs no
PID test or timeout. The file holds the holder's PID, host and start time, to
name it in the refusal; a clean exit empties it, so finding it non-empty but
unlocked means its holder died, which is reported as a note when the lock is
taken over.

On NFS, Linux implements ``flock`` with the server's byte-range locks (NFSv4,
or NFSv3 with lockd), so the lock holds across hosts too. A mount with
``nolock`` or ``local_lock=flock|all`` keeps locks on one host; the takeover
note then names the other host, so a run started there by mistake shows up.

Under torchrun only rank 0 takes the lock; the other ranks learn through one
all-reduce whether it could, so every rank stops with the same error.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer_mt.files import remove_leftovers
from transformer_mt.run_names import BEST_NAME, CHECKPOINT_RE, CONFIG_NAME, LOCK_NAME, METRICS_NAME
from transformer_mt.train.distributed import DistEnv, all_reduce_sum
from transformer_mt.train.step import TrainError

# The files a trainer writes atomically in save_dir: a temporary file of one of them is a killed save's
# leftover once the lock is ours. Not average.pt: `tmt average` may be writing it right now.
TRAINER_FILES = re.compile("|".join([CHECKPOINT_RE.pattern, *map(re.escape, (BEST_NAME, CONFIG_NAME, METRICS_NAME))]))
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass
class RunLock:
    """The lock on one run directory, held through an open descriptor until `release`."""

    path: Path
    fd: int

    @classmethod
    def take(cls, save_dir: Path) -> RunLock:
        """Lock ``save_dir`` (created if needed) or raise TrainError naming the trainer that holds it."""
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a full disk, a file in the way, no permission
            raise TrainError(
                f"{save_dir}: cannot create the run directory ({err.strerror}); free space on that disk or set "
                "train.save_dir to a directory you can write"
            ) from None
        path = save_dir / LOCK_NAME
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            previous = _read_holder(fd)
            _write_holder(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()})
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            raise _refusal(save_dir, path, holder, err) from None
        if previous:
            print(f"note: {_takeover_note(path, previous)}", file=sys.stderr)
        return cls(path, fd)

    def release(self) -> None:
        """Empty the holder record (a clean exit) and unlock; closing the descriptor releases the flock."""
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)


@contextmanager
def hold_run_dir(save_dir: Path, env: DistEnv) -> Iterator[None]:
    """Hold ``save_dir``'s lock for the body (rank 0), after removing what killed saves left behind.

    Every rank calls it: the lock's outcome is shared by one all-reduce, so
    when rank 0 is refused every rank raises, and no rank touches the run.
    """
    lock: RunLock | None = None
    error: Exception | None = None
    if env.is_main:
        try:
            lock = RunLock.take(save_dir)
            _remove_leftovers(save_dir)
        except Exception as err:  # tell the waiting ranks before raising, whatever went wrong
            error = err
            if lock is not None:
                lock.release()
    (failed,) = all_reduce_sum([1.0 if error else 0.0], env)
    if error is not None:
        raise error
    if failed:
        raise TrainError(f"rank 0 could not lock {save_dir} (its message says why)")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _remove_leftovers(save_dir: Path) -> None:
    """Temporary files of saves that a kill interrupted: safe to delete now that no other trainer writes here."""
    removed = remove_leftovers(save_dir, TRAINER_FILES)
    if removed:
        names = ", ".join(p.name for p in removed)
        print(f"note: removed {len(removed)} temporary file(s) left by an interrupted save: {names}", file=sys.stderr)


def _open(path: Path) -> int:
    """The lock file's descriptor, created if needed; a link planted at its name is refused, never followed."""
    try:
        return os.open(path, _OPEN_FLAGS, 0o644)
    except OSError as err:
        raise TrainError(
            f"{path}: cannot open the run's lock file ({err.strerror}); check train.save_dir and its permissions"
        ) from None


def _refusal(save_dir: Path, path: Path, holder: dict[str, Any], err: OSError) -> TrainError:
    """The error for a lock not taken: another holder (named), a file system without locks, or no disk space."""
    if err.errno == errno.ENOLCK:
        return TrainError(
            f"{path}: cannot lock the run directory ({err.strerror}); put train.save_dir on a file system "
            "with working locks (NFS needs lockd or NFSv4)"
        )
    if not isinstance(err, BlockingIOError):
        return TrainError(f"{path}: cannot record this run in its lock file ({err}); check free disk space")
    return TrainError(
        f"{save_dir} is in use by another `tmt train` ({_describe(holder)}); wait for it to end or stop it, "
        "or give this run another train.save_dir"
    )


def _takeover_note(path: Path, previous: dict[str, Any]) -> str:
    note = f"taking over {path} from {_describe(previous)}, which ended without releasing it (killed?)"
    if previous.get("host") not in (None, socket.gethostname()):
        note += (
            "; if that process still runs on its host, this file system does not share locks between hosts "
            "(NFS mounted nolock or local_lock): stop one of the two"
        )
    return note


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder not yet recorded: it is starting"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('started')}"


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder record in the lock file, {} when empty or unreadable (a holder between truncate and write)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_holder(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")
