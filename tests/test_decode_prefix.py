"""Forced target prefixes (`tmt translate --prefix-file`): the search continues from the prefix, whose tokens count.

On fake decoders the forced search must equal exhaustive search over the
hypotheses that start with the prefix (scores included); through Translator
every output line must start with its prefix, and bad prefix files must be
one-line errors naming the file and line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import B_, A, FakeModel, exhaustive, fake_src, hyp_tuples, probs, random_table, real_src
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Sampling
from transformer_mt.data.bpe import PAD
from transformer_mt.decode.sample import sample_search
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.decode.translate import TranslateError, Translator
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the search ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [(A,), (B_, A), (B_, B_, B_)])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_forced_beam_equals_exhaustive_search_over_the_prefixed_hypotheses(prefix, alpha: float) -> None:
    tables = [random_table(seed, eos_bias=1.5) for seed in range(3)]  # EOS tempting: it may not come inside a prefix
    model = FakeModel(lambda s, p: tables[s - 10](s - 10, p))
    out = beam_search(
        model,
        fake_src([0, 1, 2], 3),
        SearchSettings(beam_size=12, len_penalty=alpha, max_len_a=0, max_len_b=3),
        nbest=12,
        prefixes=[list(prefix)] * 3,
    )
    for s, hyps in enumerate(out):
        expected = [(sc, w) for sc, w in exhaustive(tables[s], s, 3, alpha, "gnmt") if w[: len(prefix)] == prefix]
        assert hyp_tuples(hyps) == [w for _, w in expected][:12]
        assert [h.score for h in hyps] == pytest.approx([sc for sc, _ in expected][:12], abs=1e-5)


def test_forced_tokens_count_in_the_score_and_eos_waits_for_the_prefix() -> None:
    table = lambda s, p: probs(eos=0.9, a=0.08, b=0.02)  # noqa: E731  (would end at once)
    for k in (1, 2):
        (hyps,) = beam_search(
            FakeModel(table), fake_src([0], 3), SearchSettings(beam_size=k, len_penalty=0.0), prefixes=[[B_, A]]
        )
        assert hyps[0].tokens == [B_, A]
        assert hyps[0].log_prob == pytest.approx(math.log(0.02) + math.log(0.08) + math.log(0.9), rel=1e-5)


def test_a_sentence_without_prefix_searches_as_without_prefixes() -> None:
    tables = [random_table(seed) for seed in range(3)]
    model = FakeModel(lambda s, p: tables[s - 10](s - 10, p))
    src = fake_src([0, 1, 2], 3)
    plain = beam_search(model, src, SearchSettings(beam_size=3, max_len_a=0, max_len_b=4), nbest=3)
    mixed = beam_search(
        model, src, SearchSettings(beam_size=3, max_len_a=0, max_len_b=4), nbest=3, prefixes=[[], [A, A], []]
    )
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    assert all(h.tokens[:2] == [A, A] for h in mixed[1])
    assert (
        beam_search(model, src, SearchSettings(beam_size=3, max_len_a=0, max_len_b=4), nbest=3, prefixes=[[], [], []])
        == plain
    )


def test_a_prefix_as_long_as_the_maximum_length_ends_there() -> None:
    model = FakeModel(lambda s, p: probs(eos=0.49, a=0.5, b=0.01))
    (hyps,) = beam_search(
        model, fake_src([0], 3), SearchSettings(beam_size=2, max_len_a=0, max_len_b=2), prefixes=[[B_, B_]], nbest=2
    )
    assert [h.tokens for h in hyps] == [[B_, B_]]  # the one hypothesis there is, EOS forced after it
    assert hyps[0].log_prob == pytest.approx(2 * math.log(0.01) + math.log(0.49), rel=1e-5)


def test_the_prefix_is_kept_where_it_repeats_an_ngram() -> None:
    model = FakeModel(lambda s, p: probs(eos=0.2, a=0.5, b=0.3))
    (hyps,) = beam_search(
        model,
        fake_src([0], 3),
        SearchSettings(beam_size=2, max_len_a=0, max_len_b=5, no_repeat_ngram=1),
        prefixes=[[A, A]],
    )
    assert hyps[0].tokens[:2] == [A, A] and A not in hyps[0].tokens[2:]


def test_samples_start_with_the_prefix() -> None:
    torch.manual_seed(0)
    from transformer_mt.config import ModelConfig

    model = Transformer(ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=1, decoder_layers=1,
                                    max_positions=64), vocab_size=24).eval()  # fmt: skip
    src = real_src([4, 7, 3], seed=1)
    sources = [[t for t in row if t != PAD] for row in src.tolist()]
    out = sample_search(
        model,
        src,
        sources,
        SearchSettings(sampling=Sampling("topp", 1.0), max_len_b=8),
        samples=3,
        prefixes=[[5, 6], [], [9]],
    )
    assert all(h.tokens[:2] == [5, 6] for h in out[0]) and all(h.tokens[:1] == [9] for h in out[2])
    plain = sample_search(model, src, sources, SearchSettings(sampling=Sampling("topp", 1.0), max_len_b=8), samples=3)
    assert out[1] == plain[1]


# --- Translator and tmt translate ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def translator(toy_ckpt: Path) -> Translator:
    t = Translator.from_checkpoints([toy_ckpt], device="cpu", overrides=["decode.max_len_b=8", "decode.beam_size=3"])
    t.show_progress = False
    return t


LINES = ["the cat sees the dog .", "a small house", "", "the man who sleeps reads a long book .", "dogs run"]
PREFIXES = ["Die Katze", "", "Ein Haus", "der Mann , der", "Hunde"]


def test_every_translation_starts_with_its_prefix(translator: Translator) -> None:
    results = translator.translate_lines_nbest(LINES, nbest=3, prefixes=PREFIXES)
    assert len(results) == len(LINES)
    for prefix, hyps in zip(PREFIXES, results, strict=True):
        assert all(h.text.startswith(prefix) for h in hyps), (prefix, hyps)
    assert [h.text for h in results[2]] == ["Ein Haus"] * 3  # an empty source: the prefix alone
    texts = [[h.text for h in hyps] for hyps in results]
    assert texts[1] == [h.text for h in translator.translate_lines_nbest([LINES[1]], nbest=3)[0]]  # as before
    alone = [
        translator.translate_lines_nbest([line], nbest=3, prefixes=[p])[0]
        for line, p in zip(LINES, PREFIXES, strict=True)
    ]
    assert [[h.text for h in hyps] for hyps in alone] == texts  # whatever the batch


def test_sampling_with_a_prefix(toy_ckpt: Path) -> None:
    t = Translator.from_checkpoints(
        [toy_ckpt], device="cpu", overrides=["decode.sampling=topk:20", "decode.max_len_b=8"]
    )
    t.show_progress = False
    for prefix, hyps in zip(PREFIXES, t.translate_lines_nbest(LINES, nbest=2, prefixes=PREFIXES), strict=True):
        assert all(h.text.startswith(prefix) for h in hyps)


def test_a_prefix_the_vocabulary_cannot_spell_names_its_line(translator: Translator) -> None:
    with pytest.raises(TranslateError, match=r"pre.txt: line 2: '☃' is not in the model's vocabulary"):
        translator.translate_lines_nbest(["a", "b"], prefixes=["", "Die ☃"], prefix_origin="pre.txt")


def test_a_prefix_longer_than_the_maximum_length_names_its_line(translator: Translator) -> None:
    with pytest.raises(TranslateError, match=r"line 4: the prefix is \d+ BPE tokens, more than .* length of 8"):
        translator.translate_lines_nbest(["a", "b", "c", "d"], prefixes=["", "", "", "der " * 20], start=0)


def run(toy_ckpt: Path, tmp_path: Path, lines: list[str], prefixes: list[str], *flags: str):
    src, pre, out = tmp_path / "in.en", tmp_path / "pre.de", tmp_path / "out.de"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    pre.write_text("".join(line + "\n" for line in prefixes), encoding="utf-8")
    args = ["translate", "-c", str(toy_ckpt), "-i", str(src), "--prefix-file", str(pre), "-o", str(out), *flags]
    return CliRunner().invoke(app, args), out


def test_tmt_translate_prefix_file(toy_ckpt: Path, tmp_path: Path) -> None:
    result, out = run(toy_ckpt, tmp_path, LINES, PREFIXES, "--set", "decode.max_len_b=8")
    assert result.exit_code == 0, result.output
    got = out.read_text(encoding="utf-8").splitlines()
    assert len(got) == len(LINES) and all(line.startswith(p) for line, p in zip(got, PREFIXES, strict=True))


@pytest.mark.parametrize("prefixes, message", [
    (PREFIXES[:3], "pre.de: 3 lines, but the input .*in.en has 5"),
    (PREFIXES + ["x", "y"], "pre.de: 7 lines, but the input .*in.en has 5"),
    (["", "Hütte ☃"] + PREFIXES[2:], "pre.de: line 2: '☃' is not in the model's vocabulary"),
])  # fmt: skip
def test_tmt_translate_refuses_a_bad_prefix_file_in_one_line(toy_ckpt: Path, tmp_path: Path, prefixes, message) -> None:
    result, out = run(toy_ckpt, tmp_path, LINES, prefixes)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert re.search(message, " ".join(result.output.split())), result.output
    assert not out.exists()


def test_ctranslate2_forces_the_same_prefix(toy_ckpt: Path, tmp_path: Path, translator: Translator) -> None:
    pytest.importorskip("ctranslate2")
    from transformer_mt.decode.translate import load_translator
    from transformer_mt.export import export_ctranslate2

    model_dir = export_ctranslate2([toy_ckpt], tmp_path / "ct2")
    ct2 = load_translator([model_dir], "ctranslate2", device="cpu", overrides=["decode.max_len_b=8"])
    ct2.show_progress = False
    got = [h[0].text for h in ct2.translate_lines_nbest(LINES, nbest=1, prefixes=PREFIXES)]
    assert all(line.startswith(p) for line, p in zip(got, PREFIXES, strict=True))


def test_buffer_lines_reads_the_prefix_file_beside_the_input(toy_ckpt: Path, tmp_path: Path) -> None:
    whole, out = run(toy_ckpt, tmp_path, LINES, PREFIXES, "--set", "decode.max_len_b=8")
    assert whole.exit_code == 0, whole.output
    args = ["translate", "-c", str(toy_ckpt), "--prefix-file", str(tmp_path / "pre.de"), "--set", "decode.max_len_b=8"]
    for n in ("1", "2"):
        streamed = CliRunner().invoke(app, [*args, "-i", str(tmp_path / "in.en"), "--buffer-lines", n])
        assert streamed.exit_code == 0, streamed.output
        assert streamed.stdout == out.read_text(encoding="utf-8")
    (tmp_path / "pre.de").write_text("a\nb\n", encoding="utf-8")
    short = CliRunner().invoke(app, [*args, "-i", str(tmp_path / "in.en"), "--buffer-lines", "1"])
    assert short.exit_code == 2 and "pre.de: 2 lines, but the input" in short.output and "has 5" in short.output
