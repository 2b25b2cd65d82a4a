"""The data commands end to end through the command line: synth -> prepare -> data-stats."""

from __future__ import annotations

from typer.testing import CliRunner

from transformer_mt.cli import app


def test_synth_prepare_stats(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["synth", "--out", "corpus", "--pairs", "400", "--valid", "20", "--test", "20"])
    assert result.exit_code == 0, result.output
    assert "corpus/train.en|de: 400 pairs" in result.output
    (tmp_path / "c.yaml").write_text(
        "base: null\n"
        "data: {train: corpus/train, valid: corpus/valid, test: corpus/test, dir: out, workers: 1}\n"
        "bpe: {vocab_size: 150}\n"
        "train: {max_tokens: 256}\n",
        encoding="utf-8",
    )
    result = runner.invoke(app, ["prepare", "c.yaml"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "manifest.json").is_file()
    result = runner.invoke(app, ["prepare", "c.yaml", "--set", "data.valid=corpus/nothing"])
    assert result.exit_code == 2
    assert "missing input file corpus/nothing.en" in result.output
    result = runner.invoke(app, ["data-stats", "c.yaml"])
    assert result.exit_code == 0, result.output
    assert "train: 400 pairs" in result.output and "max_tokens=256" in result.output
