"""A checkpoint file: what it holds (`Checkpoint`), its safe load, its atomic save, and the average of several.

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

Writes go to a temporary file in the same directory, are fsync'ed and then
renamed over the target (`transformer_mt.files.atomic_open`), so a crash or a
full disk leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt.config import Config, ConfigError, config_from_dict
from transformer_mt.errors import UserError, shown
from transformer_mt.files import atomic_open
from transformer_mt.run_names import AVERAGE_NAME, BEST_NAME, CHECKPOINT_RE, CONFIG_NAME


class CheckpointError(UserError):
    """A checkpoint file that cannot be read, written or averaged; the message names the file (and the entry)."""


@dataclass
class Progress:
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
    """What only resuming needs besides `Progress`; an averaged checkpoint has none."""

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
    progress: Progress = field(default_factory=Progress)  # only ``update`` without ``training``
    training: TrainingState | None = None
    averaged_from: list[str] = field(default_factory=list)  # the input files of `tmt average`


# ---------------------------------------------------------------- to and from the stored dict


def to_state(ck: Checkpoint) -> dict[str, Any]:
    """The dict stored on disk: tensors and plain values only; a checkpoint without training state stores less."""
    spm = torch.from_numpy(np.frombuffer(ck.spm_model, dtype=np.uint8).copy())
    config = ck.config.to_dict()
    state: dict[str, Any] = {"model": ck.model, "config": config, "spm_model": spm, "update": ck.progress.update}
    if not ck.averaged_from:  # an average has no place in a run; a stripped checkpoint keeps its minutes and figures
        state.update({f.name: getattr(ck.progress, f.name) for f in dataclasses.fields(Progress)})
    if ck.training is not None:  # shallow: `dataclasses.asdict` would deep-copy the optimizer's tensors
        t = ck.training
        state.update(optimizer=t.optimizer, rng=t.rng.to_dict(), scaler=t.scaler)
        state["batching"] = None if t.batching is None else t.batching.to_dict()
    if ck.averaged_from:
        state["averaged_from"] = list(ck.averaged_from)
    return state


def from_state(state: Any, path: str | Path) -> Checkpoint:
    """The `Checkpoint` of a stored dict, every entry checked; CheckpointError names ``path`` and the entry."""
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a tmt checkpoint (no 'model' entry); was it written by `tmt train`?")
    model = _entry(state, "model", dict, path)
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise CheckpointError(f"{path}: the 'model' entry is not a state dict (names to tensors); {_NOT_TMT}")
    spm = _entry(state, "spm_model", torch.Tensor, path)
    if spm.dtype != torch.uint8 or spm.dim() != 1 or spm.numel() == 0:
        raise CheckpointError(f"{path}: the 'spm_model' entry is not the bytes of a BPE model; {_NOT_TMT}")
    training = _training(state, path) if "optimizer" in state else None
    return Checkpoint(
        model=model,
        config=_config(state, path),
        spm_model=spm.numpy().tobytes(),
        progress=_progress(state, path, resumable=training is not None),
        training=training,
        averaged_from=[str(p) for p in _entry(state, "averaged_from", list, path, default=[])],
    )


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


def _progress(state: dict[str, Any], path: str | Path, resumable: bool) -> Progress:
    """The run's position; a resumable checkpoint must say where it is, the rest fall back to their defaults."""
    values = {}
    for f in dataclasses.fields(Progress):
        default = _REQUIRED if resumable and f.name in _RESUME_REQUIRED else getattr(Progress(), f.name)
        value = _entry(state, f.name, _PROGRESS_TYPES[f.name], path, default)
        values[f.name] = float(value) if isinstance(value, int) and _PROGRESS_TYPES[f.name] is not int else value
        low, high = _PROGRESS_RANGES.get(f.name, (None, None))
        if low is not None and not low <= value <= high:  # NaN fails both comparisons
            raise CheckpointError(
                f"{path}: the checkpoint's '{f.name}' entry is {shown(value)}, outside {low}..{high}; {_NOT_TMT}"
            )
    try:
        values["valid_history"] = [[int(u), float(nll)] for u, nll in values["valid_history"]]
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: the 'valid_history' entry is not a list of [update, nll]; {_NOT_TMT}") from None
    return Progress(**values)


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


# ---------------------------------------------------------------- files


def write_checkpoint(path: str | Path, ck: Checkpoint) -> None:
    """Write ``ck`` to ``path`` atomically: a crash keeps the old file."""
    save_checkpoint(path, to_state(ck))


def strip_training_state(path: str | Path) -> bool:
    """Rewrite ``path`` atomically without its `TrainingState`; False when it holds none or cannot be read.

    Adam's two moments are two thirds of a float32 checkpoint, and only
    resuming needs them (with the RNG, scaler and batching records); averaging,
    translation and ``train.init_from`` read the weights, config, BPE model
    and progress, which stay. The file is memory-mapped, so only its weights
    are read, and a kill mid-way leaves the old whole file (`atomic_open`).
    An unreadable file is left alone for the warnings of retention and resume.
    """
    try:
        state = _load(Path(path), mmap=True)
        if "optimizer" not in state:
            return False
        ck = from_state(state, path)
    except CheckpointError:
        return False
    write_checkpoint(path, dataclasses.replace(ck, training=None))
    return True


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Load and check a checkpoint (onto the CPU, never running code); CheckpointError names a bad file."""
    return from_state(load_checkpoint(path), path)


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write a stored dict (`to_state`) to ``path`` atomically; tools and tests that craft files use it directly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _interrupts_seen() as seen:
        try:
            with atomic_open(path) as f:
                torch.save(state, f)
        except Exception as err:
            if seen:  # torch's writer turns a Ctrl-C inside it into its own RuntimeError: no disk was at fault
                raise KeyboardInterrupt from None
            raise CheckpointError(f"{path}: could not write the checkpoint ({err}); check free disk space") from err


@contextmanager
def _interrupts_seen() -> Iterator[list[int]]:
    """Note each SIGINT (and raise KeyboardInterrupt as Python does) while the block runs.

    A KeyboardInterrupt raised inside torch.save's file writes reaches the
    caller as a RuntimeError about the zip stream, which reads as a disk
    failure; the note tells them apart. Only where Python's own handler is
    in place (the main thread, SIGINT not ignored or taken by someone else).
    """
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield seen
        return

    def note(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The stored dict of a checkpoint, as it is on disk (no field checked but 'model'); prefer `read_checkpoint`."""
    return _load(Path(path), mmap=False)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a checkpoint `read_checkpoint` accepts (the CheckpointError message), or None.

    Cheap enough to run on every kept checkpoint at every save: the file is
    memory-mapped, so only its zip directory, the pickled structure and the
    BPE model are read, not the weights: about 50 ms for a 750 MB checkpoint
    of the base model with its Adam state (a full load: seconds). It catches
    truncated, empty or foreign files, pickles with code, and missing or
    mistyped entries.
    """
    try:
        from_state(_load(Path(path), mmap=True), path)
    except CheckpointError as err:
        return str(err)
    return None


def _load(path: Path, mmap: bool) -> dict[str, Any]:
    if path.is_dir():
        raise CheckpointError(_directory_message(path))
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad magic, foreign pickle: all mean "not a usable checkpoint"
        raise _unreadable(path, err) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a tmt checkpoint (no 'model' entry); was it written by `tmt train`?")
    return state


RUN_DIR_CHOICES = (AVERAGE_NAME, BEST_NAME)  # what ``-c RUN_DIR`` decodes with, in this order


def run_dir_checkpoint(path: Path) -> Path | None:
    """The checkpoint ``-c RUN_DIR`` stands for in the decode commands: the run's average.pt, else its
    checkpoint_best.pt; None when ``path`` is no directory or holds neither."""
    if not path.is_dir():
        return None
    return next((path / name for name in RUN_DIR_CHOICES if (path / name).is_file()), None)


def _directory_message(path: Path) -> str:
    """A directory where one checkpoint file is needed: name the files of it a user most likely meant."""
    found = [path / name for name in RUN_DIR_CHOICES if (path / name).is_file()]
    if found:
        return f"{path} is a directory, not a checkpoint file; did you mean {' or '.join(map(str, found))}?"
    return (
        f"{path} is a directory, not a checkpoint file; pass one of its checkpoint_u*.pt, or average its newest "
        f"first: tmt average {path}"
    )


_TMT_CHECKPOINT_NAME = re.compile("|".join([CHECKPOINT_RE.pattern, *map(re.escape, (BEST_NAME, AVERAGE_NAME))]))


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    """Why torch could not load ``path``, in tmt's words only.

    torch's own message for a pickle that a safe load refuses advises loading
    it with ``weights_only=False``, which would run whatever code a crafted
    file holds; tmt never writes such a file, so it never passes that on.
    Deleting is advised only for a file tmt wrote itself, by its name in a
    run directory (beside the run's config.yaml), and found truncated: never
    for a config, a text file or anything else a user may have passed by
    mistake.
    """
    if isinstance(err, pickle.UnpicklingError):
        why = "it holds Python objects other than tensors and plain values, which tmt never writes and never loads"
        return CheckpointError(
            f"{path}: not a readable checkpoint: {why}; pick a checkpoint tmt train or tmt average wrote"
        )
    if _looks_like_text(path):
        return CheckpointError(
            f"{path}: a text file (a config?), not a checkpoint; -c takes a checkpoint that tmt train or tmt average "
            "wrote, such as runs/NAME/average.pt or runs/NAME/checkpoint_best.pt"
        )
    if _TMT_CHECKPOINT_NAME.fullmatch(path.name) and (path.parent / CONFIG_NAME).is_file():
        return CheckpointError(
            f"{path}: not a readable checkpoint: the file is truncated or corrupt; it is one of this run's own "
            "checkpoints: delete it, or pick another checkpoint of the run"
        )
    return CheckpointError(
        f"{path}: not a readable checkpoint: truncated, corrupt or not a checkpoint at all; pick a checkpoint "
        "that tmt train or tmt average wrote"
    )


def _looks_like_text(path: Path) -> bool:
    """UTF-8 text without NUL bytes in its first 4 KiB, and no zip archive (what a checkpoint is)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        head.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return bool(head) and b"\0" not in head and not head.startswith(b"PK\x03\x04")


# ---------------------------------------------------------------- averaging


def read_average(paths: Sequence[str | Path]) -> Checkpoint:
    """The checkpoint of ``paths``: what `tmt average` writes and `tmt translate -c A -c B` translates with.

    Floating-point tensors are averaged in float64 and cast back to their
    dtype; integer buffers must be equal and are copied. All inputs must have
    the same parameter names and shapes and the same BPE model. Config, BPE
    model and update come from the newest input (highest update); no training
    state is kept. One path gives that checkpoint's model as it is.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise CheckpointError("no checkpoints to average")
    single = len(paths) == 1  # the mean of one checkpoint is itself: no float64 copy needed
    sums: dict[str, torch.Tensor] = {}
    first: tuple[dict[str, torch.Tensor], bytes] = ({}, b"")  # the first input's model and BPE model
    newest: tuple[int, Config, bytes] = (-1, Config(), b"")  # update, config, BPE model
    for i, path in enumerate(paths):
        ck = read_checkpoint(path)
        if i == 0:
            first, sums = (ck.model, ck.spm_model), dict(ck.model) if single else _float64_copy(ck.model)
        else:
            _check_same_model(*first, ck, paths[0], path)
            _accumulate(sums, ck.model, paths[0], path)
        if ck.progress.update > newest[0]:
            newest = (ck.progress.update, ck.config, ck.spm_model)
        del ck  # one input's weights (and optimizer state) in memory at a time, besides the sums
    model = sums if single else _mean(sums, first[0], len(paths))
    update, config, spm_model = newest
    return Checkpoint(model, config, spm_model, Progress(update=update), averaged_from=[str(p) for p in paths])


def check_weights(path: str | Path, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Refuse ``weights`` (a checkpoint's 'model' entry) unless they have ``expected``'s names and shapes and
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
            f"{path}: the 'model' entry does not fit the model its config describes: {problem}; {_NOT_TMT}"
        )


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
