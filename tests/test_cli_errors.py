"""A user's mistake ends every command the same way: `error: <message>` on one line of stderr, exit 2, no traceback.

The commands run as a user runs them, in a process of their own, so that
what reaches the terminal is checked whole; a bug keeps its traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from transformer_mt import attention_maps, checkpoint, config, evaluate, export, plots, runs
from transformer_mt.cli import app
from transformer_mt.data import bpe, clean, download_files, prepare, testsets
from transformer_mt.decode import ctranslate2_engine, translate
from transformer_mt.errors import UserError
from transformer_mt.model import quantize
from transformer_mt.train import average, step


def tmt(*args: str, cwd: Path | None = None, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """``tmt ARGS`` in a new process: what a user sees."""
    return subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args],
        cwd=cwd,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, and stderr ends with one line `error: ...` holding every fragment (after any progress); returns it."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], done.stderr
    for fragment in fragments:
        assert fragment in lines[-1]
    return lines[-1]


@pytest.mark.parametrize(
    "error",
    [
        config.ConfigError, prepare.PrepareError, step.TrainError, average.AverageError, evaluate.EvaluateError,
        translate.TranslateError, checkpoint.CheckpointError, download_files.DownloadError, clean.InputError,
        bpe.BpeError, testsets.TestsetError, runs.RunError, export.ExportError, quantize.QuantizeError,
        plots.PlotError, attention_maps.AttentionError, ctranslate2_engine.CTranslate2Error,
    ],
)  # fmt: skip
def test_every_stage_error_is_a_user_error(error: type[Exception]) -> None:
    assert issubclass(error, UserError)


def test_a_config_mistake_is_one_line_and_exit_2(tmp_path: Path) -> None:
    assert_user_error(tmt("prepare", str(tmp_path / "missing.yaml")), "missing.yaml")


def test_quickstart_reports_a_stage_error_without_a_traceback(tmp_path: Path) -> None:
    """A corpus the quickstart did not write (here, not UTF-8) stops `prepare`, inside the quickstart."""
    corpus = tmp_path / "qs" / "corpus"
    corpus.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.en").write_bytes(b"one\ntwo\n")
        (corpus / f"{split}.de").write_bytes(b"eins\nzwei\n")
    (corpus / "train.en").write_bytes(b"one\ncaf\xe9\n")
    done = tmt("quickstart", "--workdir", str(tmp_path / "qs"))
    assert_user_error(done, "train.en, line 2: not valid UTF-8")


def test_a_bug_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("transformer_mt.evaluate.score_files", broken)
    hyp = tmp_path / "h.txt"
    hyp.write_text("a\n")
    result = CliRunner().invoke(app, ["score", "--hyp", str(hyp), "--ref", str(hyp)])
    assert isinstance(result.exception, ZeroDivisionError)
    assert result.exit_code == 1
