"""One model for several directions (data.directions): config, prepare, the epoch's draw, training, translation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_resume_is_bit_exact, assert_user_error, metric_records, run_config, tmt

from transformer_mt.config import ConfigError, load_config
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.directions import (
    Direction,
    DirectionError,
    choose,
    directions,
    prefix,
    tag,
    weights,
    zero_shot,
)
from transformer_mt.data.mix import CorpusMix, epoch_selection, temperature_shares
from transformer_mt.data.prepare import PrepareError, prepare_data, prepare_hash
from transformer_mt.data.synthetic import write_corpus
from transformer_mt.runs import read_run
from transformer_mt.train.trainer import train_model

DIRECTIONS = ["en-de", "de-en", "en-fr"]


def reversed_words(line: str) -> str:
    """A third language for the toy corpus: English with its words in reverse order."""
    return " ".join(reversed(line.split()))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-way parallel toy corpus (en, de, fr) under c/: 240 training, 24 valid and 24 test lines."""
    root = tmp_path_factory.mktemp("multi")
    write_corpus(root / "c", 240, 24, 24, 1, "en", "de")
    for split in ("train", "valid", "test"):
        english = (root / "c" / f"{split}.en").read_text(encoding="utf-8").splitlines()
        (root / "c" / f"{split}.fr").write_text("".join(reversed_words(s) + "\n" for s in english), encoding="utf-8")
    return root


def multi_config(root: Path, *extra: str):
    return load_config(
        "tmt:toy.yaml",
        [
            f"data.train={root}/c/train", f"data.valid={root}/c/valid", f"data.test={root}/c/test",
            f"data.dir={root}/out", "data.synth=false", "data.workers=1", f"data.directions=[{','.join(DIRECTIONS)}]",
            "bpe.vocab_size=150", "model.d_model=32", "model.d_ff=64", "model.encoder_layers=1",
            "model.decoder_layers=1", "train.max_updates=12", "train.validate_every=6", "train.save_every_updates=6",
            "train.warmup=4", "train.valid_bleu_sentences=4", "decode.max_len_b=5", *extra,
        ],
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(corpus: Path) -> Path:
    """The toy corpus prepared and trained for 12 updates, three directions at temperature 2."""
    cfg = run_config(multi_config(corpus, "data.temperature=2"), corpus / "run")
    train_model(cfg)
    return corpus / "run"


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("[en-en]", "two different language codes"),
        ("[ende]", "not a direction"),
        ("[en-de,en-de]", "en-de is listed twice"),
        ("en-de", "expected a list"),
        ("[en-]", "not a direction"),
    ],
)
def test_a_direction_that_does_not_read_is_one_error(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config("tmt:toy.yaml", [f"data.directions={value}"])


def test_temperature_must_be_positive_and_bpe_dropout_waits_for_one_pair() -> None:
    with pytest.raises(ConfigError, match="data.temperature must be above 0"):
        load_config("tmt:toy.yaml", ["data.temperature=0"])
    with pytest.raises(ConfigError, match="bpe.sampling_alpha works with one corpus of one language pair"):
        load_config("tmt:toy.yaml", ["data.synth=false", "data.directions=[en-de]", "bpe.sampling_alpha=0.1"])


def test_data_prepared_before_directions_existed_stays_up_to_date() -> None:
    """The hashes of tmt:toy.yaml and configs/multi30k_hour.yaml as prepare wrote them before data.directions."""
    assert prepare_hash(load_config("tmt:toy.yaml")) == "431aded72dd688f467fb280148f8c5c6"
    assert prepare_hash(load_config("tmt:base.yaml")) == "9bc5ee621393c2a7481aea331a044b39"
    several = load_config("tmt:toy.yaml", ["data.synth=false", "data.directions=[en-de]"])
    assert prepare_hash(several) != prepare_hash(load_config("tmt:toy.yaml", ["data.synth=false"]))


def test_choose_needs_the_target_of_a_model_of_several_and_names_its_languages() -> None:
    data = load_config("tmt:toy.yaml", ["data.synth=false", f"data.directions=[{','.join(DIRECTIONS)}]"]).data
    assert choose(data, None, "fr") == Direction("en", "fr")
    assert choose(data, "de", "en") == Direction("de", "en")
    with pytest.raises(DirectionError, match="choose one with --tgt-lang"):
        choose(data, None, None)
    with pytest.raises(DirectionError, match="'cs' is not a target language.*from en, de into de, en, fr"):
        choose(data, "en", "cs")
    with pytest.raises(DirectionError, match="both 'en'"):
        choose(data, "en", "en")
    assert zero_shot(data, Direction("de", "fr")) and not zero_shot(data, Direction("en", "fr"))
    one_pair = load_config("tmt:toy.yaml").data
    assert choose(one_pair, None, None) == Direction("en", "de")
    with pytest.raises(DirectionError, match="'fr' is not a target"):
        choose(one_pair, None, "fr")


# ---------------------------------------------------------------- the epoch's draw


def test_temperature_shares_follow_the_formula() -> None:
    sizes = np.array([100, 900, 9000])
    for t in (1.0, 2.0, 5.0):
        expected = sizes ** (1 / t) / (sizes ** (1 / t)).sum()
        np.testing.assert_allclose(temperature_shares(sizes, t), expected)
    np.testing.assert_allclose(temperature_shares(sizes, 1.0), sizes / sizes.sum())
    weighted = sizes ** (1 / 2) * [1, 2, 3]
    np.testing.assert_allclose(temperature_shares(sizes, 2.0, [1, 2, 3]), weighted / weighted.sum())
    assert temperature_shares(sizes, 1e6).max() - temperature_shares(sizes, 1e6).min() < 1e-4  # tends to uniform


def test_an_epoch_draws_each_direction_its_share_from_seed_and_epoch_alone() -> None:
    sizes = np.array([10, 90])
    assert epoch_selection(sizes, 1.0, 1, 1) is None  # every pair once
    first = epoch_selection(sizes, 5.0, 1, 1)
    assert first is not None and len(first) == pytest.approx(100, abs=1)
    shares = temperature_shares(sizes, 5.0)
    small = first[first < 10]
    assert len(small) == round(100 * shares[0])  # upsampled: each of the 10 pairs at least twice
    assert set(np.bincount(small, minlength=10)) <= {int(100 * shares[0]) // 10, int(100 * shares[0]) // 10 + 1}
    large = first[first >= 10]
    assert len(large) == round(100 * shares[1]) and len(set(large)) == len(large)  # downsampled without repeats
    np.testing.assert_array_equal(first, epoch_selection(sizes, 5.0, 1, 1))  # a resume draws the same
    assert not np.array_equal(first, epoch_selection(sizes, 5.0, 1, 2))


# ---------------------------------------------------------------- prepare, train, translate


def test_prepare_writes_each_direction_and_the_tags_are_single_pieces(trained: Path, corpus: Path) -> None:
    manifest = json.loads((corpus / "out" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["directions"] == DIRECTIONS
    assert list(manifest["splits"]) == [f"{s}.{d}" for s in ("train", "valid", "test") for d in DIRECTIONS]
    assert manifest["splits"]["train.en-de"]["bpe_sample"] == 3 * 240  # each language's file once
    bpe = load_bpe(corpus / "out" / "spm.model")
    for lang in ("de", "en", "fr"):
        assert tag(lang) in bpe.encode(f"{tag(lang)} The horse.", out_type=str)
        assert bpe.id_to_piece(bpe.piece_to_id(tag(lang))) == tag(lang)
    assert bpe.id_to_piece(bpe.piece_to_id("<2cs>")) != "<2cs>"  # cs is no target


def test_a_mix_puts_each_sources_tag_first(trained: Path, corpus: Path) -> None:
    bpe = load_bpe(corpus / "out" / "spm.model")
    de = ParallelDataset(corpus / "out", "valid.en-de", "en", "de")
    fr = ParallelDataset(corpus / "out", "valid.en-fr", "en", "fr")
    mix = CorpusMix([(de, np.array([bpe.piece_to_id("<2de>")])), (fr, np.array([bpe.piece_to_id("<2fr>")]))])
    assert len(mix) == len(de) + len(fr)
    assert mix.src_ids(0)[0] == bpe.piece_to_id("<2de>") and mix.src_ids(len(de))[0] == bpe.piece_to_id("<2fr>")
    np.testing.assert_array_equal(mix.src_ids(len(de))[1:], fr.src_ids(0))
    np.testing.assert_array_equal(mix.src_lens, np.concatenate([de.src_lens + 1, fr.src_lens + 1]))
    np.testing.assert_array_equal(mix.tgt_ids(len(de) + 3), fr.tgt_ids(3))


def test_validation_reports_each_direction_and_their_mean(trained: Path) -> None:
    valid = [r for r in metric_records(trained) if r["kind"] == "valid"]
    assert [r["update"] for r in valid] == [6, 12]
    for record in valid:
        each = record["directions"]
        assert list(each) == DIRECTIONS
        assert record["loss"] == pytest.approx(sum(d["loss"] for d in each.values()) / 3)
        assert record["bleu"] == pytest.approx(sum(d["bleu"] for d in each.values()) / 3)


@pytest.mark.slow
def test_a_resumed_run_draws_and_trains_exactly_as_one_that_never_stopped(corpus: Path, tmp_path: Path) -> None:
    """With directions of unequal sizes (max_ratio drops more en-de than en-fr pairs), so that each epoch draws."""
    extra = ("data.temperature=3", "data.max_ratio=1.15", f"data.dir={tmp_path}/out", "train.valid_bleu_sentences=0")
    cfg = multi_config(corpus, *extra)
    prepare_data(cfg)
    sizes = [len(ParallelDataset(tmp_path / "out", f"train.{d}", *d.split("-"))) for d in DIRECTIONS]
    assert sizes[0] == sizes[1] < sizes[2]
    assert_resume_is_bit_exact(cfg, tmp_path)


@pytest.mark.slow
def test_translate_each_direction_warns_zero_shot_and_names_the_languages(trained: Path, tmp_path: Path) -> None:
    ck = str(trained / "checkpoint_u0000012.pt")
    source = tmp_path / "in.txt"
    source.write_text("The woman washes the garden.\n\nThe horse runs.\n", encoding="utf-8")
    for src, tgt in (("en", "de"), ("de", "en"), ("en", "fr")):
        done = tmt("translate", "-c", ck, "--src-lang", src, "--tgt-lang", tgt, "-i", str(source))
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.split("\n")) == 4 and done.stdout.split("\n")[1] == ""  # three lines, in order
        assert "zero-shot" not in done.stderr
    done = tmt("translate", "-c", ck, "--src-lang", "de", "--tgt-lang", "fr", "-i", str(source))
    assert done.returncode == 0 and "never trained on de-fr" in done.stderr and "zero-shot" in done.stderr
    no_target = tmt("translate", "-c", ck, "-i", str(source))
    assert_user_error(no_target, "choose one with --tgt-lang", "en-de, de-en, en-fr")
    unknown = tmt("translate", "-c", ck, "--tgt-lang", "cs", "-i", str(source))
    assert_user_error(unknown, "'cs' is not a target language")


def test_the_tag_changes_the_translation_the_model_gives(trained: Path) -> None:
    """The same source toward two targets goes through two different encoder inputs (its tag), so the search
    sees two different sources."""
    from transformer_mt.decode.translate import Translator

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"])
    de, fr = translator.toward("en", "de"), translator.toward("en", "fr")
    assert de.encode(0, "The horse.")[1:] == fr.encode(0, "The horse.")[1:]
    assert de.encode(0, "The horse.")[0] != fr.encode(0, "The horse.")[0]
    assert de.encode(0, "") == []


@pytest.fixture(scope="module")
def server(trained: Path):
    """The trained model behind `tmt serve`'s app (in this process), and each direction's `tmt translate`."""
    from starlette.testclient import TestClient

    from transformer_mt.decode.translate import Translator
    from transformer_mt.serve.app import ServerInfo, build_app
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.protocol import Limits

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"], device="cpu")
    translator.show_progress = False
    batcher = Batcher(translator, max_batch_tokens=2000, max_wait_ms=5, queue_size=16)
    app = build_app(batcher, ServerInfo("multi.pt", "pytorch", "cpu", "none"), Limits(max_lines=16))
    with TestClient(app) as client:
        client.translator = translator
        yield client


def test_serve_lists_routes_and_detects_each_direction(server, corpus: Path) -> None:
    pytest.importorskip("py3langid")
    from starlette.websockets import WebSocketDisconnect

    languages = {entry["code"]: entry["targets"] for entry in server.get("/languages").json()}
    assert languages == {"en": ["de", "fr"], "de": ["en", "fr"], "fr": []}
    english = (corpus / "c" / "test.en").read_text(encoding="utf-8").splitlines()[:3]
    german = (corpus / "c" / "test.de").read_text(encoding="utf-8").splitlines()[:3]
    for target in ("de", "fr"):
        want = server.translator.toward("en", target).translate_lines(english)
        got = server.post("/translate", json={"q": english, "source": "en", "target": target}).json()
        assert got["translatedText"] == want
        v1 = server.post("/v1/translate", json={"sources": english, "target": target}).json()
        assert [t["translation"] for t in v1["translations"]] == want
    auto = server.post("/translate", json={"q": german[0], "source": "auto", "target": "en"}).json()
    assert auto["translatedText"] == server.translator.toward("de", "en").translate_lines(german[:1])[0]
    assert auto["detectedLanguage"]["language"] == "de"
    assert server.post("/detect", json={"q": english[0]}).json()[0]["language"] == "en"
    with server.websocket_connect("/ws?target=fr") as ws:
        ws.send_text(english[0])
        assert ws.receive_text() == server.translator.toward("en", "fr").translate_lines(english[:1])[0]
        ws.send_bytes(b"\x00")  # the server closes (1003) and its handler ends before the test client's does
        with pytest.raises(WebSocketDisconnect):
            ws.receive_text()
    missing = server.post("/translate", json={"q": "x", "source": "en"})
    assert missing.status_code == 400 and missing.json()["field"] == "target"
    assert "'de', 'en', 'fr'" in missing.json()["error"]
    unknown = server.post("/v1/translate", json={"sources": ["x"], "target": "cs"})
    assert unknown.status_code == 400 and unknown.json()["field"] == "target"
    health = server.get("/health").json()
    assert health["directions"] == DIRECTIONS


def test_requests_for_different_targets_share_the_running_search(trained: Path, corpus: Path) -> None:
    from transformer_mt.decode.translate import Translator
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.protocol import Job

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"], device="cpu")
    translator.show_progress = False
    english = (corpus / "c" / "test.en").read_text(encoding="utf-8").splitlines()[:4]
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=0, queue_size=8)
    assert batcher.search is not None
    active: list[int] = []
    later = []

    def after_step() -> None:  # the French request comes after the German one's first step
        active.append(batcher.search.active)
        if len(active) == 1:
            later.append(batcher.submit(Job(english[2:], languages=(None, "fr"))))

    batcher.search.after_step = after_step
    first = batcher.submit(Job(english[:2], languages=("en", "de")))
    batcher.start()
    try:
        german = [h[0].text for h in first.result(timeout=60)]
        french = [h[0].text for h in later[0].result(timeout=60)]
    finally:
        batcher.close()
    assert max(active) > 2  # the French lines ran beside the German ones
    assert german == [translator.toward("en", "de").translate_lines([x])[0] for x in english[:2]]
    assert french == [translator.toward("en", "fr").translate_lines([x])[0] for x in english[2:]]


@pytest.mark.slow
def test_both_exports_translate_each_direction_as_tmt_does(trained: Path, corpus: Path, tmp_path: Path) -> None:
    """CTranslate2 through tmt's engine (the tag among the source tokens) and transformers' Marian (the tag
    written >>fr<< before the text, OPUS-MT's way): tmt's ids and greedy translations, direction by direction."""
    pytest.importorskip("ctranslate2")
    transformers = pytest.importorskip("transformers")
    from transformer_mt.decode.search import pad_batch
    from transformer_mt.decode.translate import load_translator
    from transformer_mt.export import export_ctranslate2
    from transformer_mt.export.hf import export_hf

    ck = trained / "checkpoint_u0000012.pt"
    ct2, (hf, _) = export_ctranslate2([ck], tmp_path / "ct2"), export_hf([ck], tmp_path / "hf")
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf)
    model = transformers.MarianMTModel.from_pretrained(hf).eval()
    matching = ["decode.len_penalty_form=fairseq", "decode.stopping=k_finished", "decode.max_len_a=0",
                "decode.max_len_b=20", "decode.no_repeat_ngram=0", "decode.beam_size=1"]  # fmt: skip
    for way in map(Direction.parse, DIRECTIONS):
        lines = (corpus / "c" / f"test.{way.src}").read_text(encoding="utf-8").splitlines()[:6]
        ours = load_translator([ck], "pytorch", device="cpu", overrides=matching, languages=(way.src, way.tgt))
        engine = load_translator([ct2], "ctranslate2", device="cpu", overrides=matching, languages=(way.src, way.tgt))
        expected = ours.translate_lines(lines)
        assert sum(map(bool, expected)) >= 3  # words to compare, not empty lines
        assert engine.translate_lines(lines) == expected
        batch = tokenizer([f">>{way.tgt}<< {line}" for line in lines], return_tensors="pt", padding=True)
        assert batch["input_ids"].tolist() == pad_batch([ours.encode(i, x) for i, x in enumerate(lines)]).tolist()
        with torch.no_grad():
            generated = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=21)
        assert tokenizer.batch_decode(generated, skip_special_tokens=True) == expected
    german = (corpus / "c" / "test.de").read_text(encoding="utf-8").splitlines()[:6]
    through = [load_translator([path], engine, device="cpu", overrides=matching, languages=("de", "fr"), pivot="en")
               for path, engine in ((ck, "pytorch"), (ct2, "ctranslate2"))]  # fmt: skip
    assert through[1].translate_lines(german) == through[0].translate_lines(german)  # --pivot on either engine
    card = (hf / "README.md").read_text(encoding="utf-8")
    assert ">>de<<, >>en<<, >>fr<<" in card and "language: [en, de, fr]" in card


def test_data_stats_shows_each_directions_share_of_an_epoch(trained: Path, corpus: Path, tmp_path: Path) -> None:
    cfg = multi_config(corpus, "data.temperature=2")
    config = tmp_path / "multi.yaml"
    config.write_text(cfg.to_yaml(), encoding="utf-8")
    prepare_data(cfg)
    done = tmt("data-stats", str(config))
    assert done.returncode == 0, done.stderr
    assert "each epoch at data.temperature=2: en-de 33.3% (240 pairs" in done.stdout + done.stderr
    assert "train.en-fr: 240 pairs" in done.stdout + done.stderr


def test_plot_draws_each_direction_and_report_tables_them(trained: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from transformer_mt.plots import curves_figure
    from transformer_mt.report import report_markdown
    from transformer_mt.runs import read_run

    run = read_run(trained)
    valid = [r for r in metric_records(trained) if r["kind"] == "valid"]
    fig = curves_figure(run, tmp_path / "curves.png")
    loss, _, bleu = fig.axes[:3]
    by_label = {line.get_label(): line for line in loss.get_lines()}
    assert list(by_label["valid NLL en-fr"].get_ydata()) == [r["directions"]["en-fr"]["nll"] for r in valid]
    assert {line.get_label() for line in bleu.get_lines()} >= set(DIRECTIONS)
    text = report_markdown([run])
    assert "## Each direction of the runs of several languages" in text
    last = valid[-1]["directions"]
    for name in DIRECTIONS:
        assert f"| {name} | 12 | {last[name]['ppl']:.2f} | {last[name]['bleu']:.2f} |" in text


def test_plot_of_a_run_without_bleu_says_so_on_the_panel(trained: Path, tmp_path: Path) -> None:
    """A run of several directions that logged no validation BLEU: no empty curve per direction, and the note
    in the middle of the panel, not at data coordinates an empty curve would have moved off it."""
    pytest.importorskip("matplotlib")
    from transformer_mt.plots import curves_figure
    from transformer_mt.runs import read_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_bytes((trained / "config.yaml").read_bytes())
    records = metric_records(trained)
    for r in records:
        r.pop("bleu", None)
        for figures in (r.get("directions") or {}).values():
            figures.pop("bleu", None)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    fig = curves_figure(read_run(run_dir), tmp_path / "curves.png")
    bleu = fig.axes[2]
    assert not bleu.get_lines()
    (note,) = bleu.texts
    assert "no validation BLEU" in note.get_text() and note.get_transform() == bleu.transAxes
    assert note.get_position() == (0.5, 0.5)


@pytest.mark.slow
def test_the_benchmark_scores_each_direction_and_the_zero_shot_ones(
    trained: Path, corpus: Path, tmp_path: Path
) -> None:
    """benchmarks/multilingual.py end to end on the toy corpus (de-fr is its one zero-shot pair of known sides)."""
    pytest.importorskip("py3langid")
    import subprocess
    import sys

    config = tmp_path / "multi.yaml"
    config.write_text(multi_config(corpus).to_yaml(), encoding="utf-8")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "multilingual.py"
    done = subprocess.run(
        [sys.executable, str(script), "--config", str(config), "--updates", "12", "--out", str(tmp_path / "b")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "b" / "seed1" / "multilingual.json").read_text(encoding="utf-8"))
    assert list(report["multilingual"]) == DIRECTIONS
    assert all(set(s) == {"valid", "test"} for s in report["multilingual"].values())
    assert list(report["zero_shot"]) == ["de-fr"]
    assert report["minutes"]["multilingual"] == round(read_run(tmp_path / "b" / "seed1" / "multi").minutes, 1)
    zero = report["zero_shot"]["de-fr"]
    assert set(zero) == {"valid", "wrong_language_valid", "test", "wrong_language", "pivot_test"}
    assert 0.0 <= zero["wrong_language"] <= 1.0 and 0.0 <= zero["wrong_language_valid"] <= 1.0
    assert "| de-fr |" in done.stdout

    bilingual = tmp_path / "bi.yaml"
    bilingual.write_text(multi_config(corpus, "data.directions=[]").to_yaml(), encoding="utf-8")
    baseline = [sys.executable, str(script), "--config", str(config), "--bilingual", str(bilingual), "--updates", "12",
                "--out", str(tmp_path / "b"), "--no-multilingual", "--baselines"]  # fmt: skip
    wrong = subprocess.run([*baseline, "fr-de"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert wrong.returncode == 1 and "fr-de is not a direction of the config; choose among en-de, de-en, en-fr" in (
        wrong.stderr
    )
    done = subprocess.run([*baseline, "en-fr"], capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    again = json.loads((tmp_path / "b" / "seed1" / "multilingual.json").read_text(encoding="utf-8"))
    assert again["multilingual"] == report["multilingual"], "a baselines-only call keeps what the first call scored"
    assert list(again["bilingual"]) == ["en-fr"] and set(again["minutes"]) == {"multilingual", "en-fr"}
    assert again["minutes"]["en-fr"] == round(read_run(tmp_path / "b" / "seed1" / "bi_en_fr").minutes, 1)
    delta = round(report["multilingual"]["en-fr"]["test"] - again["bilingual"]["en-fr"]["test"], 2)
    assert f"| en-fr | {report['multilingual']['en-fr']['valid']} |" in done.stdout and f"| {delta} |" in done.stdout


@pytest.mark.slow
def test_the_serving_benchmark_spreads_clients_over_the_directions(trained: Path, corpus: Path, tmp_path: Path) -> None:
    """benchmarks/serve_load.py --directions: the first direction alone and the mixed workload, every answer that
    direction's own translation (none wrong, none lost), and their ratio printed."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    done = subprocess.run(
        [sys.executable, str(script), "-c", str(trained / "checkpoint_u0000012.pt"), "--text", str(corpus / "c" / "test"),
         "--directions", *DIRECTIONS, "--clients", "3", "--alone", "2", "--json", str(tmp_path / "load.json")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "load.json").read_text(encoding="utf-8"))["rows"]
    assert [(r["workload"], r["answered"], r["wrong"], r["lost"]) for r in rows] == [
        (DIRECTIONS[0], 24, 0, 0), ("mixed", 24, 0, 0),
    ]  # fmt: skip
    assert f"3 clients: mixed / {DIRECTIONS[0]} = " in done.stdout


def test_evaluate_scores_every_direction_into_its_own_directory(
    trained: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformer_mt.evaluate import evaluate_checkpoint
    from transformer_mt.metrics import corpus_sacrebleu

    ck = trained / "checkpoint_u0000012.pt"
    result = evaluate_checkpoint([ck], "test", output=tmp_path / "all")
    assert list(result["directions"]) == DIRECTIONS
    for name, scores in result["directions"].items():
        src, tgt = name.split("-")
        hyps = (tmp_path / "all" / name / f"hyp.{tgt}").read_text(encoding="utf-8").splitlines()
        refs = (corpus / "c" / f"test.{tgt}").read_text(encoding="utf-8").splitlines()
        assert scores["sacrebleu"]["score"] == pytest.approx(corpus_sacrebleu(hyps, refs)["score"])
        assert scores["direction"] == name and scores["corpus"] == f"test.{name}"
        assert json.loads((tmp_path / "all" / name / "scores.json").read_text(encoding="utf-8"))["direction"] == name
    table = capsys.readouterr().out
    assert "direction  sacreBLEU  chrF2" in table and all(f"\n{name} " in table for name in DIRECTIONS)
    one = evaluate_checkpoint([ck], "test", output=tmp_path / "one", languages=("en", "fr"))
    assert one["direction"] == "en-fr" and (tmp_path / "one" / "en-fr" / "hyp.fr").is_file()
    with pytest.raises(DirectionError, match="choose one with --tgt-lang"):
        evaluate_checkpoint([ck], src=corpus / "c" / "test.de", ref=corpus / "c" / "test.fr", output=tmp_path / "x")


def test_evaluate_scores_a_pair_through_the_pivot_beside_it(trained: Path, corpus: Path, tmp_path: Path) -> None:
    from transformer_mt.decode.translate import Translator
    from transformer_mt.evaluate import EvaluateError, evaluate_checkpoint

    ck = trained / "checkpoint_u0000012.pt"
    found = evaluate_checkpoint([ck], "test", output=tmp_path / "e", languages=("de", "fr"), pivot="en")
    assert found["pivot"] == "en" and found["direction"] == "de-fr"
    translator = Translator.from_checkpoints([ck])
    translator.show_progress = False
    sources = (corpus / "c" / "test.de").read_text(encoding="utf-8").splitlines()
    hyps = (tmp_path / "e" / "de-en-fr" / "hyp.fr").read_text(encoding="utf-8").splitlines()
    assert hyps == translator.toward("de", "fr", pivot="en").translate_lines(sources)
    with pytest.raises(EvaluateError, match="--pivot scores one pair"):
        evaluate_checkpoint([ck], "test", output=tmp_path / "x", pivot="en")


def test_init_writes_a_config_of_several_directions_that_loads(corpus: Path, tmp_path: Path) -> None:
    from transformer_mt.init_config import InitError, count_corpus, write_config

    out = tmp_path / "multi.yaml"
    prefixes = (f"{corpus}/c/train", f"{corpus}/c/valid", f"{corpus}/c/test")
    write_config(*prefixes, "", "", out, show=False, directions=tuple(DIRECTIONS))
    cfg = load_config(out)
    assert cfg.data.directions == DIRECTIONS and cfg.data.train == prefixes[0]
    text = out.read_text(encoding="utf-8")
    assert "720 training pairs (en-de, de-en, en-fr)" in text and "240 lines in each of en, de, fr" in text
    counted = count_corpus(*prefixes, "", "", show=False, directions=tuple(DIRECTIONS))
    assert counted.pairs == 3 * 240 and [s.path.suffix for s in counted.train] == [".en", ".de", ".fr"]
    with pytest.raises(InitError, match=r"train\.cs not found; --directions reads one file per language"):
        count_corpus(*prefixes, "", "", show=False, directions=("en-cs",))
    with pytest.raises(InitError, match="'ende' is not a direction"):
        count_corpus(*prefixes, "", "", show=False, directions=("ende",))
    both = tmt("init", "--train", prefixes[0], "--valid", prefixes[1], "--src", "en", "--directions", "en-de")
    assert_user_error(both, "--src and --tgt", "or --directions")


def test_a_direction_with_files_of_its_own_and_a_weight(corpus: Path, tmp_path: Path) -> None:
    """data.corpora: en-fr from 100 lines of other files (valid from data.valid's), weighted 2 in each epoch."""
    own = tmp_path / "own"
    own.mkdir()
    for lang in ("en", "fr"):
        lines = (corpus / "c" / f"train.{lang}").read_text(encoding="utf-8").splitlines()[:100]
        (own / f"train.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    corpora = f"data.corpora=[{{direction: en-fr, train: {own}/train, weight: 2}}]"
    cfg = multi_config(corpus, "data.directions=[en-de,de-en]", corpora, f"data.dir={tmp_path}/out")
    assert [w.name for w in directions(cfg.data)] == DIRECTIONS and weights(cfg.data) == [1.0, 1.0, 2.0]
    assert prefix(cfg.data, Direction("en", "fr"), "valid") == f"{corpus}/c/valid"
    prepare_data(cfg)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["splits"]["train.en-fr"]["sentences"] == 100 and manifest["splits"]["valid.en-fr"]["read"] == 24
    assert manifest["directions"] == DIRECTIONS
    sizes = np.array([240, 240, 100])
    selection = epoch_selection(sizes, cfg.data.temperature, 1, 1, weights(cfg.data))
    expected = np.round(sizes.sum() * sizes * [1, 1, 2] / (sizes * [1, 1, 2]).sum())
    assert np.bincount(np.searchsorted([240, 480], selection, side="right"), minlength=3).tolist() == list(expected)
    missing = multi_config(corpus, f"data.corpora=[{{direction: en-cs, train: {own}/train}}]", f"data.dir={tmp_path}/x")
    with pytest.raises(PrepareError, match=r"own/train\.cs.*fix data\.corpora\[0\]\.train"):
        prepare_data(missing)


def test_word_alignments_count_the_words_of_the_text_not_the_tag(trained: Path, corpus: Path) -> None:
    from transformer_mt.decode.translate import Translator

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"], device="cpu")
    translator.show_progress = False
    lines = (corpus / "c" / "test.en").read_text(encoding="utf-8").splitlines()[:4]
    hard = translator.toward("en", "de").with_decode({"alignment": "hard"})
    soft = translator.toward("en", "de").with_decode({"alignment": "soft"})
    found = zip(lines, hard.translate_lines_nbest(lines, 1), soft.translate_lines_nbest(lines, 1), strict=True)
    for line, hyps, rows in found:
        pairs = [tuple(map(int, p.split("-"))) for p in hyps[0].alignment.split()]
        assert pairs and max(i for i, _ in pairs) < len(line.split())
        assert all(len(row.split(",")) == len(line.split()) for row in rows[0].alignment.split())


@pytest.mark.slow
def test_the_demo_page_translates_into_the_target_chosen(trained: Path, corpus: Path) -> None:
    """A real `tmt serve` of the model of several directions and a real browser: pick French, translate."""
    from conftest import _free_port
    from helpers import browser_and_server
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from transformer_mt.decode.translate import Translator

    ck = trained / "checkpoint_u0000012.pt"
    line = (corpus / "c" / "test.en").read_text(encoding="utf-8").splitlines()[0]
    want = Translator.from_checkpoints([ck], device="cpu").toward("en", "fr").translate_lines([line])[0]
    port = _free_port()
    with browser_and_server(ck, port) as driver:
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "directions en-de, de-en, en-fr" in d.find_element(By.ID, "model").text)
        target, source = Select(driver.find_element(By.ID, "target")), Select(driver.find_element(By.ID, "source-lang"))
        target.select_by_value("de")
        source.select_by_value("de")  # German chosen: not into German, which the page leaves
        assert target.first_selected_option.get_attribute("value") == "en"
        assert [o.get_attribute("value") for o in target.options if not o.is_enabled()] == ["de"]
        source.select_by_value("auto")
        target.select_by_value("fr")
        driver.find_element(By.ID, "source").send_keys(line)
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: d.find_element(By.ID, "output").text.strip() or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        assert driver.find_element(By.ID, "output").text == want.strip()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap td"))  # the attention toward French


# ---------------------------------------------------------------- pivot


def test_a_pivot_translates_into_it_and_then_out_of_it(trained: Path) -> None:
    """de->fr through en equals de->en, then en->fr of its output, line by line; an empty line stays empty."""
    from transformer_mt.decode.translate import Translator

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"])
    translator.show_progress = False
    lines = ["Die Frau wäscht den Garten.", "", "Das Pferd läuft.", "Der Mann"]
    english = translator.toward("de", "en").translate_lines(lines)
    assert translator.toward("de", "fr", pivot="en").translate_lines(lines) == (
        translator.toward("en", "fr").translate_lines(english)
    )
    assert translator.toward("de", "fr", pivot="en").translate_lines(lines)[1] == ""
    assert translator.toward("de", "fr", pivot="en").direction == Direction("de", "fr")


def test_constraints_through_a_pivot_bind_the_last_leg(trained: Path) -> None:
    from transformer_mt.decode.translate import Translator

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"])
    translator.show_progress = False
    pivoted = translator.toward("de", "fr", pivot="en")
    english = translator.toward("de", "en").translate_lines(["Das Pferd läuft."])
    direct = translator.toward("en", "fr").translate_constrained([english[0] + "\thorse"], 1)
    through = pivoted.translate_constrained(["Das Pferd läuft.\thorse"], 1)
    assert [t.text for t in through[0]] == [t.text for t in direct[0]] and "horse" in through[0][0].text


@pytest.mark.parametrize(
    ("pivot", "fragment"),
    [("de", "must differ from the source and the target (de-fr)"), ("cs", "--pivot: 'cs' is not a source language")],
)
def test_a_pivot_that_cannot_carry_the_pair_is_one_error(trained: Path, pivot: str, fragment: str) -> None:
    from transformer_mt.decode.translate import TranslateError, Translator
    from transformer_mt.errors import UserError

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"])
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        translator.toward("de", "fr", pivot=pivot)
    with pytest.raises(TranslateError, match="--alignment with --pivot"):
        translator.with_decode({"alignment": "hard"}).toward("de", "fr", pivot="en")
    aligned = translator.toward("de", "fr", pivot="en").with_decode({"alignment": "hard"})  # a server's request
    with pytest.raises(TranslateError, match="--alignment with --pivot"):
        aligned.translate_lines(["Das Pferd."])
    with pytest.raises(TranslateError, match="--pivot en: name the input's language too, with --src-lang"):
        translator.toward(None, "fr", pivot="en")


def test_the_zero_shot_warning_names_a_pivot_and_a_pivot_silences_it(trained: Path) -> None:
    from transformer_mt.decode.translate import Translator, zero_shot_warning

    translator = Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"])
    warning = zero_shot_warning(translator.toward("de", "fr"))
    assert warning is not None and "never trained on de-fr" in warning and "--pivot en" in warning
    assert zero_shot_warning(translator.toward("de", "fr", pivot="en")) is None
    assert zero_shot_warning(translator.toward("en", "fr")) is None


def test_a_server_of_one_model_answers_its_untrained_pairs_through_the_pivot(trained: Path) -> None:
    pytest.importorskip("starlette")
    from transformer_mt.decode.translate import Translator
    from transformer_mt.serve.models import Models

    models = Models([Translator.from_checkpoints([trained / "checkpoint_u0000012.pt"])], pivot="en")
    assert models.legs("de", "fr") == [("de", "en"), ("en", "fr")]
    assert models.legs("en", "fr") == [("en", "fr")] and models.legs(None, "fr") == [(None, "fr")]
    assert ("de", "fr") in models.languages.pairs


@pytest.mark.slow
def test_translate_pivot_flag_gives_the_two_legs_output(trained: Path, tmp_path: Path) -> None:
    ck = str(trained / "checkpoint_u0000012.pt")
    source = tmp_path / "in.de"
    source.write_text("Die Frau wäscht den Garten.\n\nDas Pferd läuft.\n", encoding="utf-8")
    english, french = tmp_path / "out.en", tmp_path / "out.fr"
    first = tmt("translate", "-c", ck, "--src-lang", "de", "--tgt-lang", "en", "-i", str(source), "-o", str(english))
    second = tmt("translate", "-c", ck, "--src-lang", "en", "--tgt-lang", "fr", "-i", str(english), "-o", str(french))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    done = tmt("translate", "-c", ck, "--src-lang", "de", "--tgt-lang", "fr", "--pivot", "en", "-i", str(source))
    assert done.returncode == 0, done.stderr
    assert done.stdout == french.read_text(encoding="utf-8") and "zero-shot" not in done.stderr
