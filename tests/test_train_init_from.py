"""train.init_from: a new run from another checkpoint's weights, with its own optimizer, schedule and position;
on another corpus, prepared with the checkpoint's BPE model (`tmt export spm`, bpe.model)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from helpers import load_state, metric_records, run_config, save_state
from typer.testing import CliRunner

from transformer_mt.checkpoint import CheckpointError, read_checkpoint
from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.prepare import load_manifest
from transformer_mt.data.synthetic import write_corpus
from transformer_mt.run_names import checkpoint_name
from transformer_mt.train.init_from import shape_mismatch
from transformer_mt.train.schedule import Schedule
from transformer_mt.train.step import TrainError
from transformer_mt.train.trainer import train_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(cfg: Config, save_dir: Path, **train: object) -> Config:
    return run_config(cfg, save_dir, **{"validate_every": 100, "log_every": 1, **train})


@pytest.fixture(scope="module")
def parent(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of a 4-update run from other random weights (seed 2): what fine-tuning starts from."""
    run = tmp_path_factory.mktemp("parent") / "run"
    train_model(_cfg(prepared_toy, run, max_updates=4, seed=2))
    return run / checkpoint_name(4)


def test_a_new_run_starts_from_the_weights_with_a_fresh_optimizer_and_schedule(
    prepared_toy: Config, parent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "tuned"
    result = train_model(_cfg(prepared_toy, run, max_updates=2, init_from=str(parent), save_every_updates=1))
    assert result.update == 2
    assert f"fine-tuning: weights from {parent} (update 4 of its run)" in capsys.readouterr().err
    # the first update moved the parent's weights by one step of the new run (Adam's first step is about lr per
    # weight), where a run from random weights would be far away
    start, first = load_state(parent)["model"], load_state(run / checkpoint_name(1))
    lr = Schedule.from_config(prepared_toy.train, prepared_toy.model.d_model).lr(1, 0.0)
    weight = "decoder.0.ffn.fc1.weight"
    assert 0 < float((first["model"][weight] - start[weight]).abs().max()) <= 1.01 * lr
    # a fresh optimizer: Adam has taken 2 steps after two updates (the parent's took 4), and the schedule is at 1
    newest = load_state(run / checkpoint_name(2))  # older checkpoints keep no optimizer state
    assert {int(s["step"]) for s in newest["optimizer"]["state"].values()} == {2}
    assert first["update"] == 1 and first["epoch"] == 1
    records = metric_records(run)
    lrs = [r["lr"] for r in records if r.get("kind") == "train"]
    assert lrs == pytest.approx([lr, Schedule.from_config(prepared_toy.train, prepared_toy.model.d_model).lr(2, 0.0)])
    assert first["config"]["train"]["init_from"] == str(parent)


def test_a_resumed_run_keeps_its_own_weights_and_says_so(
    prepared_toy: Config, parent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "tuned"
    train_model(_cfg(prepared_toy, run, max_updates=1, init_from=str(parent)))
    own = load_state(run / checkpoint_name(1))["model"]
    capsys.readouterr()
    result = train_model(_cfg(prepared_toy, run, max_updates=2, init_from=str(parent), save_every_updates=1))
    err = capsys.readouterr().err
    assert result.update == 2 and "resuming from" in err and "fine-tuning: weights" not in err
    assert f"note: train.init_from={parent} is ignored" in err and "resumes from them (update 1)" in err
    second = load_state(run / checkpoint_name(2))
    assert {int(s["step"]) for s in second["optimizer"]["state"].values()} == {2}  # continued, not restarted
    assert any(not torch.equal(own[k], second["model"][k]) for k in own)


def test_another_vocabulary_is_refused_naming_both_files(prepared_toy: Config, parent: Path, tmp_path: Path) -> None:
    state = load_state(parent)
    state["spm_model"] = state["spm_model"][:-1]
    save_state(tmp_path / "other_bpe.pt", state)
    spm = Path(prepared_toy.data.dir) / "spm.model"
    with pytest.raises(
        TrainError, match=rf"other_bpe\.pt was trained with another BPE vocabulary than {re.escape(str(spm))}"
    ):
        train_model(_cfg(prepared_toy, tmp_path / "run", max_updates=1, init_from=str(tmp_path / "other_bpe.pt")))
    assert not (tmp_path / "run" / checkpoint_name(1)).exists()


def test_another_model_shape_is_refused_naming_the_keys(prepared_toy: Config, parent: Path, tmp_path: Path) -> None:
    wider = dataclasses.replace(prepared_toy, model=dataclasses.replace(prepared_toy.model, d_ff=128, dropout=0.3))
    with pytest.raises(TrainError, match=r"another shape than this config's \(model\.d_ff 64 there, 128 here\)"):
        train_model(_cfg(wider, tmp_path / "run", max_updates=1, init_from=str(parent)))
    more_dropout = dataclasses.replace(prepared_toy, model=dataclasses.replace(prepared_toy.model, dropout=0.3))
    assert train_model(_cfg(more_dropout, tmp_path / "ok", max_updates=1, init_from=str(parent))).update == 1
    with pytest.raises(TrainError, match=r"missing\.pt does not exist; .*train\.init_from=''"):
        train_model(_cfg(prepared_toy, tmp_path / "run2", max_updates=1, init_from=str(tmp_path / "missing.pt")))


def test_a_damaged_checkpoint_keeps_its_own_error_naming_the_file(prepared_toy: Config, tmp_path: Path) -> None:
    """Checkpoint errors reach the command line as they are raised (a UserError), not re-wrapped as TrainError."""
    crafted = tmp_path / "crafted.pt"
    crafted.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"crafted\.pt: not a readable checkpoint"):
        train_model(_cfg(prepared_toy, tmp_path / "run", max_updates=1, init_from=str(crafted)))
    assert not (tmp_path / "run" / checkpoint_name(1)).exists()


def test_shape_mismatch_names_missing_extra_and_reshaped_weights() -> None:
    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "extra": torch.zeros(1)}
    b = {"w": torch.zeros(3, 3), "b": torch.zeros(3), "norm": torch.zeros(3)}
    assert shape_mismatch(a, b) == "norm missing; extra unexpected; w (2, 3) instead of (3, 3)"
    assert shape_mismatch(b, b) == ""


# ---------------------------------------------------------------- another corpus: bpe.model


def _on_corpus(cfg: Config, corpus: Path, data_dir: Path, bpe_model: str) -> Config:
    """``cfg`` reading ``corpus/{train,valid,test}`` into ``data_dir``, with ``bpe.model``."""
    data = dataclasses.replace(
        cfg.data, train=str(corpus / "train"), valid=str(corpus / "valid"), test=str(corpus / "test"),
        dir=str(data_dir), synth=False,
    )  # fmt: skip
    return dataclasses.replace(cfg, data=data, bpe=dataclasses.replace(cfg.bpe, model=bpe_model))


def test_fine_tuning_on_another_corpus_with_the_checkpoints_bpe_model(
    prepared_toy: Config, parent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Domain adaptation as a user does it: export the parent's BPE model, prepare the new corpus with it, fine-tune.

    The new corpus (another seed, 300 pairs) would learn another BPE model of
    its own: without bpe.model the same run stops at the vocabulary check.
    """
    write_corpus(tmp_path / "new", pairs=300, valid=20, test=20, seed=9)
    spm = tmp_path / "parent_spm.model"
    exported = CliRunner().invoke(app, ["export", "spm", "-c", str(parent), "-o", str(spm)])
    assert exported.exit_code == 0, exported.output
    parent_spm = read_checkpoint(parent).spm_model
    assert spm.read_bytes() == parent_spm

    cfg = _on_corpus(prepared_toy, tmp_path / "new", tmp_path / "prepared", str(spm))
    result = train_model(_cfg(cfg, tmp_path / "tuned", max_updates=2, init_from=str(parent)))
    assert result.update == 2
    assert f"fine-tuning: weights from {parent} (update 4 of its run)" in capsys.readouterr().err
    tuned = read_checkpoint(tmp_path / "tuned" / checkpoint_name(2))
    assert tuned.spm_model == parent_spm == (tmp_path / "prepared" / "spm.model").read_bytes()
    assert tuned.config.bpe.model == str(spm) and tuned.config.data.train == str(tmp_path / "new/train")
    # the new corpus, in the parent's vocabulary of 300 pieces, is what was trained on
    train = ParallelDataset(tmp_path / "prepared", "train", "en", "de")
    first = (tmp_path / "new" / "train.en").read_text(encoding="utf-8").splitlines()[0]
    assert len(train) == 300 and load_bpe(spm).decode(train.src_ids(0).tolist()) == first
    assert load_manifest(tmp_path / "prepared").vocab_size == 300

    learned = _on_corpus(prepared_toy, tmp_path / "new", tmp_path / "learned", "")
    with pytest.raises(TrainError, match=r"another BPE vocabulary .*tmt export spm -c .* --set bpe\.model=spm\.model"):
        train_model(_cfg(learned, tmp_path / "run", max_updates=1, init_from=str(parent)))
    assert (tmp_path / "learned" / "spm.model").read_bytes() != parent_spm


def test_export_spm_keeps_an_equal_file_and_refuses_another_without_force(parent: Path, tmp_path: Path) -> None:
    out, runner = tmp_path / "spm.model", CliRunner()
    out.write_bytes(b"another model")
    refused = runner.invoke(app, ["export", "spm", "-c", str(parent), "-o", str(out)])
    assert refused.exit_code == 2 and "holds another sentencepiece model" in refused.output
    assert out.read_bytes() == b"another model"
    assert runner.invoke(app, ["export", "spm", "-c", str(parent), "-o", str(out), "--force"]).exit_code == 0
    written = out.stat().st_mtime_ns
    again = runner.invoke(app, ["export", "spm", "-c", str(parent), "-o", str(out)])
    assert again.exit_code == 0 and out.read_bytes() == read_checkpoint(parent).spm_model
    assert out.stat().st_mtime_ns == written  # the same model: the file is left as it is
    two = runner.invoke(app, ["export", "spm", "-c", str(parent), "-c", str(parent), "-o", str(out)])
    assert two.exit_code == 2 and "takes one -c (got 2)" in two.output
    unknown = runner.invoke(app, ["export", "onnx", "-c", str(parent), "-o", str(out)])
    assert unknown.exit_code == 2 and "known: ctranslate2, hf, spm" in unknown.output


def test_an_encoder_that_gives_one_output_everywhere_is_a_warning_at_validation(
    prepared_toy: Config, parent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model whose encoder ignores its source (its last LayerNorm made a constant, as a too-high learning rate
    leaves it) is named at validation, with the fix; the parent, which reads its source, is not."""
    from transformer_mt.model.transformer import Transformer
    from transformer_mt.train.validation import COLLAPSED, encoder_spread

    state = load_state(parent)
    model = Transformer(prepared_toy.model, state["model"]["embed.weight"].shape[0])
    model.load_state_dict(state["model"])
    valid = ParallelDataset(prepared_toy.data.dir, "valid", prepared_toy.data.src_lang, prepared_toy.data.tgt_lang)
    assert encoder_spread(model, valid, torch.device("cpu"), 256) > 100 * COLLAPSED
    with torch.no_grad():
        last = model.encoder_norm or model.encoder[-1].norm2  # the encoder's last LayerNorm (pre- or post-norm)
        last.weight.zero_()
        last.bias.normal_()
    assert encoder_spread(model, valid, torch.device("cpu"), 256) < COLLAPSED
    collapsed = tmp_path / "collapsed.pt"
    save_state(collapsed, {**state, "model": model.state_dict()})
    for start, warned in ((parent, False), (collapsed, True)):
        train_model(_cfg(prepared_toy, tmp_path / start.stem, max_updates=1, init_from=str(start), lr=1e-9))
        err = capsys.readouterr().err
        assert ("the encoder gives the same output at every source position" in err) is warned, err
        assert ("start again with a lower train.lr" in err) is warned
        reasons = [r["reason"] for r in metric_records(tmp_path / start.stem) if r["kind"] == "warning"]
        assert ("collapsed_encoder" in reasons) is warned, reasons
