"""ParallelDataset and collate: the contract the trainer and the decoder rely on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transformer_mt.data.batching import epoch_batches
from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.data.dataset import DatasetError, ParallelDataset, collate


@pytest.fixture(scope="module")
def train(prepared_toy) -> ParallelDataset:
    d = prepared_toy.data
    return ParallelDataset(d.dir, "train", d.src_lang, d.tgt_lang)


def test_lengths_include_the_added_token(train):
    assert train.src_lens.dtype == np.int64 and train.tgt_lens.dtype == np.int64
    for i in (0, 7, len(train) - 1):
        assert train.src_lens[i] == len(train.src_ids(i)) + 1
        assert train.tgt_lens[i] == len(train.tgt_ids(i)) + 1


def test_collate_layout(train):
    idx = np.array([3, 0, 11])
    batch = collate(train, idx)
    B, S, T = 3, int(train.src_lens[idx].max()), int(train.tgt_lens[idx].max())  # noqa: N806
    assert batch.src.shape == (B, S) and batch.tgt_in.shape == (B, T) and batch.tgt_out.shape == (B, T)
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    for row, i in enumerate(idx):
        s, t = train.src_ids(i).tolist(), train.tgt_ids(i).tolist()
        assert batch.src[row].tolist() == s + [EOS] + [PAD] * (S - len(s) - 1)
        assert batch.tgt_in[row].tolist() == [BOS] + t + [PAD] * (T - len(t) - 1)
        assert batch.tgt_out[row].tolist() == t + [EOS] + [PAD] * (T - len(t) - 1)
    assert batch.num_tgt_tokens == int(train.tgt_lens[idx].sum())
    assert batch.num_src_tokens == int(train.src_lens[idx].sum())


def test_collated_batches_respect_max_tokens(train, prepared_toy):
    max_tokens = prepared_toy.train.max_tokens
    for b in epoch_batches(train.src_lens, train.tgt_lens, max_tokens, seed=1, epoch=1)[:20]:
        batch = collate(train, b)
        assert batch.src.numel() <= max_tokens and batch.tgt_out.numel() <= max_tokens


def test_empty_batch_holds_no_tokens(train):
    batch = collate(train, np.zeros(0, dtype=np.int64))
    assert batch.src.shape == (0, 1) and batch.num_tgt_tokens == 0 and len(batch) == 0


def test_missing_split_says_to_prepare(tmp_path):
    with pytest.raises(DatasetError, match="tmt prepare"):
        ParallelDataset(tmp_path, "train", "en", "de")


def test_sides_of_two_lengths_or_a_damaged_side_are_user_errors(tmp_path):
    """A UserError naming the directory and `tmt prepare --force`, not a ValueError from numpy."""
    for lang, sentences in (("en", 2), ("de", 1)):
        np.save(tmp_path / f"train.{lang}.ids.npy", np.arange(sentences, dtype=np.int32))
        np.save(tmp_path / f"train.{lang}.offsets.npy", np.arange(sentences + 1, dtype=np.int64))
    with pytest.raises(DatasetError, match=r"train\.en has 2 sentences but train\.de has 1; run `tmt prepare"):
        ParallelDataset(tmp_path, "train", "en", "de")
    (tmp_path / "train.de.offsets.npy").write_bytes(b"not numpy")
    with pytest.raises(DatasetError, match=r"train\.de cannot be read .*tmt prepare CONFIG --force"):
        ParallelDataset(tmp_path, "train", "en", "de")
