"""Rank 0's files in the run directory, and the RNG state and batching a checkpoint carries (`RngState`,
`Batching`, spelled in `transformer_mt.checkpoint`).

``save_dir`` holds ``config.yaml`` (the resolved config), ``metrics.jsonl``
(one JSON object per line) and, when the ``tensorboard`` package is installed,
TensorBoard event files. Metric lines always describe the trajectory that the
newest checkpoint continues: lines past the checkpoint resumed from are
dropped, and a run that starts from scratch starts an empty file.

Each line has a ``kind``: ``start`` (each time a process starts or resumes
the run: parameters, FLOPs per target token, device; `start_record`),
``train`` (every train.log_every updates), ``valid``, ``warning`` and ``end``
(where and why the run stopped, its wall-clock minutes), each a dataclass of
`transformer_mt.runs`. `tmt report` and `tmt plot` read nothing else.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from transformer_mt.checkpoint import Batching, RngState
from transformer_mt.config import Config, save_config
from transformer_mt.files import atomic_write_text, no_room_message
from transformer_mt.model.transformer import flops_per_token
from transformer_mt.run_names import CONFIG_NAME, METRICS_NAME
from transformer_mt.runs import Record, StartRecord
from transformer_mt.train.distributed import DistEnv, all_gather_object
from transformer_mt.train.step import TrainError

# ---------------------------------------------------------------- RNG


def dropout_seed(seed: int, rank: int) -> int:
    """Each rank draws its own dropout masks; the stream is derived from the config seed."""
    return seed * 1_000_003 + 7919 * (rank + 1)


def rng_state(env: DistEnv) -> RngState:
    """Every rank's torch RNG states (CPU, and CUDA when used), gathered so that rank 0 can save them.

    Batch order needs none: it is a pure function of (seed, epoch) via seeded
    numpy Generators. ``world_size`` records how many processes wrote them.
    """
    local = {"cpu": torch.get_rng_state()}
    if env.device.type == "cuda":
        local["cuda"] = torch.cuda.get_rng_state(env.device)
    states = all_gather_object(local, env)
    cuda = [s["cuda"] for s in states] if env.device.type == "cuda" else None
    return RngState(world_size=env.world_size, torch_cpu=[s["cpu"] for s in states], torch_cuda=cuda)


def restore_rng(rng: RngState, env: DistEnv, seed: int, update: int) -> None:
    """Restore this rank's RNG states; with a different world size the trajectory cannot be exact, so reseed."""
    if rng.world_size == env.world_size:
        torch.set_rng_state(rng.torch_cpu[env.rank])
        if env.device.type == "cuda" and rng.torch_cuda is not None:
            torch.cuda.set_rng_state(rng.torch_cuda[env.rank], env.device)
        return
    if env.is_main:
        tqdm.write(
            f"warning: the checkpoint was written by {rng.world_size} processes, this run has "
            f"{env.world_size}; dropout masks are reseeded, so the trajectory differs from an uninterrupted run",
            file=sys.stderr,
        )
    torch.manual_seed(dropout_seed(seed, env.rank) + update)


# ---------------------------------------------------------------- batching


def batching_key(
    src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, seed: int, max_len: int, sampling_alpha: float = 0.0
) -> Batching:
    """What decides an epoch's batch order besides the epoch and the world size, as a checkpoint records it.

    `epoch_batches` is a pure function of these (the world size is recorded
    and converted apart, see `resume_position`), so a position in an epoch
    means the same sentences on resume only while they are unchanged. The
    training data enter as their count and a digest of their lengths (in
    tokens), which is all the batching reads of them. With ``bpe.sampling_alpha``
    > 0 each epoch's lengths are those of its own encoding, drawn from the seed,
    the epoch and alpha, which is then recorded too (absent from the file when 0,
    as before it existed). ``batches`` stays 0: the trainer sets the saved epoch's.
    """
    digest = hashlib.blake2b(np.ascontiguousarray(src_lens, dtype=np.int64).tobytes(), digest_size=8)
    digest.update(np.ascontiguousarray(tgt_lens, dtype=np.int64).tobytes())
    return Batching(
        max_tokens=int(max_tokens), seed=int(seed), max_len=int(max_len), sentences=len(src_lens),
        lengths=digest.hexdigest(), sampling_alpha=float(sampling_alpha) if sampling_alpha > 0 else 0.0,
    )  # fmt: skip


def batching_changes(saved: Batching, current: Batching) -> list[str]:
    """What differs between a checkpoint's `batching_key` and this run's, as the user would name it; [] if nothing."""
    changes = [
        f"{name} was {getattr(saved, key)}, now {getattr(current, key)}"
        for key, name in (
            ("max_tokens", "train.max_tokens"),
            ("seed", "train.seed"),
            ("max_len", "the longest sentence trained on (min of train.max_tokens and model.max_positions)"),
        )
        if getattr(saved, key) != getattr(current, key)
    ]
    if saved.sampling_alpha != current.sampling_alpha:
        changes.append(f"bpe.sampling_alpha was {saved.sampling_alpha:g}, now {current.sampling_alpha:g}")
    if saved.sentences != current.sentences or saved.lengths != current.lengths:
        changes.append(
            f"the training data in data.dir changed ({saved.sentences:,} sentences, now "
            f"{current.sentences:,}{'' if saved.sentences != current.sentences else ', other lengths'})"
        )
    return changes


# ---------------------------------------------------------------- run directory


def write_config(cfg: Config, save_dir: Path) -> None:
    """``save_dir/config.yaml``, written whole or not at all (`save_config` writes atomically)."""
    try:
        save_config(cfg, save_dir / CONFIG_NAME)
    except OSError as err:
        raise unwritable(save_dir / CONFIG_NAME, err) from None


def start_record(
    cfg: Config, env: DistEnv, update: int, parameters: int, vocab_size: int, lengths: tuple[float, float],
    precision: str,
) -> StartRecord:  # fmt: skip
    """The ``start`` line of metrics.jsonl: what a run's training cost and hardware are computed from.

    ``lengths`` are the training data's mean source and target lengths in
    tokens (EOS included), which set the attention share of
    `flops_per_token`: training FLOPs = updates x target tokens per update x
    ``flops_per_token``, the figure `tmt report` sets beside the paper's.
    """
    src_len, tgt_len = lengths
    return StartRecord(
        update=update, parameters=parameters, vocab_size=vocab_size,
        flops_per_token=flops_per_token(cfg.model, vocab_size, src_len, tgt_len), mean_src_tokens=src_len,
        mean_tgt_tokens=tgt_len, device=device_name(env.device), world_size=env.world_size, precision=precision,
    )  # fmt: skip


def device_name(device: torch.device) -> str:
    """What the run trains on, as a reader of its report would name it: the GPU's model, or the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


@dataclass
class RunFiles:
    """Rank 0's outputs in save_dir: metrics.jsonl, optional TensorBoard events."""

    save_dir: Path
    tensorboard: Any = None
    _metrics: Any = field(default=None, repr=False)

    @classmethod
    def open(cls, save_dir: Path, resume_update: int | None) -> RunFiles:
        """Open for appending after the lines up to ``resume_update``; ``None`` (a fresh start) empties the file."""
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / METRICS_NAME
        if path.is_file():
            truncate_metrics(path, resume_update)
        try:
            from torch.utils.tensorboard import SummaryWriter

            tensorboard = SummaryWriter(str(save_dir / "tensorboard"))
        except ImportError:  # optional: `pip install tensorboard` to get event files
            tensorboard = None
        try:
            return cls(save_dir, tensorboard, open(path, "a", encoding="utf-8"))
        except OSError as err:
            raise unwritable(path, err) from None

    def log(self, entry: Record) -> None:
        """One line of metrics.jsonl (and its figures as TensorBoard scalars), on disk at once."""
        record = entry.to_dict()
        try:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        except OSError as err:
            raise unwritable(self.save_dir / METRICS_NAME, err) from None
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("update", "epoch"):
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["update"])

    def close(self) -> None:
        self._metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def unwritable(path: Path, err: OSError) -> TrainError:
    """A run file the OS refuses to write (a full disk, most often), as the error that says where to make room."""
    return TrainError(
        no_room_message(
            path, err, "set train.save_dir to a directory with room, then run the same command again (it resumes)"
        )
    )


def truncate_metrics(path: Path, update: int | None) -> None:
    """Drop metric lines past ``update`` (all of them when None): they belong to a trajectory that is replayed.

    Without a checkpoint to resume from (a crash before the first save) every
    update is run again, so nothing of the old file is kept.
    """
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines() if update is not None else []:
        try:
            if json.loads(line).get("update", 0) <= update:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    atomic_write_text(path, "".join(line + "\n" for line in kept))
