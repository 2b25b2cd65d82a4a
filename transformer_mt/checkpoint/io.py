"""Checkpoint files: the atomic write, the safe read, and the errors of a file that cannot be read.

Writes go to a temporary file in the same directory, are fsync'ed and then
renamed over the target (`transformer_mt.files.atomic_open`), so a crash or a
full disk leaves either the old file or the new one, never half of one.
Reads use ``torch.load(weights_only=True)``, so loading never runs code
stored in a file, and every entry read is checked (`from_state`).
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from transformer_mt.checkpoint.format import Checkpoint, CheckpointError, from_state, to_state
from transformer_mt.checkpoint.run_dir import directory_message
from transformer_mt.errors import raise_if_stopped
from transformer_mt.files import atomic_open
from transformer_mt.run_names import AVERAGE_NAME, BEST_NAME, CHECKPOINT_RE, CONFIG_NAME


def write_checkpoint(path: str | Path, ck: Checkpoint) -> None:
    """Write ``ck`` to ``path`` atomically: a crash keeps the old file, a Ctrl-C is a KeyboardInterrupt."""
    state = to_state(ck)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _interrupts_seen() as seen:
        try:
            with atomic_open(path) as f:
                torch.save(state, f)
        except Exception as err:
            if seen:  # torch's writer turns a Ctrl-C inside it into its own RuntimeError: no disk was at fault
                raise KeyboardInterrupt from None
            raise_if_stopped()  # the same, under the command line's handler (`errors.stop_on_signals`)
            why = next((e.strerror for e in (err, err.__context__) if isinstance(e, OSError) and e.strerror), err)
            raise CheckpointError(f"{path}: could not write the checkpoint ({why}); check free disk space") from err


def read_checkpoint(path: str | Path, mmap: bool = False) -> Checkpoint:
    """Load and check a checkpoint (onto the CPU, never running code); CheckpointError names a bad file.

    ``mmap``: the weights stay in the file until read (`checkpoint_problem`'s
    cheap load), for a look at what a checkpoint is rather than a use of it.
    """
    return from_state(_load(Path(path), mmap=mmap), path)


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
        ck = from_state(_load(Path(path), mmap=True), path)
    except CheckpointError:
        return False
    if ck.training is None:
        return False
    write_checkpoint(path, dataclasses.replace(ck, training=None))
    return True


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


def _load(path: Path, mmap: bool) -> Any:
    """The stored object of ``path``, loaded safely; `from_state` checks that it is a checkpoint's dict."""
    if path.is_dir():
        raise CheckpointError(directory_message(path))
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad magic, foreign pickle: all mean "not a usable checkpoint"
        raise _unreadable(path, err) from None


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
