"""Normalization and the training-pair filters."""

from __future__ import annotations

import pytest

from transformer_mt.data.clean import EMPTY, RATIO, TOO_LONG, InputError, filter_reason, normalize, read_lines


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  two  spaces\tand tab ", "two spaces and tab"),
        ("Cafe\u0301", "Caf\u00e9"),  # NFC composes e + combining acute
        ("no\u00a0break\u2028line", "no break line"),
        ("bell\x07 nul\x00 del\x7f c1\x9b", "bell nul del c1"),
        ("zero\u200bwidth\ufeff soft\u00adhyphen", "zerowidth softhyphen"),
        ("a\x0bb\x0cc\x85d\x1fe", "a b c d e"),  # whitespace controls separate words
        ("", ""),
        (" \t ", ""),
    ],
)
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_normalize_is_idempotent():
    text = "  Ein  Mädchen\u00a0sieht\tden Hund\u200b. "
    assert normalize(normalize(text)) == normalize(text)


@pytest.mark.parametrize(
    ("src", "tgt", "reason"),
    [
        ("", "Hallo", EMPTY),
        ("hello", "", EMPTY),
        ("a " * 10 + "b", "x " * 10 + "y", TOO_LONG),  # 11 tokens > max_len 10
        ("one two three four", "eins", RATIO),  # 4 > 1.5 * 1
        ("eins", "one two", RATIO),  # 2 > 1.5 * 1
        ("one two three", "eins zwei", None),  # 3 <= 1.5 * 2
        ("a " * 9 + "b", "x " * 9 + "y", None),  # exactly max_len
    ],
)
def test_filter_reason(src, tgt, reason):
    assert filter_reason(src, tgt, max_len=10, max_ratio=1.5) == reason


def test_read_lines_names_file_and_line_of_bad_utf8(tmp_path):
    path = tmp_path / "bad.en"
    path.write_bytes(b"fine\nalso fine\ncaf\xe9 latin-1\n")
    lines = read_lines(path)
    assert next(lines) == "fine"
    assert next(lines) == "also fine"
    with pytest.raises(InputError, match=r"bad\.en, line 3: not valid UTF-8.*iconv"):
        next(lines)


def test_read_lines_strips_crlf(tmp_path):
    path = tmp_path / "crlf.en"
    path.write_bytes(b"a\r\nb")
    assert list(read_lines(path)) == ["a", "b"]


def test_read_lines_bounds_a_line_and_names_it(tmp_path):
    """A file without line ends (/dev/zero, a binary file) is refused at MAX_LINE_BYTES, not read into memory."""
    from transformer_mt.data.clean import MAX_LINE_BYTES

    path = tmp_path / "long.en"
    path.write_bytes(b"ok\n" + b"x" * MAX_LINE_BYTES + b"\r\n" + b"y" * (MAX_LINE_BYTES + 1) + b"\n")
    lines = read_lines(path)
    assert next(lines) == "ok" and len(next(lines)) == MAX_LINE_BYTES
    with pytest.raises(InputError, match=r"long\.en, line 3: longer than 1 MiB"):
        next(lines)
