"""Several directions' prepared splits as one dataset, each source behind its target tag, and each epoch's draw.

`CorpusMix` reads like a `ParallelDataset` (``len``, ``src_ids``, ``tgt_ids``,
``src_lens``, ``tgt_lens``), so batching, collation and validation take it as
they are. Its sentences are those of its parts one after the other, or a
selection of them: the pairs an epoch draws (`epoch_selection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from transformer_mt.config import DataConfig
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.directions import directions, source_prefix, split_name, train_parts


class CorpusMix:
    """The sentence pairs of several parts, each a split of one direction and the ids its sources start with.

    ``selection`` (global indices into the parts laid end to end, repeats
    allowed) picks and orders the pairs; None takes every pair once.
    """

    def __init__(self, parts: list[tuple[ParallelDataset, np.ndarray]], selection: np.ndarray | None = None) -> None:
        self.parts = parts
        self.sizes = np.array([len(ds) for ds, _ in parts], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.sizes)))
        every = np.arange(self.starts[-1], dtype=np.int64)
        self.selection = every if selection is None else np.asarray(selection, dtype=np.int64)
        self.part_of = np.searchsorted(self.starts, self.selection, side="right") - 1  # (N,) each pair's part
        self.local = self.selection - self.starts[self.part_of]  # (N,) its index inside that part
        src = np.concatenate([ds.src_lens + len(prefix) for ds, prefix in parts])
        tgt = np.concatenate([ds.tgt_lens for ds, _ in parts])
        self.src_lens, self.tgt_lens = src[self.selection], tgt[self.selection]
        self.data_dir = parts[0][0].data_dir
        self.split = "+".join(ds.split for ds, _ in parts)

    def select(self, selection: np.ndarray) -> CorpusMix:
        """The same parts with another selection (an epoch's draw)."""
        return CorpusMix(self.parts, selection)

    def __len__(self) -> int:
        return len(self.selection)

    def src_ids(self, i: int) -> np.ndarray:
        """Source ids of pair ``i``: its part's prefix (the target tag), then the sentence, without EOS."""
        ds, prefix = self.parts[self.part_of[i]]
        ids = ds.src_ids(int(self.local[i]))
        return np.concatenate((prefix.astype(ids.dtype), ids)) if len(prefix) else ids

    def tgt_ids(self, i: int) -> np.ndarray:
        ds, _ = self.parts[self.part_of[i]]
        return ds.tgt_ids(int(self.local[i]))


def temperature_shares(sizes: np.ndarray, temperature: float, weights: Sequence[float] | None = None) -> np.ndarray:
    """Each part's share of an epoch: ``p_i ∝ w_i n_i^(1/T)`` (Arivazhagan et al. 2019, with a weight ``w_i``
    per part, 1 by default); T = 1 and equal weights keep the data's proportions, a large T tends to uniform."""
    shares = np.asarray(sizes, dtype=np.float64) ** (1.0 / temperature)
    shares *= np.ones(len(shares)) if weights is None else np.asarray(weights, dtype=np.float64)
    return shares / shares.sum()


def epoch_selection(
    sizes: np.ndarray, temperature: float, seed: int, epoch: int, weights: Sequence[float] | None = None
) -> np.ndarray | None:
    """The pairs epoch ``epoch`` trains on, as global indices; None at temperature 1 with equal weights (every
    pair once).

    The epoch keeps the data's total size; part ``i`` gets
    ``round(total * p_i)`` pairs: all of its pairs as often as they fit,
    then the rest drawn without repeats, from (seed, epoch) alone, so that
    a resumed run draws the same epoch.
    """
    if temperature == 1.0 and (weights is None or len(set(weights)) <= 1):
        return None
    sizes = np.asarray(sizes, dtype=np.int64)
    counts = np.round(sizes.sum() * temperature_shares(sizes, temperature, weights)).astype(np.int64)
    rng = np.random.default_rng([seed, epoch, 0x3D17])
    starts = np.concatenate(([0], np.cumsum(sizes)))
    picked = []
    for start, size, count in zip(starts[:-1], sizes, counts, strict=True):
        whole, rest = divmod(int(count), int(size))
        picked += [np.arange(start, start + size)] * whole
        picked.append(start + rng.permutation(int(size))[:rest])
    return np.sort(np.concatenate(picked))


def direction_parts(
    data_dir: Path, data: DataConfig, split: str, bpe: spm.SentencePieceProcessor
) -> dict[str, tuple[ParallelDataset, np.ndarray]]:
    """Each direction's prepared ``split`` with the ids its sources start with (its target tag), by name."""
    return {
        way.name: (
            ParallelDataset(data_dir, split_name(split, data, way), way.src, way.tgt),
            source_prefix(data, bpe, way.tgt),
        )
        for way in directions(data)
    }


def train_mix(data_dir: Path, data: DataConfig, bpe: spm.SentencePieceProcessor) -> CorpusMix:
    """Every training part (`train_parts`: each direction's pairs, then each synthetic corpus's) behind the ids its
    sources start with (the target tag; <BT> for a tagged synthetic corpus)."""
    return CorpusMix([
        (ParallelDataset(data_dir, part.name, part.direction.src, part.direction.tgt),
         source_prefix(data, bpe, part.direction.tgt, part.tagged))
        for part in train_parts(data)
    ])  # fmt: skip
