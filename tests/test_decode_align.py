"""Word alignments (`tmt translate --alignment`): pieces merged into words, the attention read, the line formats.

The attention is checked against the one `tmt attention` draws (one sentence
alone through `forward_with_attention`), so a batched pass that mixed up
rows, or read the wrong layer or step, fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import ConfigError, load_config
from transformer_mt.data.bpe import BOS, EOS
from transformer_mt.decode.align import (
    format_alignment,
    piece_attention,
    word_index,
    word_matrix,
)
from transformer_mt.decode.translate import TranslateError, Translator

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pieces_become_words_at_the_word_start_mark() -> None:
    assert word_index(["▁Ein", "▁Mann", "▁läuf", "t", "."]) == [0, 1, 2, 2, 2]
    assert word_index(["x", "▁a", "b"]) == [0, 1, 1]  # a first piece without the mark is still a word


def test_word_matrix_sums_source_pieces_and_averages_target_pieces() -> None:
    attention = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])  # 3 target x 3 source pieces
    matrix = word_matrix(attention, src_words=[0, 0, 1], tgt_words=[0, 1, 1])
    assert matrix.flatten().tolist() == pytest.approx([0.8, 0.2, 0.4, 0.6])


def test_hard_and_soft_formats() -> None:
    matrix = torch.tensor([[0.8, 0.2, 0.0], [0.1, 0.3, 0.6], [0.05, 0.9, 0.05]])  # 3 target x 3 source words
    assert format_alignment(matrix, "hard") == "0-0 1-2 2-1"  # i-j: source word i, target word j, sorted
    assert format_alignment(matrix, "soft") == "0.80,0.20,0.00 0.10,0.30,0.60 0.05,0.90,0.05"


@pytest.fixture(scope="module")
def translator(toy_ckpt: Path) -> Translator:
    t = Translator.from_checkpoints([toy_ckpt], device="cpu", overrides=["decode.beam_size=2", "decode.max_len_b=6"])
    t.show_progress = False
    return t


LINES = ["the cat sees the dog .", "", "a small house", "the man who sleeps reads a long book ."]


def test_batched_attention_is_each_sentence_s_own(translator: Translator) -> None:
    model = translator.model
    sources = [translator.encode(i, line) for i, line in enumerate(LINES) if line]
    targets = [[50, 60, 70], [80], [90, 91, 92, 93, 94]]
    for layer in (1,):
        batched = piece_attention(model, sources, targets, layer)
        for src, tgt, got in zip(sources, targets, batched, strict=True):
            with torch.no_grad():
                _, maps = model.forward_with_attention(torch.tensor([src]), torch.tensor([[BOS, *tgt]]))
            alone = maps.cross[layer - 1][0].mean(dim=0)[: len(tgt), : len(src) - 1]
            assert src[-1] == EOS and got.shape == (len(tgt), len(src) - 1)
            assert got == pytest.approx(alone / alone.sum(dim=1, keepdim=True), abs=1e-5)
            assert got.sum(dim=1) == pytest.approx(torch.ones(len(tgt)), abs=1e-5)


def test_alignment_lines_match_the_translations(toy_ckpt: Path) -> None:
    plain = Translator.from_checkpoints([toy_ckpt], device="cpu", overrides=["decode.max_len_b=6"])
    plain.show_progress = False
    hard = Translator.from_checkpoints(
        [toy_ckpt], device="cpu", overrides=["decode.max_len_b=6", "decode.alignment=hard"]
    )
    hard.show_progress = False
    results = hard.translate_lines_nbest(LINES, nbest=2)
    assert [[h.text for h in r] for r in results] == [
        [h.text for h in r] for r in plain.translate_lines_nbest(LINES, nbest=2)
    ]
    for line, hyps in zip(LINES, results, strict=True):
        for h in hyps:
            if not line or not h.text:
                assert h.alignment == ""
                continue
            pairs = [tuple(map(int, p.split("-"))) for p in h.alignment.split()]
            assert re.fullmatch(r"\d+-\d+( \d+-\d+)*", h.alignment)
            assert sorted({j for _, j in pairs}) == list(range(len(h.text.split())))  # one link per target word
            assert all(i < len(line.split()) for i, _ in pairs)  # toy words are single tokens between spaces
            assert pairs == sorted(pairs)
    soft = Translator.from_checkpoints(
        [toy_ckpt], device="cpu", overrides=["decode.max_len_b=6", "decode.alignment=soft"]
    )
    soft.show_progress = False
    (first,) = soft.translate_lines_nbest(LINES[:1], nbest=1)
    rows = [[float(p) for p in word.split(",")] for word in first[0].alignment.split(" ")]
    assert len(rows) == len(first[0].text.split()) and all(len(r) == len(LINES[0].split()) for r in rows)
    assert all(sum(r) == pytest.approx(1.0, abs=0.02) for r in rows)
    best = " ".join(
        sorted((f"{r.index(max(r))}-{j}" for j, r in enumerate(rows)), key=lambda p: tuple(map(int, p.split("-"))))
    )
    assert best == results[0][0].alignment  # hard is soft's most probable source word per target word


def test_tmt_translate_alignment_column_and_nbest(toy_ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.en"
    src.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    args = ["translate", "-c", str(toy_ckpt), "-i", str(src), "--set", "decode.max_len_b=6", "--alignment", "hard",
            "--beam", "3"]  # fmt: skip
    one = CliRunner().invoke(app, args)
    assert one.exit_code == 0, one.output
    rows = one.stdout.splitlines()
    assert len(rows) == len(LINES) and all(len(r.split("\t")) == 2 for r in rows)
    assert rows[1] == "\t"  # an empty line: empty translation, empty alignment
    nbest = CliRunner().invoke(app, [*args, "--nbest", "3"])
    assert nbest.exit_code == 0, nbest.output
    cells = [r.split("\t") for r in nbest.stdout.splitlines()]
    assert len(cells) == 3 * len(LINES) and all(len(c) == 4 for c in cells)
    assert [c[2:] for c in cells[::3]] == [r.split("\t") for r in rows]  # the best rows are the 1-best output


def test_alignment_needs_one_tmt_model(toy_ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.en"
    src.write_text("a cat\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["translate", "-c", str(toy_ckpt), "-c", str(toy_ckpt), "--ensemble", "-i",
                                      str(src), "--alignment", "soft"])  # fmt: skip
    assert result.exit_code == 2 and "--alignment reads the attention of one tmt model" in result.output
    with pytest.raises(TranslateError, match="one tmt model"):
        ens = Translator.from_checkpoints(
            [toy_ckpt] * 2, device="cpu", overrides=["decode.alignment=hard"], ensemble=True
        )
        ens.show_progress = False
        ens.translate_lines(["a cat"])


def test_alignment_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"decode.alignment_layer 3: the model has decoder layers 1 to 2"):
        load_config(None, ["model.decoder_layers=2", "decode.alignment_layer=3"])
    with pytest.raises(ConfigError, match="'both' is not one of 'none', 'hard', 'soft'"):
        load_config(None, ["decode.alignment=both"])
