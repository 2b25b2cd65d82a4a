"""The files of a run directory, named in one place.

`tmt train` writes them, and resume, retention, `tmt average`, `tmt
evaluate`, the run lock, reports and the checkpoint reader find them by
these names; a change of name here changes it everywhere. Text (messages,
docs) may still spell them out for the reader.
"""

from __future__ import annotations

import re

CONFIG_NAME = "config.yaml"  # the resolved config the run trains with
METRICS_NAME = "metrics.jsonl"  # one JSON record per log line, validation and start/end (`transformer_mt.runs`)
BEST_NAME = "checkpoint_best.pt"  # the best validation checkpoint (train.best_metric)
AVERAGE_NAME = "average.pt"  # `tmt average`'s output by default
SCORES_NAME = "scores.json"  # `tmt evaluate`'s scores, in EVAL_PREFIX + test set name
EVAL_PREFIX = "eval_"  # `tmt evaluate -c RUN_DIR`'s output directories: eval_newstest2014, ...
LOCK_NAME = ".lock"  # held by the one trainer of the run (`transformer_mt.train.run_lock`)
CHECKPOINT_RE = re.compile(r"checkpoint_u(\d+)\.pt")  # a periodic checkpoint (fullmatch); the group is the update


def checkpoint_name(update: int) -> str:
    """``checkpoint_u0001200.pt``: zero-padded so that names sort like update numbers."""
    return f"checkpoint_u{update:07d}.pt"
