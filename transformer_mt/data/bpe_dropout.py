"""Subword regularization (``bpe.sampling_alpha``): each epoch's training set, encoded with BPE-dropout.

Kudo (2018) trains on a different segmentation of each sentence every time
it is seen; for a BPE model that is BPE-dropout (Provilkov et al., 2020),
which sentencepiece's ``encode(..., enable_sampling=True, alpha=alpha,
nbest_size=-1)`` runs for a BPE model: the best merge left is skipped for good
with probability ``alpha``, so words come out in smaller pieces now and then,
always spelling the same text. Prepare keeps the cleaned training text in
``data.dir`` (`prepare.train_text_files`) and every epoch re-encodes it here,
in memory; validation, test and decoding keep the prepared, deterministic
encoding.

`BpeDropout` is sentencepiece's BPE encoding and sampling, in Python: the
draws of sentencepiece 0.2 cannot be repeated in another process (its
``set_random_generator_seed`` repeats them only within one), and a resumed run
must see the same epochs. With ``alpha`` 0 it gives sentencepiece's ids
exactly (tested on whole corpora). The draws are a pure function of
``(train.seed, epoch)``: chunks of ``binarize.CHUNK_PAIRS`` pairs, each side
drawn from its own generator seeded by ``(seed, epoch, chunk)``, so a resumed
run, every rank of a distributed one, any number of worker processes and any
machine get the same epoch. The epoch's batches are then cut from the sampled
lengths.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from pathlib import Path

import numpy as np
import sentencepiece as spm

from transformer_mt.data.binarize import _chunks
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.dataset import ParallelDataset

_SPACE = "\u2581"  # sentencepiece's whitespace symbol
PARALLEL_PAIRS = 200_000  # below this, worker processes take longer to start than to help


def chunk_seed(seed: int, epoch: int, chunk: int, side: int) -> int:
    """The seed of one side (0 source, 1 target) of one chunk of ``epoch``'s training text."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, chunk, side]).generate_state(2, np.uint64)
    return int(state[0]) << 64 | int(state[1])


class BpeDropout:
    """sentencepiece's BPE model (identity normalization, a dummy prefix, pieces within words), its merges sampled.

    Encoding joins the adjacent pair of symbols whose concatenation is the
    highest-scoring piece (the leftmost among equals) until none is left, as
    sentencepiece does; with ``alpha`` > 0 each such best pair is first
    dropped for good with probability ``alpha`` (sentencepiece's BPE-dropout).
    A character outside the vocabulary is ``<unk>``, a run of them one
    ``<unk>``, as sentencepiece gives them.
    """

    def __init__(self, sp: spm.SentencePieceProcessor) -> None:
        normal = (
            i for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
        )
        self.pieces = {sp.id_to_piece(i): (sp.get_score(i), i) for i in normal}
        self.unk = sp.unk_id()

    def encode(self, line: str, alpha: float, rng: random.Random) -> list[int]:
        """The ids of one normalized line."""
        ids: list[int] = []
        text = _SPACE + line.replace(" ", _SPACE) if line else ""
        start = 0
        while start < len(text):
            end = text.find(_SPACE, start + 1)
            end = len(text) if end < 0 else end
            for piece in self._word(text[start:end], alpha, rng):
                found = self.pieces.get(piece)
                if found is not None:
                    ids.append(found[1])
                elif not ids or ids[-1] != self.unk:
                    ids.append(self.unk)
            start = end
        return ids

    def _word(self, word: str, alpha: float, rng: random.Random) -> list[str]:
        if len(word) < 2:
            return [word]
        pieces, symbols = self.pieces, list(word)
        # the piece (score, id) each adjacent pair would make, None where none or dropped: a pair stays dropped
        # until one of its two symbols changes, which recomputes its entry
        pairs = [pieces.get(a + b) for a, b in zip(word, word[1:], strict=False)]
        while True:
            best, best_score = -1, 0.0
            for i, pair in enumerate(pairs):
                if pair is not None and (best < 0 or pair[0] > best_score):
                    best, best_score = i, pair[0]
            if best < 0:
                return symbols
            if alpha > 0 and rng.random() < alpha:
                pairs[best] = None
                continue
            symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
            del pairs[best]
            if best > 0:
                pairs[best - 1] = pieces.get(symbols[best - 1] + symbols[best])
            if best < len(pairs):
                pairs[best] = pieces.get(symbols[best] + symbols[best + 1])


@lru_cache(maxsize=2)
def _dropout(model_path: str) -> BpeDropout:
    """The model's `BpeDropout`, once per process (each worker builds its own)."""
    return BpeDropout(load_bpe(model_path))


@dataclass
class SampledEpoch:
    """One epoch's training set in its sampled encoding, and what encoding it cost."""

    dataset: ParallelDataset
    seconds: float
    src_tokens: int
    tgt_tokens: int


def _sample_chunk(
    model: str, src: list[str], tgt: list[str], alpha: float, seeds: tuple[int, int], dtype: np.dtype
) -> tuple[np.ndarray, ...]:
    """One chunk's sampled ids and lengths: source ids, source lengths, target ids, target lengths."""
    bpe, out = _dropout(model), []
    for lines, side_seed in zip((src, tgt), seeds, strict=True):
        rng = random.Random(side_seed)
        pieces = [bpe.encode(line, alpha, rng) for line in lines]
        n = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        out += [np.fromiter(chain.from_iterable(pieces), dtype=dtype, count=int(n.sum())), n]
    return tuple(out)


def sample_epoch(
    data_dir: str | Path,
    text: tuple[Path, Path],
    alpha: float,
    seed: int,
    epoch: int,
    dtype: np.dtype,
    workers: int = 1,
    pairs: int = 0,
) -> SampledEpoch:
    """Encode the training text ``text`` (source, target files) with BPE-dropout ``alpha`` for ``epoch``.

    With ``workers`` > 1 and more than `PARALLEL_PAIRS` ``pairs``, chunks are
    encoded in that many processes (starting them costs seconds): the same
    result, since each chunk is seeded by its index.
    """
    start = time.perf_counter()
    model = str(Path(data_dir) / "spm.model")
    jobs = (
        (model, src, tgt, alpha, (chunk_seed(seed, epoch, chunk, 0), chunk_seed(seed, epoch, chunk, 1)), dtype)
        for chunk, (src, tgt) in enumerate(_chunks(*text))
    )
    if workers > 1 and pairs > PARALLEL_PAIRS:
        context = multiprocessing.get_context("forkserver")
        results, pending = [], deque()
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            for job in jobs:  # at most 2 chunks per worker in flight: the text is not all read at once
                pending.append(pool.submit(_sample_chunk, *job))
                if len(pending) >= 2 * workers:
                    results.append(pending.popleft().result())
            results += [future.result() for future in pending]
    else:
        results = [_sample_chunk(*job) for job in jobs]
    sides = [[r[0] for r in results], [r[2] for r in results]]  # per side: the chunks' ids ...
    lens = [[r[1] for r in results], [r[3] for r in results]]  # ... and their lengths
    arrays = []
    for ids, n in zip(sides, lens, strict=True):
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(n) if n else [], dtype=np.int64)]).astype(np.int64)
        arrays.append((flat, offsets))
    dataset = ParallelDataset.from_arrays(data_dir, "train", arrays[0], arrays[1])
    return SampledEpoch(dataset, time.perf_counter() - start, len(arrays[0][0]), len(arrays[1][0]))
