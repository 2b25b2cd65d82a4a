"""Checkpoint files: atomic writes, safe loads, names that sort by update, the resume search and retention.

A checkpoint is a dict of tensors and plain Python values only (see
docs/architecture.md), so it loads with ``torch.load(weights_only=True)``:
loading never runs code stored in the file. Writes go to a temporary file in
the same directory, are fsync'ed and then renamed over the target, so a crash
or a full disk leaves either the old file or the new one, never half of one.

A file that cannot be read (truncated or damaged after it was written) is never
counted as one of a run's checkpoints: resume, retention (``keep_last``) and
``tmt average --last`` pass over it with a warning that names it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch

from transformer_mt.files import atomic_open

CHECKPOINT_RE = re.compile(r"^checkpoint_u(\d+)\.pt$")
BEST_NAME = "checkpoint_best.pt"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read or written; the message names the file."""


def checkpoint_name(update: int) -> str:
    """``checkpoint_u0001200.pt``: zero-padded so that names sort like update numbers."""
    return f"checkpoint_u{update:07d}.pt"


def checkpoint_update(path: Path) -> int | None:
    """The update number in a periodic checkpoint's name, or None for any other file."""
    match = CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Periodic checkpoints of a run, oldest update first (never the best or averaged files)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(u, p) for p in run_dir.iterdir() if (u := checkpoint_update(p)) is not None and p.is_file()]
    return [p for _, p in sorted(found)]


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (`transformer_mt.files.atomic_open`): a crash keeps the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(path) as f:
            torch.save(state, f)
    except Exception as err:
        raise CheckpointError(f"{path}: could not write the checkpoint ({err}); check free disk space") from err


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint onto the CPU without unpickling code; CheckpointError names a bad file."""
    return _read(Path(path), mmap=False)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a readable checkpoint (the CheckpointError message), or None when it is.

    Cheap enough to run on every kept checkpoint at every save: the file is
    memory-mapped, so only its zip directory and the pickled structure are
    read, not the tensors: about 50 ms for a 750 MB checkpoint of the base
    model with its Adam state (a full load: seconds). It catches what
    `load_checkpoint` rejects: truncated, empty or foreign files, pickles with
    code, no 'model' entry.
    """
    try:
        _read(Path(path), mmap=True)
    except CheckpointError as err:
        return str(err)
    return None


def _read(path: Path, mmap: bool) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad magic, foreign pickle: all mean "not a usable checkpoint"
        raise CheckpointError(
            f"{path}: not a readable checkpoint ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "the file is truncated or corrupt: delete it, or pick another checkpoint of the run"
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a tmt checkpoint (no 'model' entry); was it written by `tmt train`?")
    return state


def newest_readable(run_dir: str | Path, k: int) -> list[Path]:
    """The newest ``k`` readable periodic checkpoints, oldest first; each unreadable one passed over is warned about.

    Walks from the newest down and stops at the k-th readable file, so only
    those and the unreadable ones among them are checked (`checkpoint_problem`).
    """
    kept: list[Path] = []
    for path in reversed(list_checkpoints(run_dir)):
        if len(kept) == k:
            break
        problem = checkpoint_problem(path)
        if problem is None:
            kept.append(path)
        else:
            print(f"warning: skipping {problem}", file=sys.stderr)
    return kept[::-1]


def find_resume_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable periodic checkpoint of a run and its state; unreadable ones are skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as err:
            print(f"warning: skipping {err}", file=sys.stderr)
    return None


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Keep the newest ``keep_last`` readable periodic checkpoints (0 keeps all); returns the deleted paths.

    An unreadable file never counts toward ``keep_last``, so it can never push
    a good checkpoint out: one among the kept ones stays (warned about, for
    the user to look at), one older than all of them goes with the old
    checkpoints. Nothing is deleted while fewer than ``keep_last`` readable
    checkpoints exist.
    """
    if keep_last <= 0:
        return []
    kept = newest_readable(run_dir, keep_last)
    if len(kept) < keep_last:
        return []
    found = list_checkpoints(run_dir)
    old = found[: found.index(kept[0])]
    for path in old:
        path.unlink(missing_ok=True)
    return old
