"""Ctrl-C is told apart from a failure: a checkpoint write it cuts short is an interrupt (exit 130, one line
naming the update and the newest checkpoint), never "check free disk space", and leaves no temporary file."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from transformer_mt.checkpoint import Checkpoint, write_checkpoint
from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.errors import Interrupted
from transformer_mt.train.trainer import train_model


class _CtrlCMidWrite:
    """A file that receives SIGINT at its second write, as a Ctrl-C typed while torch.save streams a checkpoint."""

    def __init__(self, f: object) -> None:
        self.f, self.writes = f, 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes == 2:
            signal.raise_signal(signal.SIGINT)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@pytest.fixture
def ctrl_c_at_save(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch.save cut by SIGINT at its Nth call (N = the number the test appends); Python's own SIGINT handler in
    place, as at a terminal (a test run in the background may have inherited SIGINT ignored)."""
    real, calls, at = torch.save, [], []

    def save(obj: object, f: object) -> None:
        calls.append(1)
        real(obj, _CtrlCMidWrite(f) if len(calls) in at else f)

    monkeypatch.setattr(torch, "save", save)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield at
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_checkpoint_write_is_an_interrupt_and_leaves_nothing(tmp_path, ctrl_c_at_save) -> None:
    ctrl_c_at_save.append(1)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "checkpoint_u0000001.pt", Checkpoint({"w": torch.zeros(1000)}, Config(), b"spm"))
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_training_saves_names_the_update_and_the_newest_checkpoint(
    prepared_toy: Config, tmp_path: Path, ctrl_c_at_save: list[int]
) -> None:
    ctrl_c_at_save.append(2)  # the save at update 4: the one at update 2 is whole
    run = tmp_path / "run"
    train = dataclasses.replace(
        prepared_toy.train, save_dir=str(run), max_updates=6, save_every_updates=2, validate_every=100, num_threads=1
    )
    with pytest.raises(Interrupted) as err:
        train_model(dataclasses.replace(prepared_toy, train=train))
    assert str(err.value) == (
        f"interrupted at update 4; the newest checkpoint is {run / 'checkpoint_u0000002.pt'}: the same tmt train "
        "command resumes from it"
    )
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert "disk" not in str(err.value)


def test_ctrl_c_names_the_checkpoint_resuming_would_use_not_a_newer_unreadable_one(
    prepared_toy: Config, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    run = tmp_path / "run"
    train = dataclasses.replace(
        prepared_toy.train, save_dir=str(run), max_updates=2, save_every_updates=2, validate_every=100, num_threads=1
    )
    train_model(dataclasses.replace(prepared_toy, train=train))
    (run / "checkpoint_u0000100.pt").write_bytes(b"PK\x03\x04 cut short")  # skipped as unreadable on resume
    request.getfixturevalue("ctrl_c_at_save").append(1)  # the save at update 4
    with pytest.raises(Interrupted) as err:
        train_model(dataclasses.replace(prepared_toy, train=dataclasses.replace(train, max_updates=6)))
    assert f"the newest checkpoint is {run / 'checkpoint_u0000002.pt'}: the same tmt train" in str(err.value)


@pytest.mark.parametrize(
    "raised, line",
    [
        (Interrupted("interrupted at update 4; the newest checkpoint is run/checkpoint_u0000002.pt"), "update 4"),
        (KeyboardInterrupt(), "interrupted"),
    ],
)
def test_the_command_line_exits_130_with_one_line(raised, line, monkeypatch, tmp_path) -> None:
    def score(*args: object, **kwargs: object) -> None:
        raise raised

    monkeypatch.setattr("transformer_mt.metrics.score_files", score)
    hyp = tmp_path / "h.txt"
    hyp.write_text("a\n")
    result = CliRunner().invoke(app, ["score", "--hyp", str(hyp), "--ref", str(hyp)])
    assert result.exit_code == 130 and isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and line in lines[0] and "error" not in lines[0] and "Traceback" not in result.output
