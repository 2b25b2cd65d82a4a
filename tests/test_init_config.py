"""`tmt init`: a complete config for one's own corpus, its choices against their rules, and its errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config, load_config
from transformer_mt.init_config import (
    PAPER_UPDATES,
    Corpus,
    InitError,
    Side,
    choose,
    count_corpus,
    field_docs,
    vocab_size,
    write_config,
)


def _write(prefix: Path, src: list[str], tgt: list[str]) -> str:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_name(prefix.name + ".en").write_text("".join(f"{line}\n" for line in src), encoding="utf-8")
    prefix.with_name(prefix.name + ".de").write_text("".join(f"{line}\n" for line in tgt), encoding="utf-8")
    return str(prefix)


@pytest.fixture
def corpus_files(tmp_path, monkeypatch) -> Path:
    """A small corpus under the user's own names, and the working directory beside it."""
    monkeypatch.chdir(tmp_path)
    words = ["the cat sits on the mat", "a dog runs", "birds fly over the house today"]
    german = ["die Katze sitzt auf der Matte", "ein Hund rennt", "Vögel fliegen heute über das Haus"]
    _write(tmp_path / "mydata" / "corpus", words * 40, german * 40)
    _write(tmp_path / "mydata" / "dev", words, german)
    _write(tmp_path / "mydata" / "eval", words[:2], german[:2])
    return tmp_path


def _corpus(pairs: int, words: int, types: int = 10**6) -> Corpus:
    side = Side(Path("x.en"), pairs, words // 2, frozenset(map(str, range(types))))
    return Corpus({"train": "x", "valid": "v", "test": ""}, "en", "de", (side, side), 500, 0, {1.5: 0, 2.0: 0, 3.0: 0})


def test_the_written_config_is_complete_self_contained_and_loads_as_chosen(corpus_files):
    out = corpus_files / "mine.yaml"
    choices = write_config("mydata/corpus", "mydata/dev", "mydata/eval", "en", "de", out, show=False)
    text = out.read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    assert "base" not in raw  # nothing inherited: the file means the same wherever it goes
    every_key = {f"{s}.{k}" for s, section in Config().to_dict().items() for k in section}
    assert {f"{s}.{k}" for s, section in raw.items() for k in section} == every_key
    assert load_config(out) == choices.config
    cfg = choices.config
    assert (cfg.data.train, cfg.data.valid, cfg.data.test) == ("mydata/corpus", "mydata/dev", "mydata/eval")
    assert (cfg.data.dir, cfg.train.save_dir, cfg.data.synth) == ("prepared/mine", "runs/mine", False)
    assert "d_model: 256  # chose: the small model (tmt:multi30k.yaml): 120 pairs < 100,000" in text
    assert "  label_smoothing: 0.1\n" in text and "adam_eps: 1.0e-09" in text  # PyYAML reads 1e-09 as a string
    (bleu_line,) = [line for line in text.splitlines() if line.startswith("  valid_bleu_sentences: ")]
    assert "it costs time" in bleu_line and "each valid line prints its share; 0 turns it off" in bleu_line
    assert f"# Paths are relative to the directory tmt runs in: run it from {corpus_files}" in text


def test_every_key_with_a_comment_in_config_py_carries_it_into_the_file():
    docs = field_docs()
    assert docs["train.max_tokens"] == "padded tokens per batch, counted on source and target separately"
    assert docs["train.precision"].startswith("auto: bf16 on capable GPUs")  # a field written over three lines
    assert docs["decode.stopping"].startswith("exact: a sentence ends when")  # the comment above the field
    assert set(docs) == {f"{s}.{k}" for s, section in Config().to_dict().items() for k in section}


def test_vocabulary_grows_with_the_words_and_never_passes_half_the_distinct_words():
    assert vocab_size(_corpus(29_000, 667_403))[0] == 8000  # Multi30k: its tuned config's
    assert vocab_size(_corpus(500_000, 10_000_000))[0] == 16000
    assert vocab_size(_corpus(2_000_000, 60_000_000))[0] == 32000
    assert vocab_size(_corpus(4_500_000, 250_000_000))[0] == 37000  # WMT14 en-de: the paper's
    size, why = vocab_size(_corpus(29_000, 667_403, types=5_300))
    assert size == 2000 and "5,300 distinct" in why
    assert vocab_size(_corpus(100, 1000, types=50))[0] == 1000


def test_small_corpora_get_the_small_model_and_a_fitted_schedule():
    cfg = choose(_corpus(29_000, 667_403), None, 0.0, "m").config
    assert (cfg.model.d_model, cfg.model.encoder_layers) == (256, 3)
    assert (cfg.train.schedule, cfg.train.warmup_fraction, cfg.train.max_minutes) == ("linear", 0.1, 0.0)
    per_epoch = -(-1.3 * 1.1 * 667_403 / 2 // 4096)  # words of the longer side, as pieces, padded, per batch
    assert cfg.train.max_updates == -(-50 * per_epoch // 100) * 100  # 50 epochs, rounded up to 100 updates


def test_a_corpus_the_size_of_the_papers_keeps_the_papers_base_recipe_exactly():
    cfg = choose(_corpus(4_500_000, 250_000_000), None, 0.0, "wmt").config
    paper = load_config("tmt:base.yaml")
    assert cfg.model == paper.model and cfg.train.max_updates == PAPER_UPDATES["base"]
    same = ("schedule", "warmup", "lr", "lr_scale", "warmup_fraction", "max_tokens", "update_freq", "label_smoothing")
    assert all(getattr(cfg.train, k) == getattr(paper.train, k) for k in same)
    assert cfg.decode == paper.decode


def test_a_mid_size_corpus_on_the_base_model_fits_the_schedule_at_the_papers_peak():
    cfg = choose(_corpus(200_000, 8_000_000), None, 0.0, "mid").config
    assert cfg.model.d_model == 512 and cfg.train.max_updates < PAPER_UPDATES["base"]
    assert cfg.train.schedule == "linear" and cfg.train.lr == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-3)


def test_minutes_make_a_time_budget():
    cfg = choose(_corpus(200_000, 8_000_000), "small", 15.0, "t").config
    assert (cfg.train.max_minutes, cfg.train.max_updates, cfg.model.d_model) == (15.0, 0, 256)


def test_max_ratio_is_the_smallest_that_drops_at_most_one_percent():
    base = _corpus(1000, 20_000)
    for drops, expected in (({1.5: 10, 2.0: 0, 3.0: 0}, 1.5), ({1.5: 11, 2.0: 3, 3.0: 0}, 2.0)):
        corpus = dataclasses.replace(base, dropped_by_ratio=drops)
        assert choose(corpus, None, 0.0, "r").config.data.max_ratio == expected


def test_counts_are_those_prepare_reads(corpus_files):
    corpus = count_corpus("mydata/corpus", "mydata/dev", "", "en", "de", show=False)
    assert (corpus.pairs, corpus.valid_pairs, corpus.test_pairs) == (120, 3, 0)
    assert corpus.train[0].words == 40 * (6 + 3 + 6) and corpus.types == 14 + 14


def test_misaligned_sides_name_both_files_and_counts(corpus_files):
    Path("mydata/dev.de").write_text("eins\n", encoding="utf-8")
    with pytest.raises(InitError, match=r"--valid: mydata/dev\.en has 3 lines and mydata/dev\.de 1; line N of one"):
        count_corpus("mydata/corpus", "mydata/dev", "", "en", "de", show=False)


def test_missing_files_say_how_files_are_named(corpus_files):
    with pytest.raises(InitError, match=r"--train mydata/corpus\.en: mydata/corpus\.en\.en not found; give the prefix"):
        count_corpus("mydata/corpus.en", "mydata/dev", "", "en", "de", show=False)
    with pytest.raises(InitError, match=r"--test mydata/nope: mydata/nope\.en not found; files are named PREFIX\.en"):
        count_corpus("mydata/corpus", "mydata/dev", "mydata/nope", "en", "de", show=False)
    with pytest.raises(InitError, match="both 'en'"):
        count_corpus("mydata/corpus", "mydata/dev", "", "en", "en", show=False)


def test_cli_writes_once_and_refuses_to_overwrite(corpus_files):
    runner = CliRunner()
    args = ["init", "--train", "mydata/corpus", "--valid", "mydata/dev", "--src", "en", "--tgt", "de"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wrote en-de.yaml: d_model 256, 3+3 layers" in result.output
    assert "next: tmt train en-de.yaml" in result.output and "tmt evaluate valid -c runs/en-de" in result.output
    header = Path("en-de.yaml").read_text(encoding="utf-8").splitlines()[0]
    assert header == "# Written by `tmt init --train mydata/corpus --valid mydata/dev --src en --tgt de -o en-de.yaml`."
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "en-de.yaml exists; pass --force" in again.output
    assert runner.invoke(app, [*args, "--force", "--preset", "base"]).exit_code == 0
    assert load_config("en-de.yaml").model.d_model == 512
