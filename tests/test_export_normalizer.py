"""tmt's normalization built into a sentencepiece model: raw text through it alone gives tmt's ids."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from transformer_mt.config import Config
from transformer_mt.data.clean import normalize
from transformer_mt.decode.load import load_model
from transformer_mt.export.normalizer import AWKWARD_TEXT, normalizing_spm


def test_the_normalizing_model_encodes_raw_text_as_tmt_does(toy_ckpt: Path, prepared_toy: Config) -> None:
    blob = load_model([toy_ckpt], "cpu").spm_model
    exported, original = (spm.SentencePieceProcessor(model_proto=b) for b in (normalizing_spm(blob), blob))
    lines = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:50]
    for line in [*AWKWARD_TEXT, *lines, *(f"\t{x}\u200b  " for x in lines[:5])]:
        assert exported.encode(line) == original.encode(normalize(line)), line
    assert exported.decode(exported.encode(lines[0])) == lines[0]
    assert [exported.id_to_piece(i) for i in range(exported.get_piece_size())] == [
        original.id_to_piece(i) for i in range(original.get_piece_size())
    ]  # the vocabulary is untouched
