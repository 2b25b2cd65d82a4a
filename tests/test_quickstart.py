"""The quickstart chains every stage; a shortened run checks the chain and the report."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.quickstart import quickstart_config

SHORT = [
    "data.synth_pairs=1500",
    "bpe.vocab_size=300",
    "bpe.sample_sentences=5000",
    "model.d_model=32",
    "model.d_ff=64",
    "model.heads=2",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "train.max_tokens=1024",
    "train.max_updates=12",
    "train.validate_every=6",
    "train.save_every_updates=4",
    "train.average_last=2",
    "train.warmup=4",
    "decode.max_len_b=5",
]


def test_paths_move_under_the_workdir(tmp_path):
    cfg = quickstart_config(tmp_path / "qs")
    assert cfg.data.train == str(tmp_path / "qs" / "corpus" / "train")
    assert cfg.data.dir == str(tmp_path / "qs" / "prepared")
    assert cfg.train.save_dir == str(tmp_path / "qs" / "run")
    assert cfg.data.synth


def test_the_toy_config_is_shipped_so_any_directory_will_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the quickstart reads tmt:toy.yaml from the package
    assert quickstart_config(tmp_path / "qs").model.d_model == 128


@pytest.mark.slow
def test_short_quickstart_runs_every_stage_and_reports(tmp_path):
    workdir = tmp_path / "qs"
    args = ["quickstart", "--workdir", str(workdir)]
    for override in SHORT:
        args += ["--set", override]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = workdir / "run"
    assert (run / "average.pt").is_file()
    scores = json.loads((run / "eval_test" / "scores.json").read_text())
    assert scores["sentences"] == 1000
    hyps = (run / "eval_test" / "hyp.de").read_text(encoding="utf-8").split("\n")
    assert len(hyps) == 1000 + 1  # one line per test sentence, then the final newline
    assert "the paper's tokenized BLEU" in result.output
    assert "source     " in result.output and "reference  " in result.output
    assert str(run / "average.pt") in result.output
