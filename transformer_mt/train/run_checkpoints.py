"""The checkpoints of a run directory: names that sort by update, the resume search and retention.

What one file holds and how it is read and written safely is
`transformer_mt.checkpoint`. A file that cannot be read, or that is not a
checkpoint `read_checkpoint` accepts, is never counted as one of a run's
checkpoints: resume, retention (``keep_last``) and ``tmt average --last``
pass over it with a warning that names it.

Only the newest periodic checkpoint and ``checkpoint_best.pt`` keep the
training state (optimizer, RNG, scaler, batching): older ones are stripped
(`strip_older_checkpoints`) once a newer one is on disk and reads back, so
that at every moment one resumable checkpoint exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformer_mt.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_problem,
    read_checkpoint,
    strip_training_state,
)
from transformer_mt.run_names import BEST_NAME, CHECKPOINT_RE


def checkpoint_update(path: Path) -> int | None:
    """The update number in a periodic checkpoint's name, or None for any other file."""
    match = CHECKPOINT_RE.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Periodic checkpoints of a run, oldest update first (never the best or averaged files)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(u, p) for p in run_dir.iterdir() if (u := checkpoint_update(p)) is not None and p.is_file()]
    return [p for _, p in sorted(found)]


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


def find_resume_checkpoint(run_dir: str | Path, look: bool = False) -> tuple[Path, Checkpoint] | None:
    """The checkpoint a run resumes from: its newest readable periodic one, or checkpoint_best.pt in its stead.

    Unreadable periodic checkpoints are skipped with a warning. The one found
    then holds only weights when the newer ones are unreadable (older ones are
    stripped); the best checkpoint keeps its training state and takes over if
    it is at least as new, so no readable checkpoint is newer than the point
    the run resumes from. Otherwise the weights-only one is returned, for the
    trainer to refuse with advice. ``look``: only to name it (the Ctrl-C
    hint): files memory-mapped, no warnings.
    """
    found = _newest_readable(run_dir, look)
    if found is None or found[1].training is not None or found[1].averaged_from:  # an average is refused
        return found
    best = Path(run_dir) / BEST_NAME
    try:
        ck = read_checkpoint(best, mmap=look) if best.is_file() else None
    except CheckpointError as err:
        if not look:
            print(f"warning: skipping {err}", file=sys.stderr)
        return found
    if ck is not None and ck.training is not None and ck.progress.update >= (checkpoint_update(found[0]) or 0):
        return best, ck
    return found


def _newest_readable(run_dir: str | Path, look: bool = False) -> tuple[Path, Checkpoint] | None:
    """The newest periodic checkpoint that reads; unreadable ones are skipped with a warning (``look``: quietly,
    memory-mapped)."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, read_checkpoint(path, mmap=look)
        except CheckpointError as err:
            if not look:
                print(f"warning: skipping {err}", file=sys.stderr)
    return None


def strip_older_checkpoints(run_dir: str | Path, newest: Path) -> list[Path]:
    """Drop the training state of every periodic checkpoint but ``newest``, once ``newest`` reads back.

    Called after each periodic save. Until ``newest`` is checked nothing is
    touched, and each file is rewritten atomically, so a kill at any point
    leaves a resumable run: either two checkpoints with training state (the
    next save strips the older) or one. Returns the stripped paths.
    """
    if checkpoint_problem(newest) is not None:
        return []
    return [path for path in list_checkpoints(run_dir) if path != newest and strip_training_state(path)]


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
