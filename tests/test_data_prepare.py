"""`tmt prepare`: round trips, filtering, re-runs, and every bad input's message."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import prepare_config as _config

from transformer_mt.data import binarize
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.clean import EMPTY, RATIO, TOO_LONG, normalize
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.manifest import Manifest
from transformer_mt.data.prepare import MANIFEST, PrepareError, Reservoir, is_prepared, load_manifest, prepare_data
from transformer_mt.data.synthetic import write_corpus
from transformer_mt.errors import UserError


def _write(root: Path, split: str, en: list[str] | bytes, de: list[str] | bytes) -> None:
    (root / "c").mkdir(parents=True, exist_ok=True)
    for lang, lines in (("en", en), ("de", de)):
        data = lines if isinstance(lines, bytes) else "".join(line + "\n" for line in lines).encode()
        (root / "c" / f"{split}.{lang}").write_bytes(data)


@pytest.fixture
def small(tmp_path) -> Path:
    write_corpus(tmp_path / "c", pairs=300, valid=30, test=30, seed=4)
    return tmp_path


def test_binarized_splits_decode_back_to_the_normalized_text(prepared_toy):
    d = prepared_toy.data
    sp = load_bpe(Path(d.dir) / "spm.model")
    manifest = load_manifest(d.dir)
    for split, prefix in (("train", d.train), ("valid", d.valid), ("test", d.test)):
        ds = ParallelDataset(d.dir, split, d.src_lang, d.tgt_lang)
        src = Path(f"{prefix}.{d.src_lang}").read_text(encoding="utf-8").splitlines()
        tgt = Path(f"{prefix}.{d.tgt_lang}").read_text(encoding="utf-8").splitlines()
        assert len(ds) == len(src) == manifest.splits[split].sentences
        assert [sp.decode(ds.src_ids(i).tolist()) for i in range(len(ds))] == [normalize(s) for s in src]
        assert [sp.decode(ds.tgt_ids(i).tolist()) for i in range(len(ds))] == [normalize(t) for t in tgt]
        assert int(ds.src_lens.sum()) - len(ds) == manifest.splits[split].src_tokens
    assert manifest.vocab_size == sp.get_piece_size() == prepared_toy.bpe.vocab_size
    assert is_prepared(prepared_toy)


def test_filters_train_and_only_empty_pairs_of_valid(tmp_path):
    long = " ".join(["word"] * 31)
    en = ["a small cat .", "", "one two three four five six", long, "the  dog\tsleeps", "keep me"]
    de = ["eine kleine Katze .", "leer", "eins", long, "der Hund schläft", "behalte mich"]
    _write(tmp_path, "train", en * 20, de * 20)
    _write(tmp_path, "valid", [long, "", "ok"], [long, "x", "gut"])
    _write(tmp_path, "test", ["ok"], ["gut"])
    prepare_data(_config(tmp_path, "bpe.vocab_size=60"))
    splits = load_manifest(tmp_path / "out").splits
    assert splits["train"].dropped == {EMPTY: 20, RATIO: 20, TOO_LONG: 20}
    assert splits["train"].sentences == 60 and splits["train"].read == 120
    assert splits["valid"].dropped == {EMPTY: 1} and splits["valid"].sentences == 2  # long pair kept
    sp = load_bpe(tmp_path / "out" / "spm.model")
    ds = ParallelDataset(tmp_path / "out", "train", "en", "de")
    assert sp.decode(ds.src_ids(1).tolist()) == "the dog sleeps"


def test_rerun_does_nothing_and_force_redoes(small, capsys):
    cfg = _config(small)
    prepare_data(cfg)
    stamp = (small / "out" / MANIFEST).stat().st_mtime_ns
    capsys.readouterr()
    prepare_data(cfg)
    assert "up to date" in capsys.readouterr().err
    assert (small / "out" / MANIFEST).stat().st_mtime_ns == stamp
    prepare_data(cfg, force=True)
    assert (small / "out" / MANIFEST).stat().st_mtime_ns != stamp


def test_the_manifest_reads_back_to_the_same_bytes(small):
    """`Manifest` is the JSON's one description: reading a written manifest and writing it again changes nothing."""
    prepare_data(_config(small))
    text = (small / "out" / MANIFEST).read_text(encoding="utf-8")
    manifest = load_manifest(small / "out")
    assert manifest.splits["train"].bpe_sample is not None and manifest.splits["valid"].bpe_sample is None
    assert Manifest.from_dict(json.loads(text)).to_json() == manifest.to_json() == text


def test_a_manifest_without_unk_counts_still_reads(small):
    """Manifests written before <unk> was counted lack src_unk/tgt_unk: they read as 0, and stay up to date."""
    cfg = _config(small)
    prepare_data(cfg)
    raw = json.loads((small / "out" / MANIFEST).read_text())
    for stats in raw["splits"].values():
        del stats["src_unk"], stats["tgt_unk"]
    (small / "out" / MANIFEST).write_text(json.dumps(raw, indent=2) + "\n")
    assert load_manifest(small / "out").splits["train"].src_unk == 0
    assert is_prepared(cfg)


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: [raw],  # not an object
        lambda raw: {k: v for k, v in raw.items() if k != "splits"},
        lambda raw: raw | {"vocab_size": "300"},
        lambda raw: raw | {"inputs": {path: {"sha256": "0"} for path in raw["inputs"]}},
    ],
)
def test_a_malformed_manifest_is_taken_as_absent(small, damage):
    cfg = _config(small)
    prepare_data(cfg)
    manifest = small / "out" / MANIFEST
    manifest.write_text(json.dumps(damage(json.loads(manifest.read_text()))))
    assert load_manifest(small / "out") is None and not is_prepared(cfg)
    prepare_data(cfg)
    assert is_prepared(cfg)


def test_a_manifest_of_another_format_is_not_up_to_date(small):
    cfg = _config(small)
    prepare_data(cfg)
    manifest = small / "out" / MANIFEST
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"format": 0}))
    assert load_manifest(small / "out").format == 0 and not is_prepared(cfg)
    prepare_data(cfg)
    assert load_manifest(small / "out").format == 1 and is_prepared(cfg)


def test_changed_config_or_input_redoes(small):
    prepare_data(_config(small))
    assert not is_prepared(_config(small, "bpe.vocab_size=100"))
    assert is_prepared(_config(small, "data.workers=2"))  # how, not what: same output
    prepare_data(_config(small, "bpe.vocab_size=100"))
    assert load_manifest(small / "out").vocab_size == 100
    with open(small / "c" / "test.en", "a") as f, open(small / "c" / "test.de", "a") as g:
        f.write("One more line.\n")
        g.write("Noch eine Zeile.\n")
    cfg = _config(small, "bpe.vocab_size=100")
    assert not is_prepared(cfg)
    prepare_data(cfg)
    assert load_manifest(small / "out").splits["test"].sentences == 31


def test_parallel_workers_give_the_same_arrays(tmp_path):
    write_corpus(tmp_path / "c", pairs=5000, valid=10, test=10, seed=1)
    one = prepare_data(_config(tmp_path, "data.workers=1", f"data.dir={tmp_path}/one"))
    two = prepare_data(_config(tmp_path, "data.workers=2", f"data.dir={tmp_path}/two"))
    for name in ("train.en.ids.npy", "train.de.ids.npy", "train.de.offsets.npy", "spm.vocab"):
        assert (one / name).read_bytes() == (two / name).read_bytes()


def test_synth_generates_the_corpus_when_missing(tmp_path):
    cfg = _config(tmp_path, "data.synth=true", "data.synth_pairs=200")
    prepare_data(cfg)
    assert len((tmp_path / "c" / "train.en").read_text().splitlines()) == 200
    assert load_manifest(tmp_path / "out").splits["valid"].sentences == 1000


def test_a_data_dir_below_a_file_is_refused_before_the_toy_corpus_is_written(tmp_path):
    (tmp_path / "a_file").write_text("not a directory\n")
    cfg = _config(tmp_path, "data.synth=true", "data.synth_pairs=200", f"data.dir={tmp_path}/a_file/prepared")
    with pytest.raises(UserError, match=r"^data.dir .*a_file is a file, not a directory"):
        prepare_data(cfg)
    assert not (tmp_path / "c").exists()


def test_synth_with_foreign_prefix_says_which_key(tmp_path):
    cfg = _config(tmp_path, "data.synth=true", f"data.valid={tmp_path}/elsewhere/dev")
    with pytest.raises(PrepareError, match="data.valid"):
        prepare_data(cfg)


# ---------------------------------------------------------------- bad input


def test_line_count_mismatch_names_both_files_and_counts(small):
    (small / "c" / "train.de").write_text("nur eine Zeile\n", encoding="utf-8")
    with pytest.raises(PrepareError) as err:
        prepare_data(_config(small))
    message = str(err.value)
    assert "train.en has 300 lines" in message and "train.de has 1" in message and "data.train" in message


def test_invalid_utf8_names_file_and_line(small):
    lines = (small / "c" / "valid.de").read_bytes().split(b"\n")
    lines[6] = b"Gr\xfc\xdfe"
    (small / "c" / "valid.de").write_bytes(b"\n".join(lines))
    with pytest.raises(UserError, match=r"valid\.de, line 7: not valid UTF-8"):
        prepare_data(_config(small))
    assert not (small / "out" / MANIFEST).exists()


def test_missing_file_names_it_and_the_key(small):
    (small / "c" / "test.de").unlink()
    with pytest.raises(PrepareError, match=r"missing input file .*test\.de.*data\.test"):
        prepare_data(_config(small))


def test_missing_file_hints_at_the_toy_corpus_or_wmt_only_for_their_paths(small):
    (small / "c" / "test.de").unlink()
    with pytest.raises(PrepareError) as own:
        prepare_data(_config(small))
    assert "toy" not in str(own.value) and "download" not in str(own.value)  # one's own data: no advice about others
    toy = _config(small, f"data.test={small}/toy/corpus/test")
    with pytest.raises(PrepareError, match=r"toy/corpus/test\.en.*for the toy corpus run `tmt synth`"):
        prepare_data(toy)
    wmt = _config(small, f"data.test={small}/data/wmt14_en_de/newstest2014")
    with pytest.raises(PrepareError, match=r"fetch it with `tmt download wmt14 --pair en-de`"):
        prepare_data(wmt)


def test_empty_after_filtering_gives_counts_and_keys(tmp_path):
    _write(tmp_path, "train", ["a b c d"] * 5 + [""], ["x"] * 6)
    _write(tmp_path, "valid", ["a"], ["b"])
    _write(tmp_path, "test", ["a"], ["b"])
    with pytest.raises(PrepareError) as err:
        prepare_data(_config(tmp_path))
    message = str(err.value)
    assert f"{RATIO}: 5" in message and f"{EMPTY}: 1" in message
    assert "data.max_ratio" in message and "data.max_len" in message


def test_unreachable_vocabulary_suggests_a_smaller_one(small):
    with pytest.raises(UserError, match=r"bpe\.vocab_size=5000 cannot be reached.*--set bpe\.vocab_size=\d+"):
        prepare_data(_config(small, "bpe.vocab_size=5000"))
    assert not (small / "out" / MANIFEST).exists()


def test_interrupted_prepare_leaves_no_manifest_and_rerun_completes(small, monkeypatch):
    cfg = _config(small)
    prepare_data(cfg)  # a complete earlier run: its manifest must not survive a failed redo
    real = binarize._encode_pair_chunk
    calls = Counter()

    def flaky(model_path, src, tgt):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-encoding
        return real(model_path, src, tgt)

    monkeypatch.setattr(binarize, "_encode_pair_chunk", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, force=True)
    out = small / "out"
    assert not (out / MANIFEST).exists()
    assert not is_prepared(cfg)
    assert not list(out.glob(".prepare-*"))
    monkeypatch.setattr(binarize, "_encode_pair_chunk", real)
    prepare_data(cfg)
    assert is_prepared(cfg)
    assert json.loads((out / MANIFEST).read_text())["splits"]["train"]["sentences"] == 300


# ---------------------------------------------------------------- sampling


def test_reservoir_keeps_k_items_uniformly():
    n, k, trials = 1000, 100, 1000
    hits = np.zeros(n)
    for t in range(trials):
        r = Reservoir(k, random.Random(t))
        for i in range(n):
            r.add(i)
        assert len(r.items) == k and len(set(r.items)) == k
        hits[r.items] += 1
    expected = trials * k / n  # 100, standard deviation about 9.5
    assert np.all(np.abs(hits - expected) < 45)
    assert abs(hits[: n // 2].mean() - hits[n // 2 :].mean()) < 3  # no bias towards early or late items


def test_reservoir_smaller_stream_keeps_everything():
    r = Reservoir(10, random.Random(0))
    for i in range(7):
        r.add(i)
    assert r.items == list(range(7))


def test_no_test_split_when_test_prefix_is_empty(small):
    prepare_data(_config(small, "data.test="))
    assert set(load_manifest(small / "out").splits) == {"train", "valid"}
