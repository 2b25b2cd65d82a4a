"""Progress on stderr: tqdm's bar at a terminal, plain lines without carriage returns in a file (a log, CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from transformer_mt import progress as progress_module
from transformer_mt.config import Config
from transformer_mt.data.synthetic import write_corpus
from transformer_mt.progress import LineProgress, progress


def _tmt_logged(log: Path, *args: str, cwd: Path | None = None) -> str:
    """``tmt ARGS`` in a new process with stderr to the file ``log`` (no terminal), as `tmt ... 2> log` runs it."""
    with open(log, "w", encoding="utf-8") as stderr:
        done = subprocess.run([sys.executable, "-m", "transformer_mt", *args], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=stderr, cwd=cwd, timeout=300)  # fmt: skip
    text = log.read_text(encoding="utf-8")
    assert done.returncode == 0, text
    return text


def test_prepare_writes_its_progress_as_plain_lines_to_a_file(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", pairs=300, valid=20, test=20, seed=1)
    (tmp_path / "c.yaml").write_text(
        "base: null\ndata: {train: corpus/train, valid: corpus/valid, test: corpus/test, dir: out, workers: 1}\n"
        "bpe: {vocab_size: 150}\n",
        encoding="utf-8",
    )
    text = _tmt_logged(tmp_path / "log", "prepare", "c.yaml", cwd=tmp_path)
    assert "\r" not in text
    lines = text.splitlines()
    for split, pairs in (("train", 300), ("valid", 20), ("test", 20)):
        assert any(line.startswith(f"clean {split}: 100% {pairs}/{pairs} [") for line in lines), text
        assert any(line.startswith(f"encode {split}: 100% {pairs}/{pairs} [") for line in lines), text
    assert any(line.startswith("prepared ") for line in lines)


@pytest.mark.slow
def test_translate_writes_its_progress_as_plain_lines_to_a_file(toy_ckpt: Path, prepared_toy: Config, tmp_path: Path):
    """2000 lines: more than the half second a translation runs before it shows progress, on any CPU."""
    source = Path(f"{prepared_toy.data.train}.en")
    out = tmp_path / "out.de"
    text = _tmt_logged(tmp_path / "log", "translate", "-c", str(toy_ckpt), "-i", str(source), "-o", str(out),
                       "--threads", "1")  # fmt: skip
    assert "\r" not in text
    assert text.splitlines()[-1].startswith("translate: 2000sent ["), text
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2000


def test_lines_come_every_line_seconds_and_at_the_end(monkeypatch, capsys) -> None:
    monkeypatch.setattr(progress_module, "LINE_SECONDS", 0.0)
    with progress(total=3, desc="count", unit="pairs") as bar:
        assert isinstance(bar, LineProgress)  # capsys's stderr is no terminal
        bar.update(1)
        bar.update(2)
    err = capsys.readouterr().err
    assert [line.split(" [")[0] for line in err.splitlines()] == [
        "count:  33% 1/3", "count: 100% 3/3", "count: 100% 3/3"
    ]  # fmt: skip
    assert list(progress(iter("ab"), desc="read")) == ["a", "b"]
    assert capsys.readouterr().err.splitlines()[-1].startswith("read: 2it [")


def test_no_line_before_the_delay_nor_after_an_error_nor_when_disabled(capsys) -> None:
    with progress(total=10, desc="translate", delay=60.0) as bar:
        bar.update(10)
    with pytest.raises(ValueError), progress(total=10, desc="clean") as bar:
        bar.update(5)
        raise ValueError("bad line")  # its error message is the last word, not a progress line
    with progress(total=10, desc="hash", disable=None) as bar:  # tqdm's "only at a terminal"
        bar.update(10)
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_tqdms_bar(monkeypatch) -> None:
    leader, follower = os.openpty()
    with open(follower, "w", encoding="utf-8") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        bar = progress(total=2, desc="translate")
        assert isinstance(bar, tqdm)
        bar.close()
    os.close(leader)
