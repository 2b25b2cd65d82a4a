"""The checkpoints of a run directory: names that sort by update, the resume search and retention.

What one file holds and how it is read and written safely is
`transformer_mt.checkpoint`. A file that cannot be read, or that is not a
checkpoint `read_checkpoint` accepts, is never counted as one of a run's
checkpoints: resume, retention (``keep_last``) and ``tmt average --last``
pass over it with a warning that names it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from transformer_mt.checkpoint import Checkpoint, CheckpointError, checkpoint_problem, read_checkpoint

CHECKPOINT_RE = re.compile(r"^checkpoint_u(\d+)\.pt$")
BEST_NAME = "checkpoint_best.pt"


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


def find_resume_checkpoint(run_dir: str | Path) -> tuple[Path, Checkpoint] | None:
    """The newest readable periodic checkpoint of a run; unreadable ones are skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, read_checkpoint(path)
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
