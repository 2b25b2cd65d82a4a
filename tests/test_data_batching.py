"""Batching invariants: coverage, budget, sharding, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from transformer_mt.data.batching import (
    batch_by_size,
    batches_by_tokens,
    epoch_batches,
    ordered_indices,
    resume_position,
    shard_batches,
    shuffle_batches,
    too_long,
)


@pytest.fixture
def lens() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    src = rng.integers(1, 80, size=3000)
    tgt = np.clip(src + rng.integers(-10, 10, size=3000), 1, None)
    return src, tgt


def _padded(batch: np.ndarray, lens: np.ndarray) -> int:
    return len(batch) * int(lens[batch].max())


def test_ordered_indices_sorts_by_target_then_alternating_source(lens):
    src, tgt = lens
    order = ordered_indices(src, tgt, seed=1)
    assert sorted(order.tolist()) == list(range(len(src)))
    assert np.all(np.diff(tgt[order]) >= 0)
    for t in (20, 21):
        s = src[order][tgt[order] == t]
        assert np.all(np.diff(s) >= 0) if t % 2 == 0 else np.all(np.diff(s) <= 0)


def test_ordered_indices_noise_breaks_ties_by_seed():
    src = tgt = np.full(100, 5)
    a, b = ordered_indices(src, tgt, seed=1), ordered_indices(src, tgt, seed=2)
    assert np.array_equal(a, ordered_indices(src, tgt, seed=1))
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("max_tokens", [80, 512, 4096])
def test_every_batch_within_max_tokens_and_every_sentence_once(lens, max_tokens):
    src, tgt = lens
    batches = batch_by_size(ordered_indices(src, tgt, 1), src, tgt, max_tokens)
    for b in batches:
        assert len(b) > 0
        assert _padded(b, src) <= max_tokens and _padded(b, tgt) <= max_tokens
    seen = np.concatenate(batches)
    assert len(seen) == len(set(seen.tolist()))
    assert set(seen.tolist()) == set(np.flatnonzero(~too_long(src, tgt, max_tokens)).tolist())


def test_batches_are_greedy_full(lens):
    """A batch closes only when the next sentence would not fit."""
    src, tgt = lens
    order = ordered_indices(src, tgt, 1)
    batches = batch_by_size(order, src, tgt, 1024)
    for b, nxt in zip(batches[:-1], batches[1:], strict=True):
        grown = np.append(b, nxt[0])
        assert _padded(grown, src) > 1024 or _padded(grown, tgt) > 1024


def test_long_sentences_are_dropped_and_counted():
    src = np.array([3, 50, 4, 5, 200])
    tgt = np.array([3, 4, 120, 5, 4])
    batches = batch_by_size(np.arange(5), src, tgt, max_tokens=100)
    kept = sorted(np.concatenate(batches).tolist())
    assert kept == [0, 1, 3]
    assert int(too_long(src, tgt, 100).sum()) == 2


def test_max_len_drops_sentences_longer_than_the_model_accepts(lens):
    """max_len (e.g. model.max_positions) below max_tokens: the tighter limit applies, on both sides."""
    src, tgt = lens
    batches = batch_by_size(ordered_indices(src, tgt, 1), src, tgt, 4096, max_len=50)
    kept = np.concatenate(batches)
    assert max(src[kept].max(), tgt[kept].max()) <= 50
    assert sorted(kept.tolist()) == np.flatnonzero(~too_long(src, tgt, 50)).tolist()
    assert len(kept) < len(src)
    # a max_len above max_tokens changes nothing
    loose = batch_by_size(ordered_indices(src, tgt, 1), src, tgt, 60, max_len=1000)
    assert key(loose) == key(batch_by_size(ordered_indices(src, tgt, 1), src, tgt, 60))
    per_rank = epoch_batches(src, tgt, 4096, seed=1, epoch=1, max_len=50)
    assert sorted(np.concatenate(per_rank).tolist()) == sorted(kept.tolist())


def test_empty_input_gives_no_batches():
    assert batch_by_size(np.array([], dtype=np.int64), np.array([]), np.array([]), 100) == []


def key(batches: list[np.ndarray]) -> list[tuple[int, ...]]:
    return [tuple(b.tolist()) for b in batches]


def test_shuffle_is_a_permutation_seeded_by_epoch(lens):
    src, tgt = lens
    batches = batch_by_size(ordered_indices(src, tgt, 1), src, tgt, 512)
    e1, e1b, e2 = (shuffle_batches(batches, 7, 1), shuffle_batches(batches, 7, 1), shuffle_batches(batches, 7, 2))
    assert key(e1) == key(e1b)
    assert key(e1) != key(e2)
    assert sorted(key(e1)) == sorted(key(batches))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_have_equal_counts_and_cover_every_sentence_once(lens, world_size):
    src, tgt = lens
    batches = batch_by_size(ordered_indices(src, tgt, 1), src, tgt, 2048)
    shards = [shard_batches(batches, r, world_size) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    all_ids = np.concatenate([b for s in shards for b in s])
    assert sorted(all_ids.tolist()) == sorted(np.concatenate(batches).tolist())
    assert all(len(b) > 0 for s in shards for b in s)  # splitting sufficed, no empty filler
    for s in shards:
        assert all(_padded(b, src) <= 2048 and _padded(b, tgt) <= 2048 for b in s)


def test_shard_adds_empty_batches_only_when_nothing_can_be_split():
    batches = [np.array([0]), np.array([1]), np.array([2])]
    shards = [shard_batches(batches, r, 2) for r in range(2)]
    assert [len(s) for s in shards] == [2, 2]
    assert sorted(len(b) for s in shards for b in s) == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="rank 2"):
        shard_batches(batches, 2, 2)


def test_epoch_batches_deterministic_and_different_across_epochs(lens):
    src, tgt = lens
    a = epoch_batches(src, tgt, 1024, seed=3, epoch=1, rank=1, world_size=2)
    b = epoch_batches(src, tgt, 1024, seed=3, epoch=1, rank=1, world_size=2)
    c = epoch_batches(src, tgt, 1024, seed=3, epoch=2, rank=1, world_size=2)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    r0 = epoch_batches(src, tgt, 1024, seed=3, epoch=1, rank=0, world_size=2)
    assert len(r0) == len(a)
    covered = sorted(np.concatenate(r0 + a).tolist())
    assert covered == list(range(len(src)))


def _consumed(src, tgt, consumed: int, world_size: int) -> list[int]:
    """Sentences consumed by all ranks after ``consumed`` batches each."""
    shards = [epoch_batches(src, tgt, 1024, 3, 1, r, world_size) for r in range(world_size)]
    return sorted(i for s in shards for b in s[:consumed] for i in b.tolist())


def test_resume_position_carries_over_exactly_or_says_it_cannot(lens):
    """Whenever a position is returned, the new ranks have consumed exactly the sentences the old ones had."""
    src, tgt = lens[0][:500], lens[1][:500]
    converted = refused = 0
    for old, new in [(1, 2), (2, 1), (2, 3), (3, 2), (1, 4)]:
        per_rank = len(epoch_batches(src, tgt, 1024, 3, 1, 0, old))
        for consumed in range(per_rank + 1):
            position = resume_position(src, tgt, 1024, 3, 1, consumed, old, new)
            refused += position is None
            if position is not None:
                assert _consumed(src, tgt, position, new) == _consumed(src, tgt, consumed, old), (old, new, consumed)
                converted += 0 < consumed < per_rank
        assert resume_position(src, tgt, 1024, 3, 1, 0, old, new) == 0
        assert resume_position(src, tgt, 1024, 3, 1, per_rank, old, new) == len(
            epoch_batches(src, tgt, 1024, 3, 1, 0, new)
        )
    assert converted > 0 and refused > 0  # both cases occur on this data


def test_resume_position_same_world_size_is_unchanged(lens):
    src, tgt = lens
    assert resume_position(src, tgt, 1024, 3, 1, 17, 2, 2) == 17


def test_decoding_batches_bound_and_cover_every_sentence() -> None:
    lengths = [5, 30, 2, 7, 7, 100, 1, 12, 12, 3]
    batches = batches_by_tokens(list(range(len(lengths))), lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 40
    assert batches[0] == [5]  # longest first, alone since it exceeds the budget
    assert batches_by_tokens([], [], 40) == []


def test_decoding_and_training_cut_batches_by_one_rule(lens) -> None:
    """Sentences in the same (longest first) order, none too long: both batchers make the same batches."""
    src, _ = lens
    labels = (np.arange(len(src)) * 7 + 3).tolist()  # decoding returns the indices it is given, in batches
    order = np.argsort(-src, kind="stable")
    training = batch_by_size(order, src, src, 400)
    decoding = batches_by_tokens(labels, src.tolist(), 400)
    assert decoding == [[labels[i] for i in b] for b in training]
