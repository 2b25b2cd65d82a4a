"""The joint BPE model: special ids, round trip, and the vocabulary-size message."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformer_mt.data.bpe import BOS, EOS, PAD, UNK, BpeError, load_bpe, load_bpe_bytes, train_bpe


def test_special_ids_are_fixed(prepared_toy):
    sp = load_bpe(Path(prepared_toy.data.dir) / "spm.model")
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD, UNK, BOS, EOS)


def test_round_trip_of_training_text(prepared_toy):
    path = Path(prepared_toy.data.dir) / "spm.model"
    sp = load_bpe_bytes(path.read_bytes())
    for lang in ("en", "de"):  # one joint vocabulary covers both languages
        lines = Path(f"{prepared_toy.data.train}.{lang}").read_text(encoding="utf-8").splitlines()[:200]
        for line in lines:
            ids = sp.encode(line, out_type=int)
            assert UNK not in ids
            assert sp.decode(ids) == line


def test_train_bpe_learns_exactly_the_requested_size(tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text("the red car sees the old house\nder rote Wagen sieht das alte Haus\n" * 50, encoding="utf-8")
    model = train_bpe(sample, tmp_path / "m", vocab_size=60, character_coverage=1.0)
    assert load_bpe(model).get_piece_size() == 60


def test_vocabulary_too_large_names_the_key_and_a_size(tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text("ab ba\n" * 20, encoding="utf-8")
    with pytest.raises(BpeError, match=r"bpe\.vocab_size=500 cannot be reached.*try --set bpe\.vocab_size=(\d+)") as e:
        train_bpe(sample, tmp_path / "m", vocab_size=500, character_coverage=1.0)
    limit = int(str(e.value).split("--set bpe.vocab_size=")[1].split()[0])
    assert (
        load_bpe(train_bpe(sample, tmp_path / "m", vocab_size=limit, character_coverage=1.0)).get_piece_size() == limit
    )
