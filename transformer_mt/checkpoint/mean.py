"""The average of several checkpoints: what `tmt average` writes and `tmt translate -c A -c B` translates with.

Averaging the weights of a run's last checkpoints is the paper's recipe for
its base and big models; only checkpoints of one model and one BPE model can
be averaged, which is checked input by input with the file at fault named.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from transformer_mt.checkpoint.format import Checkpoint, CheckpointError, TrainingProgress
from transformer_mt.checkpoint.io import read_checkpoint
from transformer_mt.config import Config
from transformer_mt.errors import shown


def read_average(paths: Sequence[str | Path]) -> Checkpoint:
    """The checkpoint of ``paths``: what `tmt average` writes and `tmt translate -c A -c B` translates with.

    Floating-point tensors are averaged in float64 and cast back to their
    dtype; integer buffers must be equal and are copied. All inputs must have
    the same parameter names and shapes and the same BPE model. Config, BPE
    model and update come from the newest input (highest update); no training
    state is kept. One path gives that checkpoint's model as it is, with its word
    aligner (`transformer_mt.decode.aligner`), which a mean of several drops.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise CheckpointError("no checkpoints to average")
    single = len(paths) == 1  # the mean of one checkpoint is itself: no float64 copy needed
    sums: dict[str, torch.Tensor] = {}
    first: tuple[dict[str, torch.Tensor], bytes] = ({}, b"")  # the first input's model and BPE model
    aligner = None  # one input's word aligner: it was trained on that model's states, not on a mean
    newest: tuple[int, Config, bytes] = (-1, Config(), b"")  # update, config, BPE model
    for i, path in enumerate(paths):
        ck = read_checkpoint(path)
        if i == 0:
            first, sums = (ck.model, ck.spm_model), dict(ck.model) if single else _float64_copy(ck.model)
            aligner = ck.aligner if single else None
        else:
            _check_same_model(*first, ck, paths[0], path)
            _accumulate(sums, ck.model, paths[0], path)
        if ck.progress.update > newest[0]:
            newest = (ck.progress.update, ck.config, ck.spm_model)
        del ck  # one input's weights (and optimizer state) in memory at a time, besides the sums
    model = sums if single else _mean(sums, first[0], len(paths))
    update, config, spm_model = newest
    return Checkpoint(
        model, config, spm_model, TrainingProgress(update=update), averaged_from=[str(p) for p in paths],
        aligner=aligner,
    )  # fmt: skip


def _check_same_model(
    ref: dict[str, torch.Tensor], ref_spm: bytes, other: Checkpoint, ref_path: Path, path: Path
) -> None:
    """Same parameter names and shapes, and the same BPE model: averaged embeddings must number tokens alike."""
    missing, extra = sorted(set(ref) - set(other.model)), sorted(set(other.model) - set(ref))
    if missing or extra:
        where = f"lacks key '{missing[0]}'" if missing else f"has extra key {shown(extra[0])}"
        raise CheckpointError(
            f"{path}: {where} compared with {ref_path}; only checkpoints of the same model can be averaged"
        )
    for key, tensor in ref.items():
        if other.model[key].shape != tensor.shape:
            raise CheckpointError(
                f"{path}: key '{key}' has shape {tuple(other.model[key].shape)}, but {tuple(tensor.shape)} in "
                f"{ref_path}; only checkpoints of the same model can be averaged"
            )
        if other.model[key].is_floating_point() != tensor.is_floating_point():
            raise CheckpointError(
                f"{path}: key '{key}' holds {other.model[key].dtype}, but {tensor.dtype} in {ref_path}; only "
                "checkpoints of the same model can be averaged"
            )
    if other.spm_model != ref_spm:
        raise CheckpointError(
            f"{path}: a different BPE model (spm_model) than {ref_path}; average checkpoints of one run only"
        )


def _accumulate(sums: dict[str, torch.Tensor], model: dict[str, torch.Tensor], ref_path: Path, path: Path) -> None:
    """Add floating-point tensors into the float64 sums; integer buffers must equal the first input's."""
    for key, tensor in model.items():
        if tensor.is_floating_point():
            sums[key] += tensor.to(torch.float64)
        elif not torch.equal(tensor, sums[key]):
            raise CheckpointError(f"{path}: integer buffer '{key}' differs from {ref_path}; cannot average it")


def _float64_copy(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating-point tensors as float64 accumulators; integer buffers copied as they are."""
    return {k: v.to(torch.float64).clone() if v.is_floating_point() else v.clone() for k, v in model.items()}


def _mean(sums: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Sums divided by ``n`` and cast back to each tensor's dtype in ``ref``; integer buffers unchanged."""
    return {k: (total / n).to(ref[k].dtype) if ref[k].is_floating_point() else total for k, total in sums.items()}
