"""`tmt data-stats` and the padding measure it reports."""

from __future__ import annotations

import numpy as np
import pytest

from transformer_mt.data.prepare import PrepareError
from transformer_mt.data.stats import format_stats, padding_fraction


def test_padding_fraction_by_hand():
    src, tgt = np.array([2, 4, 3, 3]), np.array([5, 5, 1, 3])
    pad = padding_fraction([np.array([0, 1]), np.array([2, 3])], src, tgt)
    # source: real 12 in 2*4 + 2*3 = 14; target: real 14 in 2*5 + 2*3 = 16
    assert pad["src"] == pytest.approx(2 / 14)
    assert pad["tgt"] == pytest.approx(2 / 16)
    assert pad["all"] == pytest.approx(4 / 30)


def test_format_stats_reports_every_split(prepared_toy):
    text = format_stats(prepared_toy)
    for needle in ("train: 2,000 pairs", "valid: 100 pairs", "test: 100 pairs", "p99", "max_tokens=512", "padding"):
        assert needle in text


def test_format_stats_before_prepare_says_what_to_run(prepared_toy, tmp_path):
    import dataclasses

    cfg = dataclasses.replace(prepared_toy, data=dataclasses.replace(prepared_toy.data, dir=str(tmp_path / "none")))
    with pytest.raises(PrepareError, match="tmt prepare"):
        format_stats(cfg)


def test_format_stats_counts_what_training_skips(prepared_toy):
    """Sentences longer than model.max_positions are skipped by training, so data-stats counts them too."""
    import dataclasses

    from transformer_mt.data.batching import too_long
    from transformer_mt.data.dataset import ParallelDataset

    cfg = dataclasses.replace(prepared_toy, model=dataclasses.replace(prepared_toy.model, max_positions=20))
    d = cfg.data
    ds = ParallelDataset(d.dir, "train", d.src_lang, d.tgt_lang)
    expected = int(too_long(ds.src_lens, ds.tgt_lens, 20).sum())
    assert expected > 0
    assert f"{expected} sentences longer than 20 tokens" in format_stats(cfg)
