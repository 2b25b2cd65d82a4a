"""`tmt train-aligner`: a word aligner trained on a frozen model's states, its checkpoint entry, its alignments.

The supervision is eflomal's, symmetrized as `grow_diag_final_and` (checked
against Koehn's definition on a hand-made case). The trained head must
align held-out pairs better than the model's own attention does, against
the same links; translations must not change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from transformer_mt.checkpoint import CheckpointError
from transformer_mt.checkpoint.io import read_checkpoint, write_checkpoint
from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.data.clean import normalize
from transformer_mt.decode.align import format_pharaoh, word_index
from transformer_mt.decode.aligner import (
    Aligner,
    AlignerShape,
    format_links,
    link_probabilities,
    to_entry,
    word_pool,
)
from transformer_mt.decode.translate import TranslateError, Translator
from transformer_mt.train.aligner import (
    AlignerDataError,
    eflomal_links,
    eflomal_samples,
    example,
    grow_diag_final_and,
    read_links,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_grow_diag_final_and_follows_koehn() -> None:
    """The intersection, grown by neighbouring union links (diagonals too) that align a new word, then the union's
    links whose two words are both still unaligned."""
    fwd = {(0, 0), (1, 1), (3, 3)}
    rev = {(0, 0), (2, 1), (4, 4)}
    # from 0-0: 1-1 (a diagonal neighbour, both words new); from 1-1: 2-1 (source word 2 new). 3-3 and 4-4 touch
    # no link: the final step adds them, as their words are all unaligned
    assert grow_diag_final_and(fwd, rev) == {(0, 0), (1, 1), (2, 1), (3, 3), (4, 4)}
    # a union link next to no link, whose target word is already aligned, is never added
    assert grow_diag_final_and({(0, 0)}, {(0, 0), (5, 0)}) == {(0, 0)}


def test_links_files_are_checked(tmp_path: Path) -> None:
    src, tgt = ["a b c", "d e"], ["x y", "z"]
    good = tmp_path / "good.links"
    good.write_text("0-0 2-1\n\n")
    assert read_links(good, src, tgt) == [{(0, 0), (2, 1)}, set()]
    for text, message in [
        ("0-0\n", r"1 lines of links for 2 sentence pairs"),
        ("0-0\n1:1\n", r", line 2: '1:1' is not a link"),
        ("0-0\n2-0\n", r", line 2: link 2-0 but the pair has 2 source and 1 target words"),
    ]:
        bad = tmp_path / "bad.links"
        bad.write_text(text)
        with pytest.raises(AlignerDataError, match=message):
            read_links(bad, src, tgt)
    assert format_pharaoh({(2, 1), (0, 0)}) == "0-0 2-1"


def test_hard_lines_keep_the_links_at_the_threshold_and_soft_lines_the_probabilities() -> None:
    words = torch.tensor([[0.9, 0.1], [0.6, 0.7]])  # 2 target x 2 source words
    assert format_links(words, "hard", 0.5) == "0-0 0-1 1-1"  # several links for a word, or none, may be kept
    assert format_links(words, "hard", 0.8) == "0-0"
    assert format_links(words, "soft", 0.5) == "0.90,0.10 0.60,0.70"


def test_word_pools_average_each_word_s_tokens(toy_ckpt: Path) -> None:
    translator = Translator.from_checkpoints([toy_ckpt], device="cpu")
    bpe = translator.bpe
    rows = [bpe.encode("the houses .", out_type=int), bpe.encode("a", out_type=int)]
    pool = word_pool(bpe, rows, [1, 0], 1 + max(map(len, rows)))
    pieces = [bpe.id_to_piece(t) for t in rows[0]]
    words = word_index(pieces)
    for w in range(3):
        expected = torch.zeros(pool.shape[2])
        expected[[1 + t for t, x in enumerate(words) if x == w]] = 1 / words.count(w)
        torch.testing.assert_close(pool[0, w], expected)
    assert pool[1, 0, 0] == 1.0 and pool[1, 1:].sum() == 0  # a shorter sentence's missing words are empty rows


def test_an_example_keeps_the_word_links_and_refuses_links_past_the_words(toy_ckpt: Path) -> None:
    translator = Translator.from_checkpoints([toy_ckpt], device="cpu")
    bpe = translator.bpe
    source = translator.encode(0, "the cat sees the dog .")
    target = bpe.encode("die Katze sieht den Hund .", out_type=int)
    words = {(1, 1), (4, 4), (2, 2)}
    found = example(source, target, words, bpe, 0)
    assert found is not None
    assert found.links == words and found.words == (6, 6)
    assert example(source, target, {(9, 0)}, bpe, 0) is None  # a link past the words: not these words


def test_eflomal_samples_give_both_directions_links_within_the_words_and_links_their_majority(
    prepared_toy: Config,
) -> None:
    pytest.importorskip("eflomal")
    corpus = Path(prepared_toy.data.train)
    src, tgt = (Path(f"{corpus}.{x}").read_text(encoding="utf-8").splitlines()[:300] for x in ("en", "de"))
    runs = list(eflomal_samples(src, tgt, 2))
    assert len(runs) == 2 and all(len(run) == len(src) for run in runs)
    for run in runs:
        for (fwd, rev), s, t in zip(run, src, tgt, strict=True):
            assert all(i < len(s.split()) and j < len(t.split()) for i, j in fwd | rev)
        assert sum(bool(fwd & rev) for fwd, rev in run) > 0.9 * len(src)  # the directions mostly agree
    links = eflomal_links(src, tgt, 3)  # a majority of 3 fresh runs: close to any one run's symmetrized links
    one = [grow_diag_final_and(fwd, rev) for fwd, rev in runs[0]]
    shared = sum(len(a & b) for a, b in zip(links, one, strict=True))
    assert shared > 0.8 * sum(map(len, one))


def test_align_needs_an_alignment_kind(toy_ckpt: Path) -> None:
    translator = Translator.from_checkpoints([toy_ckpt], device="cpu")
    source = translator.encode(0, "The old man sees the red car.")
    with pytest.raises(TranslateError, match="decode.alignment"):
        translator.align([source], [[5, 6]])
    assert translator.with_decode({"alignment": "soft"}).align([source], [[]]) == [""]  # an empty side: no words


def _aligned(toy_trained_checkpoint: Path, prepared_toy: Config, out: Path, *args: str) -> tuple[int, str]:
    corpus = Path(prepared_toy.data.train)
    result = CliRunner().invoke(
        app,
        ["train-aligner", "-c", str(toy_trained_checkpoint), "--src", f"{corpus}.en", "--tgt", f"{corpus}.de",
         "-o", str(out), "--valid-lines", "200", "--dim", "64", *args],
    )  # fmt: skip
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def aligned(toy_trained_checkpoint: Path, prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("eflomal")
    out = tmp_path_factory.mktemp("aligner") / "aligned.pt"
    code, output = _aligned(toy_trained_checkpoint, prepared_toy, out, "--epochs", "6", "--batch-size", "16")
    assert code == 0, output
    assert "held-out link F1" in output and Path(f"{out}.links").is_file()
    return out


def _f1(found: list[set[tuple[int, int]]], gold: list[set[tuple[int, int]]]) -> float:
    hit = sum(len(f & g) for f, g in zip(found, gold, strict=True))
    return 2 * hit / (sum(map(len, found)) + sum(map(len, gold)))


def test_the_aligner_aligns_held_out_pairs_better_than_the_attention(
    aligned: Path, toy_trained_checkpoint: Path, prepared_toy: Config
) -> None:
    corpus = Path(prepared_toy.data.train)
    src = Path(f"{corpus}.en").read_text(encoding="utf-8").splitlines()[-200:]
    tgt = Path(f"{corpus}.de").read_text(encoding="utf-8").splitlines()[-200:]
    gold = read_links(Path(f"{aligned}.links"), *[Path(f"{corpus}.{x}").read_text().splitlines() for x in ("en", "de")])
    gold = gold[-200:]  # the held-out pairs: eflomal's links, never trained on
    found = {}
    for name, overrides in (("aligner", []), ("attention", ["decode.use_aligner=false"])):
        translator = Translator.from_checkpoints([aligned], device="cpu", overrides=overrides)
        assert (translator.aligner is not None) and translator.cfg.decode.use_aligner == (name == "aligner")
        sources = [translator.encode(i, line) for i, line in enumerate(src)]
        targets = [translator.bpe.encode(normalize(line), out_type=int) for line in tgt]
        lines = translator.with_decode({"alignment": "hard"}).align(sources, targets)
        found[name] = [{tuple(map(int, p.split("-"))) for p in line.split()} for line in lines]
    assert _f1(found["aligner"], gold) > 0.7
    assert _f1(found["aligner"], gold) > _f1(found["attention"], gold) + 0.1


def test_translations_do_not_change_and_the_alignment_column_comes_from_the_aligner(
    aligned: Path, toy_trained_checkpoint: Path, prepared_toy: Config
) -> None:
    lines = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:20]
    plain = Translator.from_checkpoints([toy_trained_checkpoint], device="cpu").translate_lines(lines)
    with_head = Translator.from_checkpoints([aligned], device="cpu", overrides=["decode.alignment=hard"])
    with_head.show_progress = False
    found = with_head.translate_lines_nbest(lines, nbest=1)
    assert [hyps[0].text for hyps in found] == plain
    attention = with_head.with_decode({"use_aligner": False}).translate_lines_nbest(lines, nbest=1)
    assert [h[0].alignment for h in found] != [h[0].alignment for h in attention]


def test_link_probabilities_are_each_sentence_s_own(aligned: Path) -> None:
    """Batched with padding, a pair's probabilities equal those of the pair alone."""
    translator = Translator.from_checkpoints([aligned], device="cpu")
    sources = [translator.encode(0, "the cat sees the dog ."), translator.encode(1, "a house")]
    targets = [translator.bpe.encode(x, out_type=int) for x in ("die Katze sieht den Hund .", "ein Haus")]
    model, aligner, bpe = translator.model, translator.aligner, translator.bpe
    together = link_probabilities(model, aligner, bpe, sources, targets, 0)
    assert [p.shape for p in together] == [(6, 6), (2, 2)]  # target words x source words
    for k in range(2):
        alone = link_probabilities(model, aligner, bpe, [sources[k]], [targets[k]], 0)[0]
        torch.testing.assert_close(together[k], alone, atol=1e-5, rtol=1e-4)


def test_the_aligner_travels_in_the_checkpoint_and_an_average_of_several_drops_it(
    aligned: Path, toy_trained_checkpoint: Path, tmp_path: Path
) -> None:
    ck = read_checkpoint(aligned)
    assert ck.aligner is not None and ck.training is None and ck.aligner["shape"]["dim"] == 64
    assert 0.0 < ck.aligner["valid"]["f1"] <= 1.0
    from transformer_mt.checkpoint.mean import read_average

    assert read_average([aligned]).aligner is not None
    assert read_average([aligned, toy_trained_checkpoint]).aligner is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e["weights"].pop("bias"), r"the 'aligner' entry does not fit .* 'bias' is missing"),
        (lambda e: e["weights"].update(bias=torch.zeros(3)), r"'bias' has shape \(3,\), not \(\)"),
        (lambda e: e["weights"].update(bias=torch.tensor(1.0).to_sparse()), r"'bias' is a sparse_coo tensor"),
        (lambda e: e["shape"].update(heads=3), r"shape is not dim, heads \(dividing dim\) and layers"),
        (lambda e: e["shape"].update(dim="64"), r"shape is not dim, heads"),
        (lambda e: e.update(weights=[1, 2]), r"the 'aligner' entry's weights are not a state dict"),
        (lambda e: e.update(valid={"f1": "high"}), r"validation figures are not numbers"),
    ],
)
def test_a_crafted_aligner_entry_is_refused_with_its_name(toy_ckpt: Path, tmp_path: Path, change, message) -> None:
    ck = read_checkpoint(toy_ckpt)
    entry = to_entry(Aligner(ck.config.model.d_model, AlignerShape(dim=64, layers=1)), {"f1": 0.5})
    change(entry)
    path = tmp_path / "crafted.pt"
    write_checkpoint(path, dataclasses.replace(ck, aligner=entry))
    with pytest.raises(CheckpointError, match=message):
        Translator.from_checkpoints([path], device="cpu")


def test_train_aligner_refusals(toy_trained_checkpoint: Path, prepared_toy: Config, tmp_path: Path) -> None:
    out = tmp_path / "aligned.pt"
    out.write_bytes(b"")
    code, output = _aligned(toy_trained_checkpoint, prepared_toy, out)
    assert code == 2 and "already exists; choose another -o or pass --force" in output
    links = tmp_path / "short.links"
    links.write_text("0-0\n")
    code, output = _aligned(toy_trained_checkpoint, prepared_toy, tmp_path / "x.pt", "--links", str(links))
    assert code == 2 and "1 lines of links for 2000 sentence pairs" in output
    assert not (tmp_path / "x.pt").exists()
