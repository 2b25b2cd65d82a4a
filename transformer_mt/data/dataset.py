"""A binarized split opened memory-mapped, and the collation of its sentences into padded batches.

Files (written by `transformer_mt.data.prepare`): ``{split}.{lang}.ids.npy``
holds every sentence's BPE ids back to back (no BOS/EOS), and
``{split}.{lang}.offsets.npy`` (int64, sentences + 1 entries) says where each
sentence starts: sentence ``i`` is ``ids[off[i]:off[i + 1]]``. Nothing is read
into memory but the offsets, so a 4.5M-sentence split opens instantly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.errors import UserError


class DatasetError(UserError):
    """Prepared data that does not hold together; the message names the directory and `tmt prepare --force`."""


def split_paths(data_dir: str | Path, split: str, lang: str) -> tuple[Path, Path]:
    """The ``(ids, offsets)`` file pair of one side of one split."""
    base = Path(data_dir)
    return base / f"{split}.{lang}.ids.npy", base / f"{split}.{lang}.offsets.npy"


class ParallelDataset:
    """One split of a prepared corpus: ``len(ds)`` sentence pairs, read lazily from disk.

    ``src_lens`` / ``tgt_lens`` are int64 lengths in tokens *including* the
    EOS (source) or BOS (target) that `collate` adds, i.e. ``len(ids) + 1``;
    that is the length the batching cost counts.
    """

    def __init__(self, data_dir: str | Path, split: str, src_lang: str, tgt_lang: str) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        self._src_ids, self._src_off = _open_side(self.data_dir, split, src_lang)
        self._tgt_ids, self._tgt_off = _open_side(self.data_dir, split, tgt_lang)
        if len(self._src_off) != len(self._tgt_off):
            raise DatasetError(
                f"{self.data_dir}: {split}.{src_lang} has {len(self._src_off) - 1} sentences but "
                f"{split}.{tgt_lang} has {len(self._tgt_off) - 1}; run `tmt prepare --force`"
            )
        self.src_lens = np.diff(self._src_off).astype(np.int64) + 1
        self.tgt_lens = np.diff(self._tgt_off).astype(np.int64) + 1

    @classmethod
    def from_arrays(
        cls, data_dir: str | Path, split: str, src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray]
    ) -> ParallelDataset:
        """A split held in memory: ``(ids, offsets)`` per side, as the files hold them (an epoch's sampled encoding,
        `transformer_mt.data.bpe_dropout`)."""
        ds = cls.__new__(cls)
        ds.data_dir, ds.split = Path(data_dir), split
        (ds._src_ids, ds._src_off), (ds._tgt_ids, ds._tgt_off) = src, tgt
        ds.src_lens = np.diff(ds._src_off).astype(np.int64) + 1
        ds.tgt_lens = np.diff(ds._tgt_off).astype(np.int64) + 1
        return ds

    def __len__(self) -> int:
        return len(self._src_off) - 1

    def src_ids(self, i: int) -> np.ndarray:
        """BPE ids of source sentence ``i``, without EOS."""
        return self._src_ids[self._src_off[i] : self._src_off[i + 1]]

    def tgt_ids(self, i: int) -> np.ndarray:
        """BPE ids of target sentence ``i``, without BOS/EOS."""
        return self._tgt_ids[self._tgt_off[i] : self._tgt_off[i + 1]]


def _open_side(data_dir: Path, split: str, lang: str) -> tuple[np.ndarray, np.ndarray]:
    ids_path, off_path = split_paths(data_dir, split, lang)
    for path in (ids_path, off_path):
        if not path.is_file():
            raise DatasetError(f"{path} is missing; run `tmt prepare CONFIG` to write data.dir")
    try:
        offsets = np.load(off_path)
        ids = np.load(ids_path, mmap_mode="r") if offsets[-1] > 0 else np.load(ids_path)
    except (ValueError, OSError, EOFError, IndexError) as err:  # truncated, not .npy, or no offsets at all
        raise DatasetError(
            f"{off_path.parent}: {split}.{lang} cannot be read ({err}); run `tmt prepare CONFIG --force`"
        ) from None
    return ids, offsets


@dataclass
class Batch:
    """A padded batch: ``src`` (B, S), ``tgt_in`` (B, T), ``tgt_out`` (B, T), all ``torch.long``.

    ``src`` = ids + [EOS]; ``tgt_in`` = [BOS] + ids; ``tgt_out`` = ids + [EOS];
    padding is PAD on the right.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    @property
    def num_tgt_tokens(self) -> int:
        """Target tokens the loss is summed over (non-pad positions of ``tgt_out``)."""
        return int((self.tgt_out != PAD).sum())

    @property
    def num_src_tokens(self) -> int:
        return int((self.src != PAD).sum())

    def __len__(self) -> int:
        return self.src.shape[0]

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, so that ``to(cuda, non_blocking=True)`` copies asynchronously."""
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(), self.tgt_out.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.src.to(device, non_blocking=non_blocking),
            self.tgt_in.to(device, non_blocking=non_blocking),
            self.tgt_out.to(device, non_blocking=non_blocking),
        )


def collate(ds: ParallelDataset, indices: np.ndarray | list[int]) -> Batch:
    """Pad the sentences ``indices`` of ``ds`` into one `Batch`, in the given order.

    An empty ``indices`` (a rank's filler batch, see `shard_batches`) gives
    tensors of shape (0, 1) that hold no tokens.
    """
    indices = [int(i) for i in indices]
    src_rows = [ds.src_ids(i) for i in indices]
    tgt_rows = [ds.tgt_ids(i) for i in indices]
    s_len = max((len(r) for r in src_rows), default=0) + 1
    t_len = max((len(r) for r in tgt_rows), default=0) + 1
    src = np.full((len(indices), s_len), PAD, dtype=np.int64)  # (B, S)
    tgt_in = np.full((len(indices), t_len), PAD, dtype=np.int64)  # (B, T)
    tgt_out = np.full((len(indices), t_len), PAD, dtype=np.int64)  # (B, T)
    for b, (s, t) in enumerate(zip(src_rows, tgt_rows, strict=True)):
        src[b, : len(s)] = s
        src[b, len(s)] = EOS
        tgt_in[b, 0] = BOS
        tgt_in[b, 1 : len(t) + 1] = t
        tgt_out[b, : len(t)] = t
        tgt_out[b, len(t)] = EOS
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out))


def pad_to_multiple(batch: Batch, multiple: int, limit: int) -> Batch:
    """``batch`` with its source and target lengths padded (PAD, on the right) up to a multiple of ``multiple``.

    Padding is masked everywhere (attention keys, the loss), so the loss and
    gradients are those of the unpadded batch up to float rounding; what
    changes is the number of distinct tensor shapes, hence of `torch.compile`
    recompilations. No length grows past ``limit`` (the model's
    max_positions). ``multiple`` <= 1 returns the batch unchanged.
    """
    if multiple <= 1:
        return batch

    def padded(t: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, L')
        length = min(-(-t.shape[1] // multiple) * multiple, max(limit, t.shape[1]))
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=PAD)

    return Batch(padded(batch.src), padded(batch.tgt_in), padded(batch.tgt_out))
