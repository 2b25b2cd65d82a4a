"""Checkpoints: what one holds (`format`), its files (`io`), a run directory's (`run_dir`), the average of several
(`mean`). Callers import from here; one function per action: `write_checkpoint`, `read_checkpoint`,
`read_average`."""

from transformer_mt.checkpoint.format import (
    Batching,
    Checkpoint,
    CheckpointError,
    RngState,
    TrainingProgress,
    TrainingState,
    check_weights,
    from_state,
    to_state,
    weight_problem,
)
from transformer_mt.checkpoint.io import checkpoint_problem, read_checkpoint, strip_training_state, write_checkpoint
from transformer_mt.checkpoint.mean import read_average
from transformer_mt.checkpoint.run_dir import decoded_file, run_dir_checkpoint

__all__ = [
    "Batching",
    "Checkpoint",
    "CheckpointError",
    "RngState",
    "TrainingProgress",
    "TrainingState",
    "check_weights",
    "checkpoint_problem",
    "decoded_file",
    "from_state",
    "read_average",
    "read_checkpoint",
    "run_dir_checkpoint",
    "strip_training_state",
    "to_state",
    "weight_problem",
    "write_checkpoint",
]
