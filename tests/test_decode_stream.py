"""Interactive translation: each line translated and printed as soon as it is read, through a real pipe and a tty.

The subprocess tests read the translation of a line before they send the
next one, with a timeout: a `tmt translate` that waited for the end of its
input (or for a full buffer) would never answer, and the test would fail
instead of hanging.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.decode.stream import READY, stream_lines
from transformer_mt.decode.translate import TranslateError, Translator

pytestmark = pytest.mark.usefixtures("one_thread")

FIRST_ANSWER_S = 120.0  # the child imports torch and loads the model before its first answer
ANSWER_S = 30.0


@pytest.fixture(scope="module")
def lines(prepared_toy: Config) -> list[str]:
    """Test sentences with empty and blank lines among them: every one must come back, in order."""
    text = Path(f"{prepared_toy.data.test}.{prepared_toy.data.src_lang}").read_text(encoding="utf-8").splitlines()
    return [text[0], "", text[1], text[2], "   ", text[3], ""]


@pytest.fixture(scope="module")
def expected(toy_ckpt: Path, lines: list[str]) -> list[str]:
    t = Translator.from_checkpoints([toy_ckpt], device="cpu", overrides=["decode.beam_size=2"])
    t.show_progress = False
    out = t.translate_lines(lines)
    assert len(set(out)) > 3  # the outputs differ, so a line out of order would be noticed
    return out


def line_reader(stream: IO[bytes]) -> queue.Queue[bytes]:
    """The lines of ``stream`` as a thread reads them, so that the test can wait for one with a timeout."""
    lines: queue.Queue[bytes] = queue.Queue()

    def read() -> None:
        for line in iter(stream.readline, b""):
            lines.put(line)
        lines.put(b"")  # end of output

    threading.Thread(target=read, daemon=True).start()
    return lines


def translate_command(ckpt: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "transformer_mt", "translate", "-c", str(ckpt), "--beam", "2", "--device", "cpu",
            *flags]  # fmt: skip


def child_env() -> dict[str, str]:
    """The child's stdout stays block-buffered (no PYTHONUNBUFFERED): tmt must flush each answer itself."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_buffer_lines_1_answers_each_line_before_the_next_is_sent(
    toy_ckpt: Path, lines: list[str], expected: list[str], tmp_path: Path
) -> None:
    with (tmp_path / "stderr").open("wb") as err:
        child = subprocess.Popen(
            translate_command(toy_ckpt, "--buffer-lines", "1"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=err, env=child_env(),
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        answers = line_reader(child.stdout)
        try:
            for i, line in enumerate(lines):
                child.stdin.write(line.encode("utf-8") + b"\n")
                child.stdin.flush()  # the pipe stays open: only a streaming translator can answer now
                answer = answers.get(timeout=FIRST_ANSWER_S if i == 0 else ANSWER_S)
                assert answer.decode("utf-8") == expected[i] + "\n", f"line {i}"
            child.stdin.close()
            assert answers.get(timeout=ANSWER_S) == b""  # nothing more than one line per line
            assert child.wait(timeout=ANSWER_S) == 0, (tmp_path / "stderr").read_text()
        finally:
            child.kill()
            child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal as stdin")
@pytest.mark.slow
def test_a_terminal_gets_each_line_translated_as_it_is_typed(
    toy_ckpt: Path, lines: list[str], expected: list[str], tmp_path: Path
) -> None:
    import pty

    typist, terminal = pty.openpty()  # the child's stdin is a tty: no flag needed
    with (tmp_path / "stderr").open("wb") as err:
        child = subprocess.Popen(
            translate_command(toy_ckpt), stdin=terminal, stdout=subprocess.PIPE, stderr=err, env=child_env()
        )
        os.close(terminal)
        assert child.stdout is not None
        answers = line_reader(child.stdout)
        try:
            for i, line in enumerate(lines[:3]):
                os.write(typist, line.encode("utf-8") + b"\n")
                assert answers.get(timeout=FIRST_ANSWER_S if i == 0 else ANSWER_S) == (expected[i] + "\n").encode()
            os.write(typist, b"\x04")  # Ctrl-D at the start of a line: end of input
            assert answers.get(timeout=ANSWER_S) == b""
            assert child.wait(timeout=ANSWER_S) == 0, (tmp_path / "stderr").read_text()
        finally:
            child.kill()
            child.wait()
            os.close(typist)
    assert (tmp_path / "stderr").read_text().count(READY) == 1  # a person at the terminal is told when to type


def test_buffered_groups_keep_every_line_in_order(toy_ckpt: Path, lines: list[str], expected: list[str]) -> None:
    text = "".join(line + "\n" for line in lines).encode()
    for n in ("1", "2", "3", "100"):
        result = CliRunner().invoke(
            app, ["translate", "-c", str(toy_ckpt), "--beam", "2", "--buffer-lines", n], input=text
        )
        assert result.exit_code == 0, result.output
        assert result.stdout == "".join(line + "\n" for line in expected), n


def test_nbest_rows_are_numbered_from_the_first_line_of_the_input(toy_ckpt: Path, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines).encode()
    args = ["translate", "-c", str(toy_ckpt), "--beam", "2", "--nbest", "2"]
    streamed = CliRunner().invoke(app, [*args, "--buffer-lines", "2"], input=text)
    whole = CliRunner().invoke(app, args, input=text)
    assert streamed.exit_code == whole.exit_code == 0, streamed.output + whole.output
    rows, whole_rows = ([r.split("\t") for r in out.stdout.splitlines()] for out in (streamed, whole))
    assert [r[0] for r in rows] == [str(i // 2) for i in range(14)]  # line numbers of the input, not of a group
    assert [(r[0], r[2]) for r in rows] == [(r[0], r[2]) for r in whole_rows]
    assert [float(r[1]) for r in rows] == pytest.approx([float(r[1]) for r in whole_rows], abs=2e-4)  # padding


def test_when_lines_stream_and_when_the_input_is_read_whole() -> None:
    assert stream_lines(None, None, None, stdin_is_terminal=True) == 1  # a person typing
    assert stream_lines(None, None, None, stdin_is_terminal=False) is None  # a pipe: sorted batches
    assert stream_lines(None, "in.en", None, stdin_is_terminal=True) is None  # a file
    assert stream_lines(None, None, "out.de", stdin_is_terminal=True) is None  # -o is written whole
    assert stream_lines(8, None, None, stdin_is_terminal=False) == 8
    assert stream_lines(8, "in.en", None, stdin_is_terminal=False) == 8
    with pytest.raises(TranslateError, match="--buffer-lines must be at least 1"):
        stream_lines(0, None, None, stdin_is_terminal=False)
    with pytest.raises(TranslateError, match="drop --output"):
        stream_lines(1, None, "out.de", stdin_is_terminal=False)


def test_cli_refuses_buffer_lines_with_output(toy_ckpt: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["translate", "-c", str(toy_ckpt), "--buffer-lines", "1", "-o", str(tmp_path / "out")], input=b"a\n"
    )
    assert result.exit_code == 2 and "drop --output" in result.output
    assert not (tmp_path / "out").exists()
