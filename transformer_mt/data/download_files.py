"""What ``tmt download`` writes into OUT: aligned pairs, whole or not at all, and the markers that say so.

Both sources (:mod:`transformer_mt.data.download` and
:mod:`transformer_mt.data.download_statmt`) write through `ParallelWriter`:
each pair of files goes through `transformer_mt.files.atomic_open`
(exclusive random temporary names, never through a planted link) and is
renamed into place when complete; its completion markers,
``OUT/.complete/<file>.json`` (lines, bytes, sha256, source), are written the
same way and last, so a file without a marker is never taken as complete.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from transformer_mt.data.raw_files import raw_file
from transformer_mt.errors import UserError
from transformer_mt.files import atomic_open, atomic_write_text, remove_leftovers

PAIRS = {"en-de": ("en", "de"), "en-fr": ("en", "fr")}
MARKER_DIR = ".complete"
CHUNK = 1 << 20  # bytes per read/write when copying and downloading
_FLUSH_LINES = 10_000  # lines buffered before a write

# Characters that some reader would take as the end of a line (str.splitlines, universal
# newlines) or as a field separator: inside a sentence they would shift the alignment.
_BREAKS = re.compile("[\n\r\t\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


class DownloadError(UserError):
    """A problem the user can fix (network, disk, input files); the message says how."""


@dataclass
class SummaryRow:
    """One line of the final table: where a file's pairs came from and how many were kept."""

    source: str
    file: str
    pairs: int
    dropped: int = 0  # pairs with an empty side
    status: str = "written"


# ---------------------------------------------------------------------------------------------
# language pairs and aligned text


def check_pair(pair: str) -> tuple[str, str]:
    """The two languages of ``--pair`` (English first), or a DownloadError listing the known pairs."""
    if pair not in PAIRS:
        raise DownloadError(f"unknown --pair {pair!r}; use one of: {', '.join(PAIRS)}")
    return PAIRS[pair]


def offline_hint(pair: str) -> str:
    """What to do without network: files on disk with --from, and where sacreBLEU keeps its cache."""
    src, tgt = check_pair(pair)
    return (
        f"Without network: put aligned plain-text files in a directory DIR (train.{src}, train.{tgt}, "
        f"and newstest2013.{src}|{tgt}, newstest2014.{src}|{tgt} if you have them) and run "
        f"`tmt download wmt14 --pair {pair} --from DIR --out OUT`. Dev/test sets missing from DIR are read "
        "from sacreBLEU's cache: $SACREBLEU (default ~/.sacrebleu); copy its wmt13/ and wmt14/full/ folders "
        f"from a machine where `sacrebleu -t wmt14/full -l {pair} --echo src` ran."
    )


def clean_pair(src: str, tgt: str) -> tuple[str, str] | None:
    """One aligned pair as two single lines, or None when a side is empty.

    Line breaks and tabs inside a sentence become spaces (otherwise one sentence
    would become two lines and shift every later pair); outer whitespace is stripped.
    """
    src, tgt = _one_line(src), _one_line(tgt)
    if not src or not tgt:
        return None
    return src, tgt


def _one_line(text: str) -> str:
    return _BREAKS.sub(" ", text).strip() if _BREAKS.search(text) else text.strip()


def read_parallel(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    """Yield aligned (source, target) lines; the two files must have the same number of lines.

    Lines are split on ``\\n`` only, as the corpora were aligned; bytes that are not
    UTF-8 become U+FFFD rather than stopping a multi-gigabyte run.
    """
    with _open_text_bytes(src_path) as fs, _open_text_bytes(tgt_path) as ft:
        for number, (s, t) in enumerate(itertools.zip_longest(fs, ft), start=1):
            if s is None or t is None:
                longer = tgt_path if s is None else src_path
                raise DownloadError(
                    f"{src_path} and {tgt_path} are not aligned: {longer} has more lines after line {number - 1}"
                )
            yield s.decode("utf-8", "replace"), t.decode("utf-8", "replace")


def _open_text_bytes(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# the writer and the markers


@dataclass
class ParallelWriter:
    """Writes OUT/{name}.{src,tgt} through temporary files (`writing_pair`), renamed and marked complete on success.

    ``keep_empty`` keeps pairs with an empty side (dev/test sets must keep their
    line count); otherwise such pairs are dropped and counted.
    """

    out: Path
    name: str
    langs: tuple[str, str]
    source: str
    keep_empty: bool = False
    pairs: int = 0
    dropped: int = 0
    _buffers: tuple[list[str], list[str]] = field(default_factory=lambda: ([], []))
    _files: list[Output] = field(default_factory=list)
    _digests: list[Any] = field(default_factory=list)
    _sizes: list[int] = field(default_factory=lambda: [0, 0])
    _pair: Any = None  # the `writing_pair` context, entered in __enter__

    def __enter__(self) -> ParallelWriter:
        self._pair = writing_pair(self.out, self.name, self.langs)
        self._files = self._pair.__enter__()
        self._digests = [hashlib.sha256(), hashlib.sha256()]
        return self

    def add(self, src: str, tgt: str) -> None:
        cleaned = clean_pair(src, tgt)
        if cleaned is None and not self.keep_empty:
            self.dropped += 1
            return
        src, tgt = cleaned or (_one_line(src), _one_line(tgt))
        self._buffers[0].append(src)
        self._buffers[1].append(tgt)
        self.pairs += 1
        if len(self._buffers[0]) >= _FLUSH_LINES:
            self._flush()

    def _flush(self) -> None:
        for i in range(2):
            if not self._buffers[i]:
                continue
            data = ("\n".join(self._buffers[i]) + "\n").encode("utf-8")
            self._files[i].write(data)
            self._digests[i].update(data)
            self._sizes[i] += len(data)
            self._buffers[i].clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """On success: flush, rename both files into place, write the markers; on any error: remove both."""
        if exc_type is None:
            try:
                self._flush()
            except BaseException as err:
                self._pair.__exit__(type(err), err, err.__traceback__)
                raise
        self._pair.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        infos = [
            {"lines": self.pairs, "bytes": size, "sha256": digest.hexdigest()}
            for size, digest in zip(self._sizes, self._digests, strict=True)
        ]
        write_markers(self.out, self.name, self.langs, infos, self.source, dropped=self.dropped)

    def summary(self) -> SummaryRow:
        return SummaryRow(self.source, f"{self.name}.{self.langs[0]}|{self.langs[1]}", self.pairs, self.dropped)


@contextmanager
def writing_pair(out: Path, name: str, langs: tuple[str, str]) -> Iterator[list[Output]]:
    """Two files open for OUT/{name}.{lang}: temporary until the body ends, then renamed into place together.

    The old files and markers go first (`_start_rewrite`), so while the pair is
    rewritten nothing of it looks complete. On any error both temporary files
    are removed.
    """
    _start_rewrite(out, name, langs)
    with ExitStack() as stack:
        yield [stack.enter_context(_writing(raw_file(out / name, lang))) for lang in langs]


@contextmanager
def _writing(path: Path) -> Iterator[Output]:
    """`atomic_open` for ``path``; its own OSErrors (creating, syncing, renaming) become DownloadErrors naming it."""
    in_body = False
    try:
        with atomic_open(path) as f:
            in_body = True
            yield Output(f, path)
            in_body = False
    except OSError as err:
        if in_body:  # the body's own error (reading an input, say): not this file's to explain
            raise
        raise disk_error(path, err) from None


@dataclass
class Output:
    """A file being written and the name it will have: a failed write names that file and says what to do."""

    f: BinaryIO
    path: Path

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as err:
            raise disk_error(self.path, err) from None


def disk_error(path: Path, err: OSError) -> DownloadError:
    if err.errno == errno.ENOSPC:
        return DownloadError(
            f"disk full while writing {path}; nothing was kept. Free space or choose another --out "
            "(en-de needs about 1.3 GB of text, en-fr about 14 GB; --source statmt also keeps 1.7 / 6.6 GB of archives)"
        )
    return DownloadError(f"could not write {path}: {err.strerror or err}; check --out and its permissions")


def _marker_path(out: Path, name: str, lang: str) -> Path:
    return out / MARKER_DIR / f"{raw_file(name, lang)}.json"


def _start_rewrite(out: Path, name: str, langs: tuple[str, str]) -> None:
    """Remove the markers, then the old files and any temporary files a killed run left for them.

    While a pair is rewritten, nothing of it looks complete. Two downloads into
    one OUT at once are not supported: this would remove the other's
    temporary files.
    """
    out.mkdir(parents=True, exist_ok=True)
    for lang in langs:
        _marker_path(out, name, lang).unlink(missing_ok=True)
    for lang in langs:
        raw_file(out / name, lang).unlink(missing_ok=True)
    remove_leftovers(out, re.compile("|".join(re.escape(str(raw_file(name, lang))) for lang in langs)))


def write_markers(
    out: Path, name: str, langs: tuple[str, str], infos: list[dict[str, Any]], source: str, dropped: int = 0
) -> None:
    """Write the pair's completion markers (atomically, never through a planted link): they mean complete."""
    if (out / MARKER_DIR).is_symlink():
        raise DownloadError(
            f"{out / MARKER_DIR} is a symbolic link; tmt never writes through one: remove it and re-run"
        )
    (out / MARKER_DIR).mkdir(exist_ok=True)
    for lang, info in zip(langs, infos, strict=True):
        marker = _marker_path(out, name, lang)
        text = json.dumps(
            {"file": str(raw_file(name, lang)), **info, "dropped_empty": dropped, "source": source}, indent=1
        )
        try:
            atomic_write_text(marker, text + "\n")
        except OSError as err:
            raise disk_error(marker, err) from None


def read_marker(out: Path, name: str, lang: str) -> dict[str, Any] | None:
    """The completion marker of OUT/{name}.{lang}, or None when the file is not known to be complete."""
    try:
        return json.loads(_marker_path(out, name, lang).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_complete(out: Path, name: str, langs: tuple[str, str], source: str) -> bool:
    """Both files exist with the size their markers recorded, written from ``source``."""
    for lang in langs:
        marker = read_marker(out, name, lang)
        path = raw_file(out / name, lang)
        if marker is None or marker.get("source") != source or not path.is_file():
            return False
        if path.stat().st_size != marker.get("bytes"):
            return False
    return True


def skipped_row(out: Path, name: str, langs: tuple[str, str], source: str) -> SummaryRow:
    marker = read_marker(out, name, langs[0]) or {}
    return SummaryRow(
        source,
        f"{name}.{langs[0]}|{langs[1]}",
        marker.get("lines", 0),
        marker.get("dropped_empty", 0),
        "complete, skipped",
    )
