"""`tmt translate` of a file in windows of --window-lines lines: the same output for any window, bounded reading.

The bound is checked where it is defined: an instrumented input counts the
lines it has handed out and the output counts the lines written, and the
difference (the lines held) must never exceed the window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.decode import lines as lines_module
from transformer_mt.decode.lines import count_lines, translate_file, windows
from transformer_mt.decode.translate import TranslateError, Translator

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lines(prepared_toy: Config) -> list[str]:
    text = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:23]
    return text[:5] + ["", "   "] + text[5:]  # 25 lines, empty ones among them


@pytest.fixture
def src(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "in.en"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def tmt(*args: str) -> str:
    result = CliRunner().invoke(app, ["translate", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("flags", [[], ["--nbest", "2"]])
@pytest.mark.slow
def test_any_window_gives_the_same_file(toy_ckpt: Path, src: Path, tmp_path: Path, lines, flags) -> None:
    outputs = []
    for window in ("1", "7", "25", "100000"):
        out = tmp_path / f"out.{window}"
        tmt("-c", str(toy_ckpt), "-i", str(src), "-o", str(out), "--window-lines", window, "--beam", "2", *flags)
        outputs.append(out.read_bytes())
    if not flags:
        assert outputs[0] == outputs[1] == outputs[2] == outputs[3]
    else:  # the same rows; a score's 4th decimal may move with its batch's padding (as with --buffer-lines)
        rows = [[r.split("\t") for r in out.decode("utf-8").splitlines()] for out in outputs]
        for other in rows[1:]:
            assert [(r[0], r[2]) for r in other] == [(r[0], r[2]) for r in rows[0]]
            assert [float(r[1]) for r in other] == pytest.approx([float(r[1]) for r in rows[0]], abs=2e-4)
    translator = Translator.from_checkpoints([toy_ckpt], device="cpu", overrides=["decode.beam_size=2"])
    translator.show_progress = False
    if not flags:  # the file equals the whole input translated in one call, as before windows
        assert outputs[0].decode("utf-8") == "".join(t + "\n" for t in translator.translate_lines(lines))
    else:
        rows = outputs[0].decode("utf-8").splitlines()
        assert [r.split("\t")[0] for r in rows] == [str(i // 2) for i in range(50)]


def test_stdout_equals_the_output_file(toy_ckpt: Path, src: Path, tmp_path: Path) -> None:
    tmt("-c", str(toy_ckpt), "-i", str(src), "-o", str(tmp_path / "o"), "--window-lines", "4")
    assert tmt("-c", str(toy_ckpt), "-i", str(src), "--window-lines", "3") == (tmp_path / "o").read_text("utf-8")


@pytest.mark.parametrize("window", [1, 4, 10])
def test_lines_held_never_exceed_the_window(toy_ckpt: Path, lines, window, monkeypatch: pytest.MonkeyPatch) -> None:
    read = written = 0
    held: list[int] = []
    written_when_last_read: list[int] = []

    def counted_input(_: object) -> Iterator[str]:
        nonlocal read
        for i, line in enumerate(lines):
            read += 1
            held.append(read - written)
            if i == len(lines) - 1:
                written_when_last_read.append(written)
            yield line

    def counted_output(out: list[str]) -> None:
        nonlocal written
        written += len(out)

    monkeypatch.setattr(lines_module, "input_lines", counted_input)
    monkeypatch.setattr(lines_module, "write_stdout", counted_output)
    translate_file([toy_ckpt], input=None, device="cpu", window_lines=window)
    assert written == len(lines) == read
    assert max(held) == window  # a full window is held, never more
    assert written_when_last_read == [(len(lines) - 1) // window * window]  # earlier windows were out already


def test_windows_reads_no_line_past_the_window() -> None:
    pulled = []

    def source() -> Iterator[str]:
        for i in range(10):
            pulled.append(i)
            yield str(i)

    chunks = windows(source(), None, 4)
    assert next(chunks) == (["0", "1", "2", "3"], None) and pulled == [0, 1, 2, 3]
    assert next(chunks) == (["4", "5", "6", "7"], None) and pulled == list(range(8))


def test_a_bad_line_late_in_the_input_leaves_no_output_file(toy_ckpt: Path, tmp_path: Path, lines) -> None:
    bad = tmp_path / "bad.en"
    bad.write_bytes("".join(line + "\n" for line in lines).encode() + b"caf\xe9\n")
    out = tmp_path / "out.de"
    result = CliRunner().invoke(app, ["translate", "-c", str(toy_ckpt), "-i", str(bad), "-o", str(out),
                                      "--window-lines", "5"])  # fmt: skip
    assert result.exit_code == 2 and "line 26: not valid UTF-8" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.en"]  # no output, no temporary file


def test_window_lines_must_be_positive(toy_ckpt: Path, src: Path) -> None:
    result = CliRunner().invoke(app, ["translate", "-c", str(toy_ckpt), "-i", str(src), "--window-lines", "0"])
    assert result.exit_code == 2 and "--window-lines must be at least 1, got 0" in result.output


def test_prefix_counts_of_files_are_checked_before_the_model_loads(
    toy_ckpt: Path, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pre = tmp_path / "pre.de"
    pre.write_text("a\nb\n", encoding="utf-8")
    monkeypatch.setattr(lines_module, "load_translator", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(TranslateError, match=r"pre.de: 2 lines, but the input .*in.en has 25"):
        translate_file([toy_ckpt], input=src, prefix_file=pre)


@pytest.mark.parametrize("data, expected", [(b"", 0), (b"a", 1), (b"a\n", 1), (b"a\nb", 2), (b"\n\n", 2)])
def test_count_lines_counts_as_the_reader_splits(tmp_path: Path, data: bytes, expected: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(data)
    assert count_lines(path) == expected == sum(1 for _ in lines_module.input_lines(path))
