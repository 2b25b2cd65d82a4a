"""Encoding cleaned text into memory-mapped id arrays, in parallel worker processes.

Memory stays flat whatever the corpus size: the main process reads a chunk
of lines, hands it to a worker, and appends the returned ids and offsets to
``.npy`` files on disk; only a few chunks are in flight at a time.
"""

from __future__ import annotations

import io
import multiprocessing
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, islice
from pathlib import Path

import numpy as np
import sentencepiece as spm

from transformer_mt.data.bpe import UNK, load_bpe
from transformer_mt.progress import progress

CHUNK_PAIRS = 2000  # sentence pairs per unit of work handed to a worker
_HEADER_BYTES = 128  # room reserved for the .npy header; enough for any 1-D shape


class NpyAppender:
    """A 1-D ``.npy`` file written by appending chunks, its header filled in on `close`.

    The header holds the array length, unknown until the end, so the data
    starts at a fixed offset and the header is written last into the space
    reserved before it.
    """

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(b"\0" * _HEADER_BYTES)

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        )
        raw = header.getvalue()
        if len(raw) > _HEADER_BYTES:
            raise ValueError(f"{self.path}: .npy header of {len(raw)} bytes does not fit")
        raw = raw[:-1].ljust(_HEADER_BYTES - 1, b" ") + b"\n"  # pad, keeping the header's own length field right
        raw = raw[:8] + (_HEADER_BYTES - 10).to_bytes(2, "little") + raw[10:]
        self._file.seek(0)
        self._file.write(raw)
        self._file.close()


class SideWriter:
    """The ``ids`` and ``offsets`` arrays of one side of one split."""

    def __init__(self, ids_path: Path, offsets_path: Path, dtype: np.dtype) -> None:
        self.ids = NpyAppender(ids_path, dtype)
        self.offsets = NpyAppender(offsets_path, np.int64)
        self.offsets.append(np.zeros(1, dtype=np.int64))

    def append(self, ids: np.ndarray, lens: np.ndarray) -> None:
        self.offsets.append(self.ids.length + np.cumsum(lens, dtype=np.int64))
        self.ids.append(ids)

    def close(self) -> None:
        self.ids.close()
        self.offsets.close()


@lru_cache(maxsize=2)
def _processor(model_path: str) -> spm.SentencePieceProcessor:
    """``load_bpe``, once per worker process: ``encode_chunk`` runs many times in each."""
    return load_bpe(model_path)


def encode_chunk(model_path: str, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """BPE ids of ``lines``, flat (int32), and the length of each line in tokens."""
    pieces = _processor(model_path).encode(lines, out_type=int)
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    flat = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


def _encode_pair_chunk(model_path: str, src: list[str], tgt: list[str]) -> tuple[np.ndarray, ...]:
    return (*encode_chunk(model_path, src), *encode_chunk(model_path, tgt))


def _chunks(src_path: Path, tgt_path: Path) -> Iterator[tuple[list[str], list[str]]]:
    with open(src_path, encoding="utf-8") as fs, open(tgt_path, encoding="utf-8") as ft:
        while True:
            src = [line.rstrip("\n") for line in islice(fs, CHUNK_PAIRS)]
            tgt = [line.rstrip("\n") for line in islice(ft, CHUNK_PAIRS)]
            if not src:
                return
            yield src, tgt


@dataclass
class TokenCounts:
    """BPE tokens of an encoded split per side, and how many of them are ``<unk>``.

    ``<unk>`` stands for a character the BPE model never saw: rare with a
    model learned on the same corpus, but what a given model (``bpe.model``,
    fine-tuning on new text) meets in another script or domain, and worth
    knowing before training on it.
    """

    src_tokens: int = 0
    tgt_tokens: int = 0
    src_unk: int = 0
    tgt_unk: int = 0

    def add(self, src_ids: np.ndarray, tgt_ids: np.ndarray) -> None:
        self.src_tokens += len(src_ids)
        self.tgt_tokens += len(tgt_ids)
        self.src_unk += int(np.count_nonzero(src_ids == UNK))
        self.tgt_unk += int(np.count_nonzero(tgt_ids == UNK))


def encode_split(
    model_path: Path, src_text: Path, tgt_text: Path, src_out: SideWriter, tgt_out: SideWriter, pairs: int, workers: int
) -> TokenCounts:
    """Encode a cleaned split (one normalized sentence per line) and append it to the writers.

    ``workers`` processes encode chunks in parallel (1: in this process).
    Returns the source and target tokens, ``<unk>`` among them.
    """
    bar = progress(total=pairs, desc=f"encode {src_text.name.rsplit('.', 2)[0]}", unit="pairs", leave=False)
    totals = TokenCounts()

    def write(result: tuple[np.ndarray, ...]) -> None:
        s_ids, s_lens, t_ids, t_lens = result
        src_out.append(s_ids, s_lens)
        tgt_out.append(t_ids, t_lens)
        totals.add(s_ids, t_ids)
        bar.update(len(s_lens))

    try:
        if workers <= 1 or pairs <= 2 * CHUNK_PAIRS:  # starting processes costs more than it saves
            for src, tgt in _chunks(src_text, tgt_text):
                write(_encode_pair_chunk(str(model_path), src, tgt))
        else:
            _encode_parallel(str(model_path), src_text, tgt_text, workers, write)
    finally:
        bar.close()
    return totals


def _encode_parallel(model_path: str, src_text: Path, tgt_text: Path, workers: int, write) -> None:
    """Keep at most 2 chunks per worker in flight, and write results in input order."""
    context = multiprocessing.get_context("forkserver")
    pending: deque[Future] = deque()
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        try:
            for src, tgt in _chunks(src_text, tgt_text):
                pending.append(pool.submit(_encode_pair_chunk, model_path, src, tgt))
                if len(pending) >= 2 * workers:
                    write(pending.popleft().result())
            while pending:
                write(pending.popleft().result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
