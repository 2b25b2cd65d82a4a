"""Finding, checking and restoring a run: the newest readable checkpoint of train.save_dir, or a fresh start.

Everything that decides the trajectory lives in the checkpoint (weights,
optimizer, update number, epoch and position in the epoch's batch order,
every rank's RNG state), so a run interrupted and resumed follows the same
trajectory, bit for bit on CPU, as a run never stopped. What cannot be
carried over exactly (another world size, another batch order) is converted
where that is exact, and otherwise refused or said loudly.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from transformer_mt.checkpoint import (
    Checkpoint,
    CheckpointError,
    TrainingProgress,
    TrainingState,
    check_weights,
    weight_problem,
)
from transformer_mt.config import Config, field_differences
from transformer_mt.data.batching import resume_position
from transformer_mt.errors import Interrupted, shown
from transformer_mt.run_names import BEST_NAME, CHECKPOINT_RE
from transformer_mt.train.build import RunData
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.epochs import Epochs
from transformer_mt.train.init_from import load_init_weights
from transformer_mt.train.run_checkpoints import find_resume_checkpoint, list_checkpoints
from transformer_mt.train.run_files import batching_changes, restore_rng
from transformer_mt.train.schedule import IMPLEMENTATION_FLAGS, load_optimizer_state
from transformer_mt.train.step import Stepper, TrainError


def resume(cfg: Config, env: DistEnv, stepper: Stepper, data: RunData, epochs: Epochs) -> TrainingProgress | None:
    """Load the newest readable checkpoint of train.save_dir into ``stepper`` and the RNG; its progress, or None.

    The position in the epoch is this rank's, converted to this world size or
    restarted when the batch order changed (`position_in_epoch`).
    """
    save_dir = Path(cfg.train.save_dir)
    found = find_resume_checkpoint(save_dir)
    if found is None:
        return None
    path, ck = found
    if ck.training is None:
        raise TrainError(not_resumable(path, ck, save_dir))
    saved = ck.config
    if saved.model != cfg.model:
        raise TrainError(
            f"{path} holds a different model than the config: "
            f"{field_differences(saved.model, cfg.model, 'model.')} (the checkpoint's value first); "
            "use a new train.save_dir, or restore the model section the run was started with"
        )
    check_update_of_name(path, ck.progress)
    check_weights(path, ck.model, stepper.module.state_dict())
    stepper.module.load_state_dict(ck.model)
    check_optimizer_state(path, ck.training.optimizer, stepper.optimizer)
    with _entry_error(path, "optimizer"):
        load_optimizer_state(stepper.optimizer, ck.training.optimizer)
    if ck.training.scaler:
        with _entry_error(path, "scaler"):
            stepper.scaler.load_state_dict(ck.training.scaler)
    p = ck.progress
    p.batch_in_epoch = position_in_epoch(cfg, env, data, epochs, path, p, ck.training)
    with _entry_error(path, "rng"):
        restore_rng(ck.training.rng, env, cfg.train.seed, p.update)
    if env.is_main:
        tqdm.write(f"resuming from {path} at update {p.update}", file=sys.stderr)
    return p


@contextmanager
def _entry_error(path: Path, entry: str) -> Iterator[None]:
    """torch's own refusal of a state it is handed (a wrong type, key or size) as one line naming the file and
    the entry: the entry is then crafted or damaged, since tmt wrote it from the same objects."""
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError, AttributeError) as err:
        raise CheckpointError(
            f"{path}: the '{entry}' entry cannot be restored ({shown(str(err), 100)[1:-1]}); the file is damaged "
            "or was not written by `tmt train`"
        ) from None


def check_optimizer_state(path: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer state whose groups or per-parameter tensors do not match this model's parameters.

    torch loads them unchecked, and Adam's step on a moment of another shape
    aborts the whole process in native code, with no message at all.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"{path}: the 'optimizer' entry's param_groups do not match the model's; {_CRAFTED}")
    for index, values in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(values, dict):
            raise CheckpointError(f"{path}: the 'optimizer' entry holds a state for no parameter; {_CRAFTED}")
        for name, value in values.items():
            if name != "step" and (not isinstance(value, torch.Tensor) or value.shape != params[index].shape):
                raise CheckpointError(
                    f"{path}: the 'optimizer' entry's {shown(name)} of parameter {index} is not a tensor of its "
                    f"shape {tuple(params[index].shape)}; {_CRAFTED}"
                )
            problem = weight_problem(value) if isinstance(value, torch.Tensor) else None
            if problem:
                raise CheckpointError(
                    f"{path}: the 'optimizer' entry's {shown(name)} of parameter {index} {problem}; {_CRAFTED}"
                )
    for index, (group, mine) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        for key, value in group.items():
            problem = None if key not in mine or key in IMPLEMENTATION_FLAGS else setting_problem(key, value, mine[key])
            if problem:
                raise CheckpointError(
                    f"{path}: the 'optimizer' entry's {key} of param group {index} is {shown(value)}, {problem}; "
                    f"{_CRAFTED}"
                )


def setting_problem(key: str, value: Any, mine: Any) -> str | None:
    """Why ``value`` cannot stand for the optimizer's setting ``key`` (this optimizer's own is ``mine``), or None.

    torch adopts a saved group's settings unchecked and fails only at the
    first step (``betas: "x"``: a ValueError), or never, training with a NaN
    ``eps``; the checks are config.py's for the same settings.
    """
    if isinstance(mine, bool):
        return None if isinstance(value, bool) else "not true or false"
    if isinstance(mine, tuple):  # betas
        if not isinstance(value, tuple | list) or len(value) != len(mine) or not all(map(_is_number, value)):
            return f"not {len(mine)} numbers"
        return None if all(0.0 <= v < 1.0 for v in value) else "outside [0, 1)"
    if _is_number(mine):  # lr, eps, weight_decay
        if not _is_number(value) or not math.isfinite(value):
            return "not a number"
        low_ok = value > 0 if key == "eps" else value >= 0
        return None if low_ok else ("not above 0" if key == "eps" else "below 0")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_update_of_name(path: Path, p: TrainingProgress) -> None:
    """A periodic checkpoint's name holds its update (`checkpoint_name`): another 'update' entry is damage, which
    would resume the schedule (and the numbering of checkpoints) elsewhere."""
    match = CHECKPOINT_RE.fullmatch(path.name)
    if match and int(match.group(1)) != p.update:
        raise CheckpointError(
            f"{path}: the checkpoint's 'update' entry is {p.update}, but its name says update "
            f"{int(match.group(1))}; {_CRAFTED}"
        )


_CRAFTED = "the file is damaged or was not written by `tmt train`"


def not_resumable(path: Path, ck: Checkpoint, save_dir: Path) -> str:
    """Why a run cannot resume from ``path``, which holds no training state, and what to do instead."""
    if ck.averaged_from:
        return (
            f"{path} holds no training state (optimizer, RNG): it is an averaged checkpoint, not one of "
            "`tmt train`; move it out of train.save_dir"
        )
    return (
        f"{path} holds no training state (optimizer, RNG): a run keeps it only in its newest checkpoint and "
        f"in {BEST_NAME}, and the newer checkpoints of {save_dir} are unreadable (warned above) while "
        f"{BEST_NAME} is missing or older. To go on from these weights with a fresh optimizer, start a new "
        f"train.save_dir with --set train.init_from={path}"
    )


def start_from_weights(cfg: Config, env: DistEnv, stepper: Stepper, data: RunData, resumed: int | None) -> None:
    """train.init_from: a new run starts from that checkpoint's weights; a resumed run keeps its own."""
    path = Path(cfg.train.init_from)
    if resumed is not None:
        if env.is_main:
            tqdm.write(
                f"note: train.init_from={path} is ignored: {cfg.train.save_dir} holds this run's own checkpoints "
                f"and it resumes from them (update {resumed}); to fine-tune anew, use another train.save_dir",
                file=sys.stderr,
            )
        return
    update = load_init_weights(stepper.module, path, cfg.model, data.spm_model, data.dir / "spm.model")
    if env.is_main:
        tqdm.write(
            f"fine-tuning: weights from {path} (update {update} of its run); a fresh optimizer and the "
            "learning-rate schedule from update 0",
            file=sys.stderr,
        )


def position_in_epoch(
    cfg: Config, env: DistEnv, data: RunData, epochs: Epochs, path: Path, p: TrainingProgress, saved: TrainingState
) -> int:
    """This rank's position in the epoch's batches: carried over, converted to this world size, or restarted.

    A change of what decides the batch order (`batching_key`) in the middle
    of an epoch restarts the epoch (`restart_epoch`); a change of world size
    converts the position exactly where one exists.
    """
    saved_world_size, batching, batch_in_epoch = saved.rng.world_size, saved.batching, p.batch_in_epoch
    changes = batching_changes(batching, data.batching) if batching else []  # None: written before it was kept
    if changes and batch_in_epoch > 0:
        return restart_epoch(env, epochs, path, changes, p, batching.batches)
    tc, epoch = cfg.train, p.epoch
    ds = epochs.dataset(epoch)  # with bpe.sampling_alpha, the epoch's own encoding
    position = resume_position(
        ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, epoch, batch_in_epoch, saved_world_size,
        env.world_size, data.max_len,
    )  # fmt: skip
    if position is None:
        raise TrainError(
            f"{path} was written by {saved_world_size} processes, {batch_in_epoch} batches each into epoch "
            f"{epoch}; with {env.world_size} processes the rest of this epoch's batches are dealt out differently, "
            f"so training would skip or repeat sentences. Resume with {saved_world_size} processes "
            f"(--nproc-per-node {saved_world_size}), or start a new train.save_dir"
        )
    if position > (batches := len(epochs.batches(epoch))):
        raise CheckpointError(
            f"{path}: the checkpoint's 'batch_in_epoch' entry is {position}, past the {batches} batches of epoch "
            f"{epoch}; {_CRAFTED}"
        )
    return position


def restart_epoch(env: DistEnv, epochs: Epochs, path: Path, changes: list[str], p: TrainingProgress, saved: int) -> int:
    """The position after the batch order changed mid-epoch: the epoch's start (or its end, if it was done).

    The sentences the old order had not reached cannot be cut into new
    batches without knowing them all, so the epoch starts over under the
    new order, deterministically: the sentences it had trained on are seen
    again this epoch, none is skipped. Said loudly, with how to avoid it.
    """
    epoch, batch_in_epoch = p.epoch, p.batch_in_epoch
    if batch_in_epoch >= saved:
        return len(epochs.batches(epoch))  # the epoch was finished: the next starts under the new order
    if env.is_main:
        tqdm.write(
            f"warning: {'; '.join(changes)}: {path} was written {batch_in_epoch:,} of {saved:,} batches "
            f"into epoch {epoch}, and the change reorders that epoch's batches, so epoch {epoch} starts over "
            f"under the new order (the sentences of its first {batch_in_epoch:,} batches are trained on again). "
            "To continue it exactly instead, stop and resume with the old value(s); change them once a "
            "checkpoint ends an epoch (train.max_epochs) or before a run starts",
            file=sys.stderr,
        )
    return 0


def interrupted(update: int, save_dir: Path) -> Interrupted:
    """Ctrl-C: where the run was, and the checkpoint the same command resumes from (a save cut short is not
    one: its temporary file is gone, and the one before it is whole), found as resuming finds it: a newer file
    that does not read back is not named."""
    done = f"interrupted at update {update}"
    found = find_resume_checkpoint(save_dir, look=True)
    if found is None:
        before = "no checkpoint of the run reads back" if list_checkpoints(save_dir) else "before the first checkpoint"
        return Interrupted(f"{done}, {before}; the same tmt train command starts the run again")
    return Interrupted(f"{done}; the newest checkpoint is {found[0]}: the same tmt train command resumes from it")
