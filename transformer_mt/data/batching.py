"""Token-bucketed batching as pure functions (the fairseq recipe, without its Cython).

ordered_indices -> batch_by_size -> shuffle_batches(seed, epoch) -> shard_batches for training;
batches_by_tokens for decoding, cut by the same rule.

Sentences are sorted by length so that a batch holds sentences of about the
same length (little padding, as the paper's "batched together by approximate
sequence length"); the batches, not the sentences, are then shuffled each
epoch. A batch's cost is sentences x longest sentence, padding included,
counted on source and target separately; both stay within ``max_tokens``.
All lengths are in tokens and include the EOS/BOS that collation adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ordered_indices(src_lens: np.ndarray, tgt_lens: np.ndarray, seed: int | Sequence[int]) -> np.ndarray:
    """Sentence indices sorted by target length, then by source length, ties broken at random.

    The source order alternates (ascending for one target length, descending
    for the next) so that a batch straddling two target lengths still holds
    similar source lengths: on Multi30k at 4096 tokens this halves source
    padding compared with a plain (target, source) sort. The seeded noise
    decides the order among sentences of equal lengths, so batches of equally
    long sentences are not always the same groups.
    """
    src_lens, tgt_lens = np.asarray(src_lens, dtype=np.int64), np.asarray(tgt_lens, dtype=np.int64)
    noise = np.random.default_rng(seed).permutation(len(src_lens))
    snake = np.where(tgt_lens % 2 == 0, src_lens, -src_lens)
    return np.lexsort((noise, snake, tgt_lens)).astype(np.int64)


def too_long(src_lens: np.ndarray, tgt_lens: np.ndarray, max_len: int) -> np.ndarray:
    """Boolean mask of sentences longer than ``max_len`` tokens on either side.

    ``max_len`` is the longest allowed sentence, EOS/BOS included: usually
    ``min(train.max_tokens, model.max_positions)``, i.e. a sentence must fit a
    batch on its own and the model's position table.
    """
    return (np.asarray(src_lens) > max_len) | (np.asarray(tgt_lens) > max_len)


def batch_by_size(
    indices: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, max_len: int | None = None
) -> list[np.ndarray]:
    """Cut ``indices`` (in order) into consecutive batches whose padded size fits ``max_tokens``.

    A batch closes when adding the next sentence would make ``sentences x
    longest`` exceed ``max_tokens`` on the source or the target side.
    Sentences longer than ``min(max_tokens, max_len)`` tokens (``max_len``
    None: ``max_tokens``) are skipped; ``too_long`` with that limit counts them.
    """
    indices = np.asarray(indices, dtype=np.int64)
    limit = max_tokens if max_len is None else min(max_tokens, max_len)
    keep = ~too_long(src_lens, tgt_lens, limit)[indices]
    indices = indices[keep]
    bounds = _bounds(np.asarray(src_lens)[indices].tolist(), np.asarray(tgt_lens)[indices].tolist(), max_tokens)
    return [indices[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def batches_by_tokens(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Decoding's batches: ``indices`` longest first (equal lengths keep their order), cut as `batch_by_size` cuts.

    One length per sentence, the source's (decoding has no target yet).
    Longest first, so that running out of memory shows at once. Nothing is
    dropped, since every input line must be translated: a sentence longer
    than ``max_tokens`` gets a batch of its own.
    """
    order = sorted(range(len(indices)), key=lambda j: -lengths[j])  # stable
    ordered = [lengths[j] for j in order]
    bounds = _bounds(ordered, ordered, max_tokens)
    return [[indices[j] for j in order[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _bounds(s_list: list[int], t_list: list[int], max_tokens: int) -> list[int]:
    """Where consecutive batches start (and the end): the one rule of what fits a batch, for training and decoding.

    A batch closes when adding the next sentence would make ``sentences x
    longest`` exceed ``max_tokens`` on the source or the target side; a first
    sentence always joins (one over the budget is alone in its batch).
    """
    bounds = [0]
    start, s_max, t_max = 0, 0, 0
    for pos, (s, t) in enumerate(zip(s_list, t_list, strict=True)):
        s_new, t_new = max(s_max, s), max(t_max, t)
        n = pos - start + 1
        if pos > start and (n * s_new > max_tokens or n * t_new > max_tokens):
            bounds.append(pos)
            start, s_new, t_new = pos, s, t
        s_max, t_max = s_new, t_new
    if s_list:
        bounds.append(len(s_list))
    return bounds


def shuffle_batches(batches: list[np.ndarray], seed: int, epoch: int) -> list[np.ndarray]:
    """The batches in a random order that depends on ``seed`` and ``epoch`` only."""
    order = np.random.default_rng([seed, epoch]).permutation(len(batches))
    return [batches[i] for i in order]


def shard_batches(batches: list[np.ndarray], rank: int, world_size: int) -> list[np.ndarray]:
    """Rank ``rank``'s share: every ``world_size``-th batch, the same count on every rank.

    To make the count divisible, the largest batches are split in two (halves
    of a batch fit ``max_tokens`` too); only when no batch has two sentences
    left to split is an empty batch added, which the trainer counts as a
    zero-weight step. Every rank computes the same split, so no communication
    is needed.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    batches = list(batches)
    while len(batches) % world_size:
        sizes = [len(b) for b in batches]
        largest = int(np.argmax(sizes)) if batches else -1
        if largest < 0 or sizes[largest] < 2:
            batches.append(np.zeros(0, dtype=np.int64))
            continue
        half = sizes[largest] // 2
        big = batches[largest]
        batches[largest : largest + 1] = [big[:half], big[half:]]
    return batches[rank::world_size]


def epoch_batches(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    max_len: int | None = None,
) -> list[np.ndarray]:
    """This rank's batches of sentence indices for one epoch (epochs count from 1).

    The length-sorting noise and the batch order both depend on ``(seed,
    epoch)``, so each epoch sees different batches, reproducibly. Sentences
    longer than ``min(max_tokens, max_len)`` are left out (see `batch_by_size`).
    """
    return shard_batches(_shuffled(src_lens, tgt_lens, max_tokens, seed, epoch, max_len), rank, world_size)


def _shuffled(
    src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, seed: int, epoch: int, max_len: int | None
) -> list[np.ndarray]:
    """The whole world's batches of one epoch, in their shuffled order, before sharding."""
    order = ordered_indices(src_lens, tgt_lens, (seed, epoch))
    return shuffle_batches(batch_by_size(order, src_lens, tgt_lens, max_tokens, max_len), seed, epoch)


def resume_position(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    seed: int,
    epoch: int,
    consumed: int,
    old_world_size: int,
    new_world_size: int,
    max_len: int | None = None,
) -> int | None:
    """Per-rank position in ``epoch`` for ``new_world_size`` ranks after ``consumed`` per-rank batches of ``old``.

    Rank r of W consumes ``padded[r::W]``, so after ``consumed`` batches per
    rank the world has consumed exactly the first ``consumed x W`` batches of
    the padded global order (`shard_batches` before slicing). That order
    depends on W (which batches were split to make the count divisible), so
    the position carries over exactly only when both world sizes share that
    prefix and it divides evenly among the new ranks, or at an epoch's start
    or end. Returns None when no exact position exists.
    """
    if old_world_size == new_world_size or consumed == 0:
        return consumed
    shuffled = _shuffled(src_lens, tgt_lens, max_tokens, seed, epoch, max_len)
    old = _padded_order(shuffled, old_world_size)
    new = _padded_order(shuffled, new_world_size)
    done = consumed * old_world_size
    if done >= len(old) or not any(len(b) for b in old[done:]):
        return len(new) // new_world_size  # the epoch was finished (only empty fillers were left)
    if done % new_world_size or done > len(new):
        return None
    if not all(np.array_equal(a, b) for a, b in zip(old[:done], new[:done], strict=True)):
        return None
    return done // new_world_size


def _padded_order(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """The global batch order `shard_batches` deals out to ``world_size`` ranks (``padded[r::world_size]``)."""
    shards = [shard_batches(batches, r, world_size) for r in range(world_size)]
    return [shard[i] for i in range(len(shards[0])) for shard in shards]
