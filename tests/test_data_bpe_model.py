"""bpe.model: `tmt prepare` encodes with a given sentencepiece model instead of learning one.

What fine-tuning on a new corpus needs: the new data in the vocabulary the
checkpoint was trained with. The model is copied byte for byte, its digest
decides whether the data is up to date, and a file that is not a usable model
stops prepare with its name and the fix.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from helpers import prepare_config as _config

from transformer_mt.config import Config, load_config
from transformer_mt.data.bpe import UNK, BpeError, load_bpe, write_vocab
from transformer_mt.data.clean import normalize
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.prepare import MANIFEST, is_prepared, load_manifest, prepare_data, prepare_hash
from transformer_mt.data.synthetic import write_corpus


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """Another toy corpus than the one `prepared_toy` learned its BPE on (another seed, 300 pairs)."""
    write_corpus(tmp_path / "c", pairs=300, valid=30, test=30, seed=4)
    return tmp_path


@pytest.fixture
def given(prepared_toy: Config, tmp_path: Path) -> Path:
    """A copy of the toy corpus's BPE model (300 pieces), as `tmt export spm` would write it."""
    path = tmp_path / "given" / "spm.model"
    path.parent.mkdir()
    shutil.copyfile(Path(prepared_toy.data.dir) / "spm.model", path)
    return path


def test_encodes_with_the_given_model_byte_for_byte(small: Path, given: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = _config(small, f"bpe.model={given}")
    prepare_data(cfg)
    out = small / "out"
    assert (out / "spm.model").read_bytes() == given.read_bytes()
    sp = load_bpe(given)
    manifest = load_manifest(out)
    assert manifest.vocab_size == sp.get_piece_size() == 300  # the model's size, not bpe.vocab_size=120
    assert manifest.bpe_model.path == str(given) and manifest.splits["train"].bpe_sample is None
    ds = ParallelDataset(out, "valid", "en", "de")
    lines = (small / "c" / "valid.en").read_text(encoding="utf-8").splitlines()
    assert [sp.decode(ds.src_ids(i).tolist()) for i in range(len(ds))] == [normalize(s) for s in lines]
    assert ds.src_ids(0).tolist() == sp.encode(normalize(lines[0]))
    err = capsys.readouterr().err
    assert f"encoding with the BPE model {given} (300 pieces; bpe.model is set, so bpe.vocab_size" in err
    assert "learning a joint BPE" not in err


def test_unknown_characters_are_counted_and_reported(small: Path, given: Path, capsys: pytest.CaptureFixture) -> None:
    """Text of another script or domain meets characters the given model never saw: prepare counts the <unk>."""
    for lang, line in (("en", "the snowman ☃ sees the car ."), ("de", "der Schneemann ☃ sieht das Auto .")):
        with open(small / "c" / f"train.{lang}", "a", encoding="utf-8") as f:
            f.write((line + "\n") * 5)
    prepare_data(_config(small, f"bpe.model={given}"))
    splits = load_manifest(small / "out").splits
    assert (splits["train"].src_unk, splits["train"].tgt_unk) == (5, 5)
    assert (splits["valid"].src_unk, splits["valid"].tgt_unk) == (0, 0)
    assert "of them 5 / 5 <unk>: characters the BPE model never saw" in capsys.readouterr().err
    ds = ParallelDataset(small / "out", "train", "en", "de")
    assert UNK in ds.src_ids(len(ds) - 1).tolist()


def test_the_vocab_file_is_the_one_sentencepiece_writes(prepared_toy: Config, tmp_path: Path) -> None:
    """prepare_toy learned its model, so its spm.vocab is sentencepiece's own: the copy writes the same bytes."""
    data_dir = Path(prepared_toy.data.dir)
    write_vocab(load_bpe(data_dir / "spm.model"), tmp_path / "spm.vocab")
    assert (tmp_path / "spm.vocab").read_bytes() == (data_dir / "spm.vocab").read_bytes()


def test_another_model_re_prepares_and_ignored_keys_do_not(
    small: Path, given: Path, prepared_toy: Config, capsys: pytest.CaptureFixture
) -> None:
    prepare_data(_config(small, f"bpe.model={given}"))
    # ignored while bpe.model is set, and the path may change: neither makes the data stale
    assert is_prepared(_config(small, f"bpe.model={given}", "bpe.vocab_size=999", "bpe.seed=7"))
    moved = given.rename(given.with_name("moved.model"))
    assert is_prepared(_config(small, f"bpe.model={moved}"))
    # other bytes at the same path do; so does going back to a learned model
    other = _train_model(small / "other", vocab_size=150)
    shutil.copyfile(other, moved)
    cfg = _config(small, f"bpe.model={moved}")
    assert not is_prepared(cfg) and not is_prepared(_config(small))
    capsys.readouterr()
    prepare_data(cfg)
    assert "up to date" not in capsys.readouterr().err
    assert (small / "out" / "spm.model").read_bytes() == other.read_bytes()
    assert load_manifest(small / "out").vocab_size == 150 and is_prepared(cfg)


def test_without_bpe_model_the_hash_is_the_one_before_the_key_existed() -> None:
    """Data prepared before bpe.model existed stays up to date: no WMT-size corpus is prepared again for nothing."""
    cfg = load_config(None, ["data.workers=3"])
    assert prepare_hash(cfg) == "9bc5ee621393c2a7" + "481aea331a044b39"  # data, bpe: as that version computed them


def test_a_missing_model_names_the_file_and_the_fix(small: Path) -> None:
    with pytest.raises(BpeError, match=r"bpe\.model: .*nowhere\.model is not a file .*tmt export spm .*bpe\.model=''"):
        prepare_data(_config(small, f"bpe.model={small / 'nowhere.model'}"))
    assert not (small / "out" / MANIFEST).exists()


def test_a_file_that_is_no_sentencepiece_model_is_refused(small: Path) -> None:
    for name, content in (("notes.txt", b"not a model\n"), ("empty.model", b"")):
        (small / name).write_bytes(content)
        with pytest.raises(BpeError, match=rf"bpe\.model: .*{name} is not a sentencepiece model .*tmt export spm"):
            prepare_data(_config(small, f"bpe.model={small / name}"))


def test_a_checkpoint_given_as_the_model_says_to_export_it(small: Path) -> None:
    torch.save({"model": {}}, small / "avg.pt")
    ckpt = small / "avg.pt"
    with pytest.raises(BpeError, match=rf"{ckpt} is a checkpoint, .*tmt export spm -c {ckpt} -o spm\.model"):
        prepare_data(_config(small, f"bpe.model={ckpt}"))


def test_a_model_with_other_special_ids_is_refused(small: Path) -> None:
    """sentencepiece's default ids (unk 0, bos 1, eos 2, no pad) would train and decode wrongly without an error."""
    path = _train_model(small / "foreign", vocab_size=100, tmt_ids=False)
    with pytest.raises(BpeError, match=r"special ids pad=-1, unk=0, bos=1, eos=2, but tmt needs pad=0, unk=1"):
        prepare_data(_config(small, f"bpe.model={path}"))


def _train_model(prefix: Path, vocab_size: int, tmt_ids: bool = True) -> Path:
    """A small BPE model on the toy corpus under ``prefix``'s directory, with tmt's special ids or sentencepiece's."""
    text = prefix.parent / "c" / "train.en"
    ids = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3} if tmt_ids else {}
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe", minloglevel=2, **ids
    )
    return Path(f"{prefix}.model")
