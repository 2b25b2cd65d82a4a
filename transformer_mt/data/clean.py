"""Normalization and the length filters applied before BPE.

`normalize` is applied to every sentence that enters the pipeline: the
training text, the validation/test text and (at translation time) raw user
input, so that BPE sees the same characters everywhere.
"""

from __future__ import annotations

import contextlib
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from transformer_mt.errors import UserError

# Control characters (Unicode category Cc) that are not whitespace, and invisible format characters
# (zero-width spaces and joiners, word joiner, byte order mark, soft hyphen) that only break tokens apart.
DROPPED = re.compile("[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\u200b-\u200d\u2060\ufeff\u00ad]")

# Filter reasons, in the order they are tested, as reported by `tmt prepare`.
EMPTY = "empty side"
TOO_LONG = "longer than data.max_len"
RATIO = "length ratio above data.max_ratio"


def normalize(text: str) -> str:
    """Unicode NFC, control and invisible characters removed, whitespace runs collapsed to one space.

    Whitespace controls (tab, vertical tab, form feed, U+0085 ...) and other
    Unicode spaces (no-break space, U+2028 ...) count as whitespace, so words
    joined only by a tab stay apart.
    """
    text = unicodedata.normalize("NFC", text)
    return " ".join(DROPPED.sub("", text).split())


def filter_reason(src: str, tgt: str, max_len: int, max_ratio: float) -> str | None:
    """Why a normalized training pair is dropped, or None to keep it.

    Lengths are whitespace tokens. The ratio test is Moses clean-corpus-n's:
    drop when either side is more than ``max_ratio`` times longer than the other.
    """
    n_src, n_tgt = src.count(" ") + 1 if src else 0, tgt.count(" ") + 1 if tgt else 0
    if n_src == 0 or n_tgt == 0:
        return EMPTY
    if n_src > max_len or n_tgt > max_len:
        return TOO_LONG
    if n_src > max_ratio * n_tgt or n_tgt > max_ratio * n_src:
        return RATIO
    return None


class InputError(UserError):
    """An input file that cannot be read as UTF-8 text; the message names file and line."""


MAX_LINE_BYTES = 1 << 20  # one line of text, its end excluded: far past any sentence, yet a bound on memory


def read_lines(path: str | Path, stream: BinaryIO | None = None) -> Iterator[str]:
    """Yield the lines of ``path`` (or of the byte ``stream``, called ``path`` in errors), decoded as strict UTF-8.

    Lines end at b"\\n" only, never at the Unicode separators (U+2028,
    U+0085, \\x1c-\\x1e ...) that ``str.splitlines`` also splits on; the line
    end, CRLF included, is stripped. Decoding line by line gives the 1-based
    line number of a bad byte, which a whole-file decoder cannot. A line is
    read at most `MAX_LINE_BYTES` at a time: a file with no line ends (a
    binary file, /dev/zero) is refused at that length instead of filling memory.
    """
    with open(path, "rb") if stream is None else contextlib.nullcontext(stream) as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 2):  # room for the line's own b"\r\n"
            number += 1
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise InputError(
                    f"{path}, line {number}: longer than {MAX_LINE_BYTES >> 20} MiB, past any sentence; give a "
                    "text file of one sentence per line (is it a binary file, or one without line ends?)"
                )
            yield _decode(raw, path, number).rstrip("\r\n")


def _decode(raw: bytes, path: str | Path, number: int) -> str:
    """``raw`` as strict UTF-8; a bad byte is an InputError naming the file, line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{path}, line {number}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
            "convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove the line "
            "(from both sides of a parallel corpus)"
        ) from None
