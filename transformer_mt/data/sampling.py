"""Subword regularization (``bpe.sampling_alpha``): each epoch's training set, encoded with BPE-dropout.

Kudo (2018) trains on a different segmentation of each sentence every time
it is seen; for a BPE model sentencepiece's sampling is BPE-dropout (Provilkov
et al., 2020): each merge is skipped with probability ``alpha``, so words come
out in smaller pieces now and then, always spelling the same text. Prepare
keeps the cleaned training text in ``data.dir`` (`prepare.train_text_files`)
and every epoch re-encodes it here, in memory; validation, test and decoding
keep the prepared, deterministic encoding.

The draws are a pure function of ``(train.seed, epoch)``: chunks of
`binarize.CHUNK_PAIRS` pairs, each side seeded from ``(seed, epoch, chunk)``, so a
resumed run, every rank of a distributed one, and any machine get the same
epoch. The epoch's batches are then cut from the sampled lengths.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import sentencepiece as spm

from transformer_mt.data.binarize import _chunks, _processor
from transformer_mt.data.dataset import ParallelDataset

_UNSET = 0xFFFFFFFF  # sentencepiece's "no seed": it would draw one from the system's entropy instead
_SEED_LOCK = threading.Lock()  # sentencepiece's seed is global to the process


def chunk_seeds(seed: int, epoch: int, chunk: int) -> tuple[int, int]:
    """The sentencepiece seeds (32-bit) of one chunk's source and target sides in ``epoch``."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, chunk]).generate_state(2, np.uint32)
    src, tgt = (int(s) if s != _UNSET else 0 for s in state)
    return src, tgt


def sample_encode(sp: spm.SentencePieceProcessor, lines: list[str], alpha: float, seed: int) -> list[list[int]]:
    """BPE-dropout ids of ``lines`` (merges dropped with probability ``alpha``), the same for the same seed.

    A list is encoded on a thread sentencepiece starts for the call, whose
    generator is seeded on first use from the global seed set just before;
    one thread, so that the draws do not depend on the scheduling.
    """
    with _SEED_LOCK:
        spm.set_random_generator_seed(seed)
        return sp.encode(lines, out_type=int, enable_sampling=True, alpha=alpha, nbest_size=-1, num_threads=1)


@dataclass
class SampledEpoch:
    """One epoch's training set in its sampled encoding, and what encoding it cost."""

    dataset: ParallelDataset
    seconds: float
    src_tokens: int
    tgt_tokens: int


def sample_epoch(
    data_dir: str | Path, text: tuple[Path, Path], alpha: float, seed: int, epoch: int, dtype: np.dtype
) -> SampledEpoch:
    """Encode the training text ``text`` (source, target files) with BPE-dropout ``alpha`` for ``epoch``."""
    start = time.perf_counter()
    model = str(Path(data_dir) / "spm.model")
    sp = _processor(model)
    sides: list[list[np.ndarray]] = [[], []]  # per side: the chunks' ids, then their lengths
    lens: list[list[np.ndarray]] = [[], []]
    for chunk, (src, tgt) in enumerate(_chunks(*text)):
        for side, lines, side_seed in zip((0, 1), (src, tgt), chunk_seeds(seed, epoch, chunk), strict=True):
            pieces = sample_encode(sp, lines, alpha, side_seed)
            n = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
            sides[side].append(np.fromiter(chain.from_iterable(pieces), dtype=dtype, count=int(n.sum())))
            lens[side].append(n)
    arrays = []
    for ids, n in zip(sides, lens, strict=True):
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(n) if n else [], dtype=np.int64)]).astype(np.int64)
        arrays.append((flat, offsets))
    dataset = ParallelDataset.from_arrays(data_dir, "train", arrays[0], arrays[1])
    return SampledEpoch(dataset, time.perf_counter() - start, len(arrays[0][0]), len(arrays[1][0]))
