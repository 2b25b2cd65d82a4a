"""`tmt average` (the paper: base model, last 5 checkpoints written 10 minutes apart; big, last 20).

Which checkpoints of a run to average, and the averaged file written; the
mean itself (float64 sums, cast back to each tensor's dtype) is
`transformer_mt.checkpoint.read_average`, which `tmt translate` uses too. The
output is a checkpoint `tmt translate` loads like any other.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from transformer_mt.checkpoint import Checkpoint, read_average, write_checkpoint
from transformer_mt.config import ConfigError, TrainConfig, load_config
from transformer_mt.decode.load import check_loadable
from transformer_mt.errors import UserError
from transformer_mt.run_names import CONFIG_NAME
from transformer_mt.train.run_checkpoints import list_checkpoints, newest_readable


class AverageError(UserError):
    """Checkpoints that cannot be averaged; the message names the file and, where it applies, the key."""


def last_checkpoints(run_dir: str | Path, k: int) -> list[Path]:
    """The newest ``k`` readable periodic checkpoints of a run by update number, oldest first.

    Never the best or averaged files; an unreadable file is passed over with a
    warning naming it, and the next older one taken instead. Fewer than ``k``
    readable: all of them, with a warning.
    """
    if k < 1:
        raise AverageError(f"--last must be at least 1, got {k}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AverageError(f"{run_dir}: no such run directory")
    if not list_checkpoints(run_dir):
        raise AverageError(f"{run_dir}: no checkpoint_u*.pt files to average; has `tmt train` written any yet?")
    found = newest_readable(run_dir, k)
    if not found:
        raise AverageError(f"{run_dir}: no readable checkpoint_u*.pt file (see the warnings above); nothing to average")
    if len(found) < k:
        print(
            f"warning: {run_dir} holds {len(found)} readable checkpoints, fewer than --last {k}; averaging all of them",
            file=sys.stderr,
        )
    return found


def default_last(run_dir: str | Path) -> int:
    """The run's ``train.average_last`` from its config.yaml (5, the paper's base setting, when there is none)."""
    path = Path(run_dir) / CONFIG_NAME
    if not path.is_file():
        return TrainConfig.average_last
    try:
        return load_config(path).train.average_last
    except ConfigError as err:
        raise AverageError(f"{path}: {err}; pass --last K") from None


def average_checkpoints(paths: Sequence[str | Path], out: str | Path) -> Checkpoint:
    """`read_average` of ``paths`` written to ``out`` (atomically); returns what was written.

    The mean is checked as `tmt translate` would load it first (`check_loadable`): inputs that agree with each
    other but not with their config (integer weights, a missing layer) are refused before anything is written.
    """
    result = read_average(paths)
    check_loadable(result, Path(paths[0]))
    write_checkpoint(out, result)
    return result
