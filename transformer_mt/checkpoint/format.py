"""What a checkpoint holds (`Checkpoint`), how it is stored as a dict, and the checks of every stored entry.

Training writes checkpoints, `tmt average` and `tmt translate` read them, so
their fields are spelled here once. On disk a checkpoint is a dict of tensors
and plain Python values only (`to_state`), so it loads with
``torch.load(weights_only=True)``: loading never runs code stored in the
file. `from_state` checks every entry it reads, so a damaged or crafted file
is refused with its name and the entry at fault rather than a traceback.
Entries added over time (``minutes``, ``batching``, validation BLEU and the
patience count) are optional with defaults, so older checkpoints still load.
The ``config``, ``rng`` and ``batching`` entries are dicts on disk and typed
in memory (`Config`, `RngState`, `Batching`): they are converted here only,
in `to_state` and `from_state`.
A run keeps the `TrainingState` only in its newest checkpoint and its best
(`strip_training_state`): it triples a file's size, and only resuming needs it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt.config import Config, ConfigError, config_from_dict
from transformer_mt.errors import UserError, shown


class CheckpointError(UserError):
    """A checkpoint file that cannot be read, written or averaged; the message names the file (and the entry)."""


@dataclass
class TrainingProgress:
    """Where a run is: what a checkpoint holds, besides weights and optimizer, to resume exactly."""

    update: int = 0  # optimizer steps taken (skipped non-finite updates do not count)
    epoch: int = 1  # counted from 1
    batch_in_epoch: int = 0  # batches of this rank's share of the epoch already consumed (same on every rank)
    best_valid_loss: float = math.inf
    valid_loss: float | None = None  # label-smoothed loss per target token (nats) at the last validation
    valid_update: int = -1  # update of the last validation
    minutes: float = 0.0  # wall-clock minutes trained before this process (train.max_minutes counts them too)
    valid_history: list[list[float]] = field(default_factory=list)  # [update, nll] of the last 12 validations
    valid_bleu: float | None = None  # sacreBLEU at the last validation (train.valid_bleu_sentences)
    best_valid_bleu: float = -math.inf
    stale_validations: int = 0  # validations in a row without a new best train.best_metric (train.patience)


@dataclass
class RngState:
    """Every rank's torch generator states at a save (`train.run_files.rng_state`), and how many ranks wrote them."""

    world_size: int
    torch_cpu: list[torch.Tensor]  # one CPU generator state per rank
    torch_cuda: list[torch.Tensor] | None = None  # one CUDA generator state per rank; None when trained on CPU

    def to_dict(self) -> dict[str, Any]:
        """The 'rng' entry on disk (no ``torch_cuda`` key without CUDA)."""
        entry: dict[str, Any] = {"world_size": self.world_size, "torch_cpu": self.torch_cpu}
        return entry if self.torch_cuda is None else {**entry, "torch_cuda": self.torch_cuda}


@dataclass(frozen=True)
class Batching:
    """What decides an epoch's batch order besides the epoch and the world size (`train.run_files.batching_key`),
    with the number of batches per rank of the epoch a checkpoint was saved in."""

    max_tokens: int  # train.max_tokens
    seed: int  # train.seed
    max_len: int  # the longest sentence trained on
    sentences: int  # the training data's sentence pairs
    lengths: str  # a digest of their lengths in tokens
    batches: int = 0  # the saved epoch's batches per rank; 0 in a run's own key, which no epoch is part of
    sampling_alpha: float = 0.0  # bpe.sampling_alpha; stored only when > 0 (older checkpoints have none)

    def to_dict(self) -> dict[str, Any]:
        """The 'batching' entry on disk."""
        entry = dataclasses.asdict(self)
        if not self.sampling_alpha > 0:
            del entry["sampling_alpha"]
        return entry


@dataclass
class TrainingState:
    """What only resuming needs besides `TrainingProgress`; an averaged checkpoint has none."""

    optimizer: dict[str, Any]  # the optimizer's state_dict
    rng: RngState
    scaler: dict[str, Any] = field(default_factory=dict)  # the fp16 loss scaler's state; {} when unused
    batching: Batching | None = None  # None in checkpoints written before it was kept


@dataclass
class Checkpoint:
    """A model with what it takes to translate (config, BPE model) and, from training, to resume."""

    model: dict[str, torch.Tensor]  # the model's state_dict
    config: Config  # the run's config; on disk `Config.to_dict()`
    spm_model: bytes  # the sentencepiece model file: translation needs no data directory
    progress: TrainingProgress = field(default_factory=TrainingProgress)  # only ``update`` without ``training``
    training: TrainingState | None = None
    averaged_from: list[str] = field(default_factory=list)  # the input files of `tmt average`
    # a word aligner trained for this model's states (`tmt train-aligner`): weights, shape, validation figures
    aligner: dict[str, Any] | None = None


def to_state(ck: Checkpoint) -> dict[str, Any]:
    """The dict stored on disk: tensors and plain values only; a checkpoint without training state stores less."""
    spm = torch.from_numpy(np.frombuffer(ck.spm_model, dtype=np.uint8).copy())
    config = ck.config.to_dict()
    state: dict[str, Any] = {"model": ck.model, "config": config, "spm_model": spm, "update": ck.progress.update}
    if not ck.averaged_from:  # an average has no place in a run; a stripped checkpoint keeps its minutes and figures
        state.update({f.name: getattr(ck.progress, f.name) for f in dataclasses.fields(TrainingProgress)})
    if ck.training is not None:  # shallow: `dataclasses.asdict` would deep-copy the optimizer's tensors
        t = ck.training
        state.update(optimizer=t.optimizer, rng=t.rng.to_dict(), scaler=t.scaler)
        state["batching"] = None if t.batching is None else t.batching.to_dict()
    if ck.averaged_from:
        state["averaged_from"] = list(ck.averaged_from)
    if ck.aligner is not None:
        state["aligner"] = ck.aligner
    return state


def from_state(state: Any, path: str | Path) -> Checkpoint:
    """The `Checkpoint` of a stored dict, every entry checked; CheckpointError names ``path`` and the entry."""
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a tmt checkpoint (no 'model' entry); was it written by `tmt train`?")
    model = _entry(state, "model", dict, path)
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise CheckpointError(f"{path}: the 'model' entry is not a state dict (names to tensors); {_NOT_TMT}")
    for key, tensor in model.items():
        problem = weight_problem(tensor)
        if problem:
            raise CheckpointError(f"{path}: the 'model' entry's {shown(key)} {problem}; {_NOT_TMT}")
    spm = _entry(state, "spm_model", torch.Tensor, path)
    if spm.dtype != torch.uint8 or spm.dim() != 1 or spm.numel() == 0:
        raise CheckpointError(f"{path}: the 'spm_model' entry is not the bytes of a BPE model; {_NOT_TMT}")
    training = _training(state, path) if "optimizer" in state else None
    config = _config(state, path)
    progress = _progress(state, path, resumable=training is not None)
    _check_epoch(progress, config, path)
    return Checkpoint(
        model=model,
        config=config,
        spm_model=spm.numpy().tobytes(),
        progress=progress,
        training=training,
        averaged_from=[str(p) for p in _entry(state, "averaged_from", list, path, default=[])],
        aligner=_aligner(state, path) if "aligner" in state else None,
    )


def weight_problem(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be a weight, as the end of a sentence about it; None when it can.

    tmt writes dense tensors of real numbers only (floats; integers for a
    buffer, which averaging copies). A sparse or meta-device tensor, or one
    of booleans, complex or quantized numbers, passes a shape check and then
    fails far away: in ``load_state_dict`` with a size mismatch, in
    averaging's additions, at the first step of a resumed run. The device is
    read after ``map_location="cpu"``: only meta stays elsewhere. Integers
    where the model has floats are `check_weights`' to refuse.
    """
    if tensor.layout != torch.strided:
        return f"is a {str(tensor.layout).removeprefix('torch.')} tensor, not a dense one"
    if tensor.device.type != "cpu":
        return f"is a tensor on the {tensor.device.type} device, which holds no values"
    if tensor.is_complex() or tensor.is_quantized or tensor.dtype == torch.bool:
        return f"holds {str(tensor.dtype).removeprefix('torch.')}, not real numbers"
    return None


_NOT_TMT = "the file is damaged or was not written by `tmt train` or `tmt average`"
_REQUIRED = object()
_NUMBER = (int, float)
_PROGRESS_TYPES: dict[str, Any] = {
    "update": int,
    "epoch": int,
    "batch_in_epoch": int,
    "best_valid_loss": _NUMBER,
    "valid_loss": (*_NUMBER, type(None)),
    "valid_update": int,
    "minutes": _NUMBER,
    "valid_history": list,
    "valid_bleu": (*_NUMBER, type(None)),
    "best_valid_bleu": _NUMBER,
    "stale_validations": int,
}
_RESUME_REQUIRED = ("update", "epoch", "batch_in_epoch")  # the position: no default could stand in for it
_COUNT_MAX = 10**12  # config.BUDGET_MAX: no run counts further
_PROGRESS_RANGES = {
    "update": (0, _COUNT_MAX),
    "epoch": (1, _COUNT_MAX),
    "batch_in_epoch": (0, _COUNT_MAX),
    "valid_update": (-1, _COUNT_MAX),
    "stale_validations": (0, _COUNT_MAX),
    "minutes": (0.0, 1e9),
}  # what a run's position and clock can be; anything else would resume (or sort among inputs) wrongly


def _entry(state: dict[str, Any], key: str, types: Any, path: str | Path, default: Any = _REQUIRED) -> Any:
    """``state[key]``, which must be an instance of ``types`` (a bool is no number); ``default`` when absent."""
    if key not in state:
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: the checkpoint has no '{key}' entry; {_NOT_TMT}")
        return default
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise CheckpointError(
            f"{path}: the checkpoint's '{key}' entry is a {type(value).__name__}, not {expected}; {_NOT_TMT}"
        )
    return value


def _progress(state: dict[str, Any], path: str | Path, resumable: bool) -> TrainingProgress:
    """The run's position; a resumable checkpoint must say where it is, the rest fall back to their defaults."""
    values = {}
    for f in dataclasses.fields(TrainingProgress):
        default = _REQUIRED if resumable and f.name in _RESUME_REQUIRED else getattr(TrainingProgress(), f.name)
        value = _entry(state, f.name, _PROGRESS_TYPES[f.name], path, default)
        values[f.name] = float(value) if isinstance(value, int) and _PROGRESS_TYPES[f.name] is not int else value
        low, high = _PROGRESS_RANGES.get(f.name, (None, None))
        if low is not None and not low <= value <= high:  # NaN fails both comparisons
            raise CheckpointError(
                f"{path}: the checkpoint's '{f.name}' entry is {shown(value)}, outside {low}..{high}; {_NOT_TMT}"
            )
    for key in ("best_valid_loss", "best_valid_bleu"):  # a min (max) of validations from +inf (-inf): never NaN
        if math.isnan(values[key]):
            raise CheckpointError(f"{path}: the checkpoint's '{key}' entry is nan, which no run records; {_NOT_TMT}")
    try:
        values["valid_history"] = [[int(u), float(nll)] for u, nll in values["valid_history"]]
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: the 'valid_history' entry is not a list of [update, nll]; {_NOT_TMT}") from None
    return TrainingProgress(**values)


def _check_epoch(p: TrainingProgress, cfg: Config, path: str | Path) -> None:
    """Refuse an epoch no run of ``cfg`` reaches in ``p.update`` updates.

    Every epoch trains at least one group of batches, and each group is an
    update or, at most train.max_nonfinite in a row, a skipped one; a larger
    epoch (10**11 after 20 updates) is damage, which would resume in an
    epoch whose batch order no run ever saw.
    """
    most = (p.update + 1) * (cfg.train.max_nonfinite + 1)
    if p.epoch > most:
        raise CheckpointError(
            f"{path}: the checkpoint's 'epoch' entry is {p.epoch}, more than a run reaches in its {p.update} "
            f"updates (at most {most}); {_NOT_TMT}"
        )


def _config(state: dict[str, Any], path: str | Path) -> Config:
    """The run's config, parsed and validated as `tmt train` would a YAML file; a bad one names the file and entry."""
    raw = _entry(state, "config", dict, path)
    try:
        return config_from_dict(raw, origin=str(path))
    except ConfigError as err:
        why = str(err).removeprefix(f"{path}: ")
        raise CheckpointError(
            f"{path}: the checkpoint's 'config' entry is not a valid config: {why}; {_NOT_TMT}"
        ) from None


def _training(state: dict[str, Any], path: str | Path) -> TrainingState:
    optimizer = _entry(state, "optimizer", dict, path)
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list):
        raise CheckpointError(f"{path}: the 'optimizer' entry is not an optimizer's state dict; {_NOT_TMT}")
    rng = _rng(_entry(state, "rng", dict, path), path)
    batching = _entry(state, "batching", (dict, type(None)), path, default=None)
    batching = None if batching is None else _batching(batching, path)
    scaler = _entry(state, "scaler", dict, path, default={})
    return TrainingState(optimizer=optimizer, rng=rng, scaler=scaler, batching=batching)


def _rng(entry: dict[str, Any], path: str | Path) -> RngState:
    world, generators, cuda = entry.get("world_size"), entry.get("torch_cpu"), entry.get("torch_cuda")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1 or not isinstance(generators, list):
        raise CheckpointError(f"{path}: the 'rng' entry lacks 'world_size' or 'torch_cpu'; {_NOT_TMT}")
    for key, states in (("torch_cpu", generators), ("torch_cuda", cuda if cuda is not None else [])):
        if not isinstance(states, list) or not all(
            isinstance(g, torch.Tensor) and g.dtype == torch.uint8 for g in states
        ):
            raise CheckpointError(f"{path}: the 'rng' entry's '{key}' is not a list of generator states; {_NOT_TMT}")
    return RngState(world_size=world, torch_cpu=generators, torch_cuda=cuda)


def _batching(entry: dict[str, Any], path: str | Path) -> Batching:
    values = {}
    for f in dataclasses.fields(Batching):
        value = entry.get(f.name, 0.0 if f.name == "sampling_alpha" else None)
        if isinstance(value, bool) or not isinstance(value, _BATCHING_TYPES[f.name]):
            raise CheckpointError(f"{path}: the 'batching' entry's '{f.name}' is missing or mistyped; {_NOT_TMT}")
        values[f.name] = float(value) if f.name == "sampling_alpha" else value
    return Batching(**values)


_BATCHING_TYPES = {
    "max_tokens": int, "seed": int, "max_len": int, "sentences": int, "lengths": str, "batches": int,
    "sampling_alpha": _NUMBER,
}  # fmt: skip


def _aligner(state: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The ``aligner`` entry: a state dict of dense real tensors, a shape of small whole numbers (the dimension a
    multiple of the heads), validation figures; names and shapes are `check_weights`' to check against it."""
    entry = _entry(state, "aligner", dict, path)
    weights, shape, valid = entry.get("weights"), entry.get("shape"), entry.get("valid", {})
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise CheckpointError(f"{path}: the 'aligner' entry's weights are not a state dict; {_NOT_TMT}")
    for key, tensor in weights.items():
        problem = weight_problem(tensor)
        if problem:
            raise CheckpointError(f"{path}: the 'aligner' entry's {shown(key)} {problem}; {_NOT_TMT}")
    limits = {"dim": (1, 8192), "heads": (1, 64), "layers": (0, 16)}
    if not isinstance(shape, dict) or not all(
        type(shape.get(k)) is int and low <= shape[k] <= high for k, (low, high) in limits.items()
    ) or shape["dim"] % shape["heads"]:  # fmt: skip
        raise CheckpointError(
            f"{path}: the 'aligner' entry's shape is not dim, heads (dividing dim) and layers; {_NOT_TMT}"
        )
    if not isinstance(valid, dict) or not all(isinstance(k, str) and type(v) in (int, float) for k, v in valid.items()):
        raise CheckpointError(f"{path}: the 'aligner' entry's validation figures are not numbers; {_NOT_TMT}")
    return {"weights": weights, "shape": {k: shape[k] for k in limits}, "valid": dict(valid)}


def check_weights(
    path: str | Path, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], entry: str = "model"
) -> None:
    """Refuse ``weights`` (a checkpoint's 'model' entry, or ``entry``) unless they have ``expected``'s names and shapes and
    floating-point values where it has them: the model the checkpoint's config describes, so that a crafted entry
    is one line naming the weight rather than torch's list of every key."""
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    problem = ""
    if missing:
        problem = f"'{missing[0]}' is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    elif extra:
        problem = f"{shown(extra[0])} is not a weight of it" + (
            f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        )
    for key, tensor in expected.items() if not problem else ():
        given = weights[key]
        if given.shape != tensor.shape:
            problem = f"'{key}' has shape {tuple(given.shape)}, not {tuple(tensor.shape)}"
        elif given.is_floating_point() != tensor.is_floating_point():
            problem = f"'{key}' holds {given.dtype}, not {tensor.dtype}"
        if problem:
            break
    if problem:
        raise CheckpointError(
            f"{path}: the '{entry}' entry does not fit the model its config describes: {problem}; {_NOT_TMT}"
        )
