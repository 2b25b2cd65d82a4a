"""Checkpoint averaging (the paper: base model, last 5 checkpoints written 10 minutes apart; big, last 20).

Parameters are summed in float64 so that averaging many fp32 (or bf16)
checkpoints loses nothing to rounding, then cast back to each tensor's dtype.
The output is a checkpoint `tmt translate` loads like any other.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from transformer_mt.config import ConfigError, TrainConfig, load_config
from transformer_mt.train.checkpoint import (
    CheckpointError,
    checkpoint_update,
    list_checkpoints,
    load_checkpoint,
    newest_readable,
    save_checkpoint,
)


class AverageError(RuntimeError):
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
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return TrainConfig.average_last
    try:
        return load_config(path).train.average_last
    except ConfigError as err:
        raise AverageError(f"{path}: {err}; pass --last K") from None


def _load(path: Path) -> dict[str, Any]:
    try:
        return load_checkpoint(path)
    except CheckpointError as err:
        raise AverageError(str(err)) from None


def _check_same_keys(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor], ref_path: Path, path: Path) -> None:
    missing = sorted(set(ref) - set(other))
    extra = sorted(set(other) - set(ref))
    if missing or extra:
        key = (missing or extra)[0]
        where = f"lacks key '{key}'" if missing else f"has extra key '{key}'"
        raise AverageError(
            f"{path}: {where} compared with {ref_path}; only checkpoints of the same model can be averaged"
        )
    for key, tensor in ref.items():
        if other[key].shape != tensor.shape:
            raise AverageError(
                f"{path}: key '{key}' has shape {tuple(other[key].shape)}, but {tuple(tensor.shape)} in {ref_path}; "
                "only checkpoints of the same model can be averaged"
            )


def _check_same_bpe(ref: torch.Tensor | None, other: torch.Tensor | None, ref_path: Path, path: Path) -> None:
    """Averaged embeddings only mean something when every input numbers its tokens the same way."""
    if ref is None and other is None:
        return
    if ref is None or other is None or not torch.equal(ref, other):
        raise AverageError(
            f"{path}: a different BPE model (spm_model) than {ref_path}; average checkpoints of one run only"
        )


def _float64_copy(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating-point tensors as float64 accumulators; integer buffers copied as they are."""
    return {k: v.to(torch.float64).clone() if v.is_floating_point() else v.clone() for k, v in model.items()}


def _mean(sums: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Sums divided by ``n`` and cast back to each tensor's dtype in ``ref``; integer buffers unchanged."""
    return {k: (total / n).to(ref[k].dtype) if ref[k].is_floating_point() else total for k, total in sums.items()}


def average_states(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The averaged checkpoint of ``paths`` as a dict (nothing written): what `tmt average` saves.

    Floating-point tensors are averaged in float64 and cast back; integer
    buffers must be equal and are copied. All inputs must have the same
    parameter names and shapes and the same BPE model (``spm_model``). The
    config, BPE model and update number come from the newest input (highest
    update); optimizer and other training state are left out.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise AverageError("no checkpoints to average")
    single = len(paths) == 1  # the mean of one checkpoint is itself: no float64 copy needed
    sums: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    ref_spm: torch.Tensor | None = None
    newest_meta: dict[str, Any] = {}
    best_update = -1
    for path in paths:
        state = _load(path)
        model = state["model"]
        if not ref:
            ref, ref_spm = dict(model), state.get("spm_model")
            sums = dict(model) if single else _float64_copy(model)
        else:
            _check_same_keys(ref, model, paths[0], path)
            _check_same_bpe(ref_spm, state.get("spm_model"), paths[0], path)
            for key, tensor in model.items():
                if tensor.is_floating_point():
                    sums[key] += tensor.to(torch.float64)
                elif not torch.equal(tensor, sums[key]):
                    raise AverageError(f"{path}: integer buffer '{key}' differs from {paths[0]}; cannot average it")
        update = int(state.get("update", checkpoint_update(path) or 0))
        if update > best_update:
            best_update = update
            newest_meta = {k: state[k] for k in ("config", "spm_model") if k in state}
        del state, model
    averaged = sums if single else _mean(sums, ref, len(paths))
    return {"model": averaged, **newest_meta, "update": best_update, "averaged_from": [str(p) for p in paths]}


def average_checkpoints(paths: Sequence[str | Path], out: str | Path) -> dict[str, Any]:
    """`average_states` of ``paths`` saved at ``out`` (written atomically); returns the written state."""
    result = average_states(paths)
    try:
        save_checkpoint(out, result)
    except CheckpointError as err:
        raise AverageError(str(err)) from None
    return result
