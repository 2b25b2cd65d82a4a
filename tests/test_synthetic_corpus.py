"""`tmt backtranslate` and `tmt distill`: a corpus of a model's translations, resumable after a kill.

The toy checkpoint translates en -> de: as a "teacher" it distils English
text, as a "reverse model" it back-translates text named in neither
language. A real process is killed (SIGKILL, no chance to clean up) after
its first windows are saved; the second call must translate only the rest
and write exactly the corpus of an uninterrupted run, sampled lines included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_resume_is_bit_exact, run_config, tmt

from transformer_mt.config import Config, ConfigError, load_config
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.clean import InputError
from transformer_mt.data.directions import BT_TAG, directions, multilingual, train_parts, weights
from transformer_mt.data.mix import temperature_shares, train_mix
from transformer_mt.data.prepare import prepare_data, prepare_hash
from transformer_mt.data.synthetic import write_corpus
from transformer_mt.decode.translate import Translator
from transformer_mt.synthetic_corpus import CorpusError, make_corpus
from transformer_mt.train.trainer import train_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text(prepared_toy: Config) -> list[str]:
    return Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:40]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_the_corpus_pairs_each_line_with_its_translation(toy_ckpt: Path, text: list[str], tmp_path: Path) -> None:
    src, tgt = make_corpus([toy_ckpt], _write(tmp_path / "train.en", text), tmp_path / "kd", window_lines=15)
    assert (src.name, tgt.name) == ("kd.en", "kd.de")
    t = Translator.from_checkpoints([toy_ckpt], device="cpu")
    t.show_progress = False
    assert src.read_text(encoding="utf-8").splitlines() == text
    assert tgt.read_text(encoding="utf-8").splitlines() == t.translate_lines(text)
    assert not (tmp_path / "kd.parts").exists()


@pytest.mark.slow
def test_a_killed_backtranslation_resumes_at_its_window_and_equals_an_uninterrupted_run(
    toy_ckpt: Path, text: list[str], tmp_path: Path
) -> None:
    mono = _write(tmp_path / "mono.txt", text * 15)  # 600 lines, 60 windows
    sampled = ["--sample", "topk:5", "--seed", "3"]
    expected = make_corpus(
        [toy_ckpt], mono, tmp_path / "whole", ["decode.sampling=topk:5", "decode.seed=3", "decode.beam_size=1"],
        window_lines=10,
    )[1].read_text(encoding="utf-8")  # fmt: skip
    command = [sys.executable, "-m", "transformer_mt", "backtranslate", "-c", str(toy_ckpt), "-i", str(mono),
               "-o", str(tmp_path / "bt"), "--window-lines", "10", *sampled]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    parts = tmp_path / "bt.parts"
    deadline = time.monotonic() + 120
    while len(list(parts.glob("*.de"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    done = len(list(parts.glob("*.de")))
    assert 3 <= done < 60 and not (tmp_path / "bt.de").exists()
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {done * 10} of 600 lines were translated already" in again.stderr
    assert (tmp_path / "bt.de").read_text(encoding="utf-8") == expected
    assert (tmp_path / "bt.en").read_text(encoding="utf-8") == mono.read_text(encoding="utf-8")
    assert not parts.exists()


def test_a_restart_with_another_plan_is_refused_and_force_starts_over(
    toy_ckpt: Path, text: list[str], tmp_path: Path
) -> None:
    mono = _write(tmp_path / "mono.txt", text)
    parts = tmp_path / "bt.parts"
    parts.mkdir()
    (parts / "plan.json").write_text('{"input": "other.txt"}\n', encoding="utf-8")
    (parts / "000000.de").write_text("stale\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"another input, input_sha256, lines, .*pass --force to start over"):
        make_corpus([toy_ckpt], mono, tmp_path / "bt", window_lines=10)
    src, tgt = make_corpus([toy_ckpt], mono, tmp_path / "bt", window_lines=10, force=True)
    assert "stale" not in tgt.read_text(encoding="utf-8").splitlines()
    with pytest.raises(CorpusError, match="bt.en exists already; pass --force"):
        make_corpus([toy_ckpt], mono, tmp_path / "bt", window_lines=10)


@pytest.mark.parametrize(
    ("name", "content", "error", "says"),
    [
        ("mono.txt", b"A dog runs.\n\nA cat sleeps.\n", CorpusError, r"mono.txt, line 2: an empty line"),
        ("mono.txt", b"A dog runs.\n \t\n", CorpusError, r"mono.txt, line 2: an empty line"),
        ("mono.txt", b"A dog runs.\nA \xff cat.\n", InputError, r"mono.txt, line 2"),
        ("mono.txt", b"", CorpusError, r"mono.txt: no lines to translate"),
        ("mono.de", b"Ein Hund rennt.\n", CorpusError, r"mono.de: the file is named for 'de', but the model translates en-de"),
        ("mono.txt", "Ένας σκύλος τρέχει στο πάρκο.\n".encode() * 5, CorpusError, r"mono.txt: .* are not in the model's vocabulary"),
    ],
)  # fmt: skip
def test_input_that_would_make_a_wrong_corpus_is_refused_naming_file_and_line(
    toy_ckpt: Path, tmp_path: Path, name: str, content: bytes, error: type, says: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(error, match=says):
        make_corpus([toy_ckpt], path, tmp_path / "bt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_nbest_or_alignments_are_no_corpus(toy_ckpt: Path, text: list[str], tmp_path: Path) -> None:
    mono = _write(tmp_path / "mono.txt", text)
    with pytest.raises(CorpusError, match="one plain translation per line"):
        make_corpus([toy_ckpt], mono, tmp_path / "bt", ["decode.alignment=hard"])


def test_the_command_line_is_one_line_per_refusal(toy_ckpt: Path, tmp_path: Path) -> None:
    path = tmp_path / "mono.txt"
    path.write_text("A dog.\n\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "distill", "-c", str(toy_ckpt), "-i", str(path), "-o",
         str(tmp_path / "kd")], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {path}, line 2: an empty line; a corpus pairs sentences, one per line: remove the empty lines "
        f"first (grep -v '^[[:space:]]*$' {path} > cleaned)"
    ], done.stderr


# ---------------------------------------------------------------- synthetic corpora in a config


def pair_config(root: Path, *extra: str):
    """The toy corpus of one pair (en-de, c/) with the given keys; a 1+1-layer model, 12 updates."""
    return load_config(
        "tmt:toy.yaml",
        [
            f"data.train={root}/c/train", f"data.valid={root}/c/valid", f"data.test={root}/c/test",
            f"data.dir={root}/out", "data.synth=false", "data.workers=1", "bpe.vocab_size=150", "model.d_model=32",
            "model.d_ff=64", "model.encoder_layers=1", "model.decoder_layers=1", "train.max_updates=12",
            "train.validate_every=6", "train.save_every_updates=6", "train.warmup=4", "train.valid_bleu_sentences=0",
            "decode.max_len_b=5", *extra,
        ],
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy en-de corpus (200 training pairs) and a synthetic one, bt.{en,de}: 120 other lines whose English side
    is the toy model's own back-translation of the German (made by `make_corpus`, as `tmt backtranslate` does)."""
    root = tmp_path_factory.mktemp("pair")
    write_corpus(root / "c", 200, 20, 20, 1, "en", "de")
    write_corpus(root / "other", 120, 1, 1, 7, "en", "de")
    return root


@pytest.fixture(scope="module")
def bt(pair: Path, toy_ckpt: Path) -> Path:
    """The synthetic corpus: the toy checkpoint (standing in for a reverse model) translates 120 lines of text."""
    german = (pair / "other" / "train.de").read_text(encoding="utf-8").splitlines()
    mono = _write(pair / "mono.txt", german)
    make_corpus([toy_ckpt], mono, pair / "made", window_lines=50)  # made.en: the text, made.de: its translations
    (pair / "bt.de").write_text((pair / "made.en").read_text(encoding="utf-8"), encoding="utf-8")
    (pair / "bt.en").write_text((pair / "made.de").read_text(encoding="utf-8"), encoding="utf-8")
    return pair / "bt"


def _pieces(path: Path) -> list[str]:
    bpe = load_bpe(path)
    return [bpe.id_to_piece(i) for i in range(bpe.get_piece_size())]


def synthetic(prefix: Path, tag: bool, weight: float = 1.0) -> str:
    return f"data.corpora=[{{direction: en-de, train: {prefix}, synthetic: true, tag: {str(tag).lower()}, weight: {weight}}}]"


@pytest.mark.parametrize(
    ("corpora", "says"),
    [
        ("[{direction: en-de, train: x, synthetic: true, valid: y}]", "a synthetic corpus trains only"),
        ("[{direction: en-de, train: x, tag: true}]", "set synthetic: true too"),
        ("[{direction: de-en, train: x, synthetic: true}]", "a synthetic corpus of de-en, which the model does not train"),
    ],
)  # fmt: skip
def test_a_synthetic_corpus_the_model_cannot_use_is_a_config_error(corpora: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config("tmt:toy.yaml", ["data.synth=false", f"data.corpora={corpora}"])


def test_a_synthetic_corpus_keeps_a_model_of_one_pair_and_its_prepared_data(pair: Path, bt: Path) -> None:
    plain = pair_config(pair)
    cfg = pair_config(pair, synthetic(bt, tag=False))
    assert not multilingual(cfg.data) and [w.name for w in directions(cfg.data)] == ["en-de"]
    assert [(p.name, p.synthetic) for p in train_parts(cfg.data)] == [("train", False), ("train.synthetic0", True)]
    corpora = "data.corpora=[{direction: en-de, train: x}, {direction: en-fr, train: y, weight: 2}]"
    assert prepare_hash(load_config("tmt:toy.yaml", ["data.synth=false", corpora])) == (
        "b9f293960a37cb2667fb280148f8c5c6"
    )  # as before synthetic corpora existed: data prepared with data.corpora stays up to date
    prepare_data(plain)
    before = _pieces(pair / "out" / "spm.model")
    prepare_data(cfg)  # the synthetic text stays out of the BPE sample: the same vocabulary
    assert _pieces(pair / "out" / "spm.model") == before
    manifest = json.loads((pair / "out" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["splits"]["train.synthetic0"]["read"] == 120 and manifest.get("directions", []) == []


def test_a_tagged_corpus_starts_its_sources_with_bt_and_the_real_ones_do_not(pair: Path, bt: Path, tmp_path) -> None:
    cfg = pair_config(pair, synthetic(bt, tag=True, weight=0.5), f"data.dir={tmp_path}/out")
    prepare_data(cfg)
    bpe = load_bpe(tmp_path / "out" / "spm.model")
    bt_id = bpe.piece_to_id(BT_TAG)
    assert bpe.id_to_piece(bt_id) == BT_TAG
    mix = train_mix(tmp_path / "out", cfg.data, bpe)
    real, made = (int(n) for n in mix.sizes)
    assert all(mix.src_ids(i)[0] != bt_id for i in range(real))
    assert all(mix.src_ids(i)[0] == bt_id and bt_id not in mix.src_ids(i)[1:] for i in range(real, real + made))
    assert weights(cfg.data) == [1.0, 0.5]
    config = tmp_path / "bt.yaml"
    config.write_text(cfg.to_yaml(), encoding="utf-8")
    done = tmt("data-stats", str(config))
    assert done.returncode == 0, done.stderr
    shares = temperature_shares(mix.sizes, 1.0, [1.0, 0.5])
    assert f"en-de synthetic (tagged) {bt} {shares[1]:.1%}" in done.stdout
    marked = f"each epoch: corpora marked synthetic {shares[1]:.1%}, the rest (data.train's included) {shares[0]:.1%}"
    assert marked in done.stdout


@pytest.mark.slow
def test_synthetic_corpora_keep_resume_bit_exact_and_the_log_shows_their_share(
    pair: Path, bt: Path, tmp_path: Path, capfd
) -> None:
    cfg = pair_config(pair, synthetic(bt, tag=True, weight=0.5), f"data.dir={tmp_path}/out")
    whole = assert_resume_is_bit_exact(cfg, tmp_path)
    assert "each epoch: corpora marked synthetic" in capfd.readouterr().err
    t = Translator.from_checkpoints([whole / "checkpoint_u0000012.pt"], device="cpu")
    t.show_progress = False
    assert len(t.translate_lines(["A dog runs.", "The man sees a cat."])) == 2  # real input: no <BT> added
    assert t.source_prefix == []


@pytest.mark.slow
def test_a_student_trains_on_a_teachers_corpus_and_decodes_int8(pair: Path, toy_ckpt: Path, tmp_path: Path) -> None:
    """The distillation path end to end at toy scale: `make_corpus` of the training sources with the toy model as
    teacher, a student with a deeper encoder than decoder (as configs/multi30k_student.yaml) trained on it, and
    the student's int8 translations, one per line."""
    kd = make_corpus([toy_ckpt], pair / "c" / "train.en", tmp_path / "kd", window_lines=100)[1]
    assert len(kd.read_text(encoding="utf-8").splitlines()) == 200
    cfg = pair_config(
        pair, f"data.train={tmp_path}/kd", f"data.dir={tmp_path}/out", "model.encoder_layers=2",
        "model.decoder_layers=1", "data.max_ratio=100",
    )  # fmt: skip
    train_model(run_config(cfg, tmp_path / "student"))
    student = Translator.from_checkpoints(
        [tmp_path / "student" / "checkpoint_u0000012.pt"], device="cpu", overrides=["decode.quantize=int8"]
    )
    student.show_progress = False
    lines = (pair / "c" / "test.en").read_text(encoding="utf-8").splitlines()
    assert len(student.translate_lines(lines)) == len(lines) and student.cfg.model.decoder_layers == 1
