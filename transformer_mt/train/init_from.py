"""`train.init_from`: fine-tuning, a new run that starts from another checkpoint's weights.

Only the weights carry over. The optimizer starts empty (Adam's moments of
the old run belong to its data and its learning rate), the schedule and the
update count start from 0 (warmup included), and the data order is the new
run's own. What cannot differ is what the weights are bound to: the
vocabulary (one row per BPE piece, so the same sentencepiece model, byte for
byte) and the shape of the model; dropout, the data and every training key
may change. New data gets the checkpoint's vocabulary through ``bpe.model``
(`tmt export spm` writes the model out of the checkpoint).

A run that resumes (its train.save_dir holds checkpoints) continues from its
own newest checkpoint and ignores `train.init_from`: the trainer says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import Tensor, nn

from transformer_mt.checkpoint import Checkpoint, read_checkpoint
from transformer_mt.config import ModelConfig
from transformer_mt.train.step import TrainError

# Model keys that change no weight's shape: they may differ between the checkpoint and the fine-tuning run.
FREE_MODEL_KEYS = ("dropout", "attention_dropout", "activation_dropout", "init")


def load_init_weights(module: nn.Module, path: Path, model_cfg: ModelConfig, spm_model: bytes, spm_path: Path) -> int:
    """Load the weights of checkpoint ``path`` into ``module``; returns the update it was written at.

    ``spm_model`` is this run's BPE model (the bytes of ``spm_path``, in
    data.dir): the checkpoint's must be the same. A missing file, another
    vocabulary or another model shape is a TrainError naming the files and the fix.
    """
    if not path.is_file():
        raise TrainError(
            f"train.init_from: {path} does not exist; give a checkpoint of `tmt train` or `tmt average`, or "
            "train.init_from='' to start from random weights"
        )
    ck = read_checkpoint(path)  # a damaged file: CheckpointError naming it and the entry
    if ck.spm_model != spm_model:
        raise TrainError(
            f"train.init_from: {path} was trained with another BPE vocabulary than {spm_path}, this run's "
            f"(data.dir); the weights hold one row per BPE piece, so fine-tuning needs the checkpoint's own "
            f"sentencepiece model: train on data prepared with it (the checkpoint's data.dir was "
            f"{ck.config.data.dir!r}; for another corpus, `tmt export spm -c {path} -o spm.model` and "
            f"--set bpe.model=spm.model), or set train.init_from=''"
        )
    mismatch = shape_mismatch(ck.model, module.state_dict())
    if mismatch:
        raise TrainError(
            f"train.init_from: {path} holds a model of another shape than this config's "
            f"({_model_differences(ck, model_cfg) or mismatch}); set the model section to the checkpoint's "
            f"(only {', '.join(f'model.{k}' for k in FREE_MODEL_KEYS)} may differ)"
        )
    module.load_state_dict(ck.model)
    return ck.progress.update


def shape_mismatch(found: dict[str, Tensor], expected: dict[str, Tensor]) -> str:
    """The first weights of ``found`` missing from, extra to or shaped unlike ``expected``; "" when they fit."""
    problems = [f"{name} missing" for name in expected if name not in found]
    problems += [f"{name} unexpected" for name in found if name not in expected]
    problems += [
        f"{name} {tuple(found[name].shape)} instead of {tuple(shape.shape)}"
        for name, shape in expected.items()
        if name in found and found[name].shape != shape.shape
    ]
    return "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")


def _model_differences(ck: Checkpoint, model_cfg: ModelConfig) -> str:
    """The model keys that decide shapes and differ: ``model.d_model 512 there, 256 here; ...``."""
    saved = ck.config.model
    return "; ".join(
        f"model.{f.name} {getattr(saved, f.name)!r} there, {getattr(model_cfg, f.name)!r} here"
        for f in dataclasses.fields(model_cfg)
        if f.name not in FREE_MODEL_KEYS and getattr(saved, f.name) != getattr(model_cfg, f.name)
    )
