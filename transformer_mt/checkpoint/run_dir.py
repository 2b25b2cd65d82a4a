"""A run directory where one checkpoint file is meant: the file ``-c RUN_DIR`` decodes with, and the error that
names the files a user most likely meant when a directory is passed where a file must be."""

from __future__ import annotations

from pathlib import Path

from transformer_mt.run_names import AVERAGE_NAME, BEST_NAME

RUN_DIR_CHOICES = (AVERAGE_NAME, BEST_NAME)  # what ``-c RUN_DIR`` decodes with, in this order


def run_dir_checkpoint(path: Path) -> Path | None:
    """The checkpoint ``-c RUN_DIR`` stands for in the decode commands: the run's average.pt, else its
    checkpoint_best.pt; None when ``path`` is no directory or holds neither."""
    if not path.is_dir():
        return None
    return next((path / name for name in RUN_DIR_CHOICES if (path / name).is_file()), None)


def decoded_file(path: Path) -> Path:
    """The resolved file ``-c path`` decodes: what `tmt evaluate` records in scores.json, so that the model card of
    `tmt export hf -c RUN_DIR/average.pt` finds scores of ``-c RUN_DIR``. A record of an older tmt names the
    directory; read through this it names the file the directory stands for now."""
    return (run_dir_checkpoint(path) or path).resolve()


def directory_message(path: Path) -> str:
    """A directory where one checkpoint file is needed: name the files of it a user most likely meant."""
    found = [path / name for name in RUN_DIR_CHOICES if (path / name).is_file()]
    if found:
        return f"{path} is a directory, not a checkpoint file; did you mean {' or '.join(map(str, found))}?"
    return (
        f"{path} is a directory, not a checkpoint file; pass one of its checkpoint_u*.pt, or average its newest "
        f"first: tmt average {path}"
    )
