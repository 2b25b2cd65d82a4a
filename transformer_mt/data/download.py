"""Fetch WMT14 en-de / en-fr as plain parallel text: train, newstest2013 (dev), newstest2014 (test).

Output (``--out DIR``), UTF-8, one sentence per line, line N of ``X.en`` aligned
with line N of ``X.de`` (or ``X.fr``)::

    train.{en,xx}  newstest2013.{en,xx}  newstest2014.{en,xx}
    .complete/<file>.json     marker per finished file: lines, bytes, sha256, source
    archives/                 (--source statmt only) the WMT archives, resumable

Sources:

- ``hf`` (default): the Hugging Face ``wmt/wmt14`` dataset, streamed so memory
  stays bounded however large the corpus.
- ``statmt``: the original WMT14 training archives from statmt.org, checked
  against their sha256, downloaded with HTTP Range resumption, extracted with
  path checks.
- ``--from DIR``: files already on disk, validated and copied.

newstest2013 and newstest2014 always come as sacreBLEU has them (``wmt13`` and
``wmt14/full``, the 3003-line newstest2014) unless ``--from DIR`` holds them,
so what the model is tested on is what ``tmt evaluate`` scores against.

Every output is written to a temporary file created exclusively under a
random name (`transformer_mt.files.atomic_open`), so a link planted in OUT can
never redirect a write, and renamed when complete; its marker, written the
same way, comes last, so a file without a marker is never taken as complete.

The statmt source lives in :mod:`transformer_mt.data.download_statmt`, which builds
on the writer and helpers here (and so is imported from here only when used).
"""

from __future__ import annotations

import codecs
import errno
import gzip
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from transformer_mt.evaluate import TESTSETS, EvaluateError, fetch_testset
from transformer_mt.files import atomic_open, atomic_write_text, remove_leftovers

PAIRS = {"en-de": ("en", "de"), "en-fr": ("en", "fr")}
SOURCES = ("hf", "statmt")
HF_HUB_PATH = "wmt/wmt14"
# The dev and test sets written next to train.*, by their names in `transformer_mt.evaluate.TESTSETS`
# (which maps each to its sacreBLEU set: newstest2014 is "wmt14/full", the 3003-line full set).
DOWNLOADED_TESTSETS = ("newstest2013", "newstest2014")
MARKER_DIR = ".complete"
_CHUNK = 1 << 20  # bytes per read/write when copying and downloading
_FLUSH_LINES = 10_000  # lines buffered before a write

# Characters that some reader would take as the end of a line (str.splitlines, universal
# newlines) or as a field separator: inside a sentence they would shift the alignment.
_BREAKS = re.compile("[\n\r\t\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


class DownloadError(RuntimeError):
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
# public entry point


def download_wmt14(
    pair: str, out: str | Path, source: str = "hf", from_dir: str | Path | None = None, train_from: str | None = None
) -> list[SummaryRow]:
    """Write OUT/train.*, OUT/newstest2013.*, OUT/newstest2014.* for ``pair``; skip what is complete.

    ``train_from`` (only with ``from_dir``) names a prefix in ``from_dir``, such as
    ``newstest2013``, to copy as a stand-in training corpus when ``from_dir`` has no
    ``train.*`` files: enough to try the pipeline, far too small to reproduce the paper.
    """
    langs = _check_pair(pair)
    if source not in SOURCES:
        raise DownloadError(f"unknown --source {source!r}; use one of: {', '.join(SOURCES)}")
    if train_from is not None and from_dir is None:
        raise DownloadError("--train-from only works with --from DIR (it names files inside DIR)")
    if train_from is not None:
        _check_prefix(train_from)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if from_dir is not None:
        rows = _train_from_dir(Path(from_dir), out, langs, train_from)
        missing = [name for name in DOWNLOADED_TESTSETS if not _has_pair(Path(from_dir), name, langs)]
        rows += _copy_dir_testsets(Path(from_dir), out, langs, [n for n in DOWNLOADED_TESTSETS if n not in missing])
        return rows + fetch_testsets(pair, out, names=missing)
    if source == "hf":
        rows = download_hf(pair, out)
    else:
        from transformer_mt.data.download_statmt import download_statmt  # imports this module: not at the top

        rows = download_statmt(pair, out)
    return rows + fetch_testsets(pair, out)


def format_summary(rows: list[SummaryRow], out: str | Path) -> str:
    """The table printed at the end: one row per source and file, pairs kept and dropped."""
    head = ("source", "file", "pairs", "dropped", "status")
    body = [(r.source, r.file, f"{r.pairs:,}", f"{r.dropped:,}", r.status) for r in rows]
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    right = {2, 3}  # numbers align right
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in (head, *body)
    ]
    return "\n".join([f"WMT14 files in {out}:", *(line.rstrip() for line in lines)])


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


# ---------------------------------------------------------------------------------------------
# Hugging Face


def download_hf(pair: str, out: Path, hub_path: str = HF_HUB_PATH) -> list[SummaryRow]:
    """Stream the ``train`` split of ``hub_path`` (config ``de-en`` / ``fr-en``) into OUT/train.*.

    ``hub_path`` is a Hub id or a local directory in the Hub layout (``de-en/train-*.parquet``).
    """
    langs = _check_pair(pair)
    config = f"{langs[1]}-{langs[0]}"
    label = f"hf {hub_path} {config} train"
    if is_complete(out, "train", langs, label):
        return [_skipped_row(out, "train", langs, label)]
    writer = ParallelWriter(out, "train", langs, label)
    with writer, tqdm(desc=f"{config} train", unit=" pairs", unit_scale=True) as bar:
        for sources, targets in _hf_batches(hub_path, config, "train", pair):
            for src, tgt in zip(sources, targets, strict=True):
                writer.add(src or "", tgt or "")
            bar.update(len(sources))
    return [writer.summary()]


def _hf_batches(hub_path: str, config: str, split: str, pair: str) -> Iterator[tuple[list[str], list[str]]]:
    """(English sentences, other-language sentences) in batches, read as Arrow: ~50x faster than row dicts."""
    import datasets

    langs = _check_pair(pair)
    try:
        stream = datasets.load_dataset(hub_path, config, split=split, streaming=True).with_format("arrow")
        for table in stream.iter(batch_size=10_000):
            yield _translation_columns(table, langs, f"{hub_path} ({config}, {split})")
    except (OSError, datasets.exceptions.DatasetNotFoundError) as err:
        raise DownloadError(f"could not stream {hub_path} ({config}, {split}): {err}\n{offline_hint(pair)}") from None


def _translation_columns(table: Any, langs: tuple[str, str], where: str) -> tuple[list[str], list[str]]:
    """The two languages of the ``translation`` struct column of an Arrow table, as Python lists."""
    if "translation" not in table.column_names:
        raise DownloadError(f"{where}: no 'translation' column (columns: {', '.join(table.column_names)})")
    column = table.column("translation").combine_chunks()
    names = [column.type.field(i).name for i in range(column.type.num_fields)]
    missing = [lang for lang in langs if lang not in names]
    if missing:
        raise DownloadError(f"{where}: the translation column has no {missing[0]!r} (languages: {', '.join(names)})")
    return column.field(langs[0]).to_pylist(), column.field(langs[1]).to_pylist()


# ---------------------------------------------------------------------------------------------
# aligned plain text (the statmt corpora and the test sets)


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
# dev and test sets (sacreBLEU)


def fetch_testsets(pair: str, out: Path, names: Iterable[str] = DOWNLOADED_TESTSETS) -> list[SummaryRow]:
    """Write OUT/newstest2013.* and OUT/newstest2014.* as sacreBLEU has them (downloaded into its cache)."""
    langs = _check_pair(pair)
    rows = []
    for name in names:
        label = f"sacrebleu {TESTSETS[name]}"
        if is_complete(out, name, langs, label):
            rows.append(_skipped_row(out, name, langs, label))
            continue
        try:
            src_path, ref_path = fetch_testset(name, *langs, offline_hint=offline_hint(pair))
        except EvaluateError as err:
            raise DownloadError(str(err)) from None
        writer = ParallelWriter(out, name, langs, label, keep_empty=True)
        with writer:
            for src, ref in read_parallel(src_path, ref_path):
                writer.add(src, ref)
        rows.append(writer.summary())
    return rows


def offline_hint(pair: str) -> str:
    """What to do without network: files on disk with --from, and where sacreBLEU keeps its cache."""
    src, tgt = _check_pair(pair)
    return (
        f"Without network: put aligned plain-text files in a directory DIR (train.{src}, train.{tgt}, "
        f"and newstest2013.{src}|{tgt}, newstest2014.{src}|{tgt} if you have them) and run "
        f"`tmt download wmt14 --pair {pair} --from DIR --out OUT`. Dev/test sets missing from DIR are read "
        "from sacreBLEU's cache: $SACREBLEU (default ~/.sacrebleu); copy its wmt13/ and wmt14/full/ folders "
        f"from a machine where `sacrebleu -t wmt14/full -l {pair} --echo src` ran."
    )


# ---------------------------------------------------------------------------------------------
# --from DIR


def _train_from_dir(from_dir: Path, out: Path, langs: tuple[str, str], train_from: str | None) -> list[SummaryRow]:
    if not from_dir.is_dir():
        raise DownloadError(f"--from {from_dir}: not a directory")
    prefix = train_from or "train"
    if prefix == "newstest2014":
        raise DownloadError("--train-from newstest2014 would train on the test set; use newstest2013")
    if not _has_pair(from_dir, prefix, langs):
        found = _describe_dir(from_dir, langs)
        fix = (
            "; to try the pipeline with newstest2013 as a stand-in training corpus, add --train-from newstest2013"
            if _has_pair(from_dir, "newstest2013", langs) and train_from is None
            else ""
        )
        raise DownloadError(f"--from {from_dir}: no {prefix}.{langs[0]} and {prefix}.{langs[1]}; found: {found}{fix}")
    label = f"from {from_dir.resolve() / prefix}" + (" (stand-in train)" if train_from else "")
    return [_copy_pair(from_dir, prefix, out, "train", langs, label)]


def _check_prefix(train_from: str) -> None:
    """``--train-from`` names files inside ``--from DIR`` (PREFIX.en, PREFIX.de): a path would read outside it."""
    if not train_from or train_from in (".", "..") or "/" in train_from or os.sep in train_from:
        raise DownloadError(
            f"--train-from {train_from!r}: give a file prefix inside --from DIR, such as newstest2013 "
            "(for DIR/newstest2013.en and .de), not a path; to train on files elsewhere, point --from at their directory"
        )


def _copy_dir_testsets(from_dir: Path, out: Path, langs: tuple[str, str], names: list[str]) -> list[SummaryRow]:
    return [_copy_pair(from_dir, name, out, name, langs, f"from {from_dir.resolve() / name}") for name in names]


def _copy_pair(from_dir: Path, prefix: str, out: Path, name: str, langs: tuple[str, str], label: str) -> SummaryRow:
    if is_complete(out, name, langs, label):
        return _skipped_row(out, name, langs, label)
    with _writing_pair(out, name, langs) as files:
        infos = [_copy_text(from_dir / f"{prefix}.{lang}", f) for lang, f in zip(langs, files, strict=True)]
        if infos[0]["lines"] != infos[1]["lines"]:
            raise DownloadError(
                f"--from {from_dir}: {prefix}.{langs[0]} has {infos[0]['lines']:,} lines but {prefix}.{langs[1]} has "
                f"{infos[1]['lines']:,}; parallel files must be aligned line by line (fix or remove the extra lines)"
            )
    _write_markers(out, name, langs, infos, label)
    return SummaryRow(label, f"{name}.{langs[0]}|{langs[1]}", infos[0]["lines"])


def _copy_text(src: Path, fout: _Output) -> dict[str, Any]:
    """Copy ``src`` into ``fout`` checking it is UTF-8; count lines, bytes, sha256 (adds a final newline if missing)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    digest, lines, size, last = hashlib.sha256(), 0, 0, b"\n"
    with (
        open(src, "rb") as fin,
        tqdm(total=src.stat().st_size, desc=src.name, unit="B", unit_scale=True, leave=False) as bar,
    ):
        while chunk := fin.read(_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                line = lines + chunk[: err.start].count(b"\n") + 1
                raise DownloadError(f"{src}:{line}: not UTF-8 ({err.reason}); convert the file with iconv") from None
            fout.write(chunk)
            digest.update(chunk)
            lines, size, last = lines + chunk.count(b"\n"), size + len(chunk), chunk[-1:]
            bar.update(len(chunk))
        if last != b"\n":
            fout.write(b"\n")
            digest.update(b"\n")
            lines, size = lines + 1, size + 1
    return {"lines": lines, "bytes": size, "sha256": digest.hexdigest()}


def _has_pair(directory: Path, prefix: str, langs: tuple[str, str]) -> bool:
    return all((directory / f"{prefix}.{lang}").is_file() for lang in langs)


def _describe_dir(directory: Path, langs: tuple[str, str]) -> str:
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    shown = [f"{n} ({_count_lines(directory / n):,} lines)" for n in files if n.rsplit(".", 1)[-1] in langs]
    return ", ".join(shown) or f"no *.{langs[0]} or *.{langs[1]} files ({len(files)} other files)"


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(_CHUNK), b""))


# ---------------------------------------------------------------------------------------------
# atomic parallel writing and completion markers


@dataclass
class ParallelWriter:
    """Writes OUT/{name}.{src,tgt} through temporary files (`_writing_pair`), renamed and marked complete on success.

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
    _files: list[_Output] = field(default_factory=list)
    _digests: list[Any] = field(default_factory=list)
    _sizes: list[int] = field(default_factory=lambda: [0, 0])
    _pair: Any = None  # the `_writing_pair` context, entered in __enter__

    def __enter__(self) -> ParallelWriter:
        self._pair = _writing_pair(self.out, self.name, self.langs)
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
        _write_markers(self.out, self.name, self.langs, infos, self.source, dropped=self.dropped)

    def summary(self) -> SummaryRow:
        return SummaryRow(self.source, f"{self.name}.{self.langs[0]}|{self.langs[1]}", self.pairs, self.dropped)


@contextmanager
def _writing_pair(out: Path, name: str, langs: tuple[str, str]) -> Iterator[list[_Output]]:
    """Two files open for OUT/{name}.{lang}: temporary until the body ends, then renamed into place together.

    The old files and markers go first (`_start_rewrite`), so while the pair is
    rewritten nothing of it looks complete. On any error both temporary files
    are removed.
    """
    _start_rewrite(out, name, langs)
    with ExitStack() as stack:
        yield [stack.enter_context(_writing(out / f"{name}.{lang}")) for lang in langs]


@contextmanager
def _writing(path: Path) -> Iterator[_Output]:
    """`atomic_open` for ``path``; its own OSErrors (creating, syncing, renaming) become DownloadErrors naming it."""
    in_body = False
    try:
        with atomic_open(path) as f:
            in_body = True
            yield _Output(f, path)
            in_body = False
    except OSError as err:
        if in_body:  # the body's own error (reading an input, say): not this file's to explain
            raise
        raise _disk_error(path, err) from None


@dataclass
class _Output:
    """A file being written and the name it will have: a failed write names that file and says what to do."""

    f: BinaryIO
    path: Path

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as err:
            raise _disk_error(self.path, err) from None


def _disk_error(path: Path, err: OSError) -> DownloadError:
    if err.errno == errno.ENOSPC:
        return DownloadError(
            f"disk full while writing {path}; nothing was kept. Free space or choose another --out "
            "(en-de needs about 1.3 GB of text, en-fr about 14 GB; --source statmt also keeps 1.7 / 6.6 GB of archives)"
        )
    return DownloadError(f"could not write {path}: {err.strerror or err}; check --out and its permissions")


def _marker_path(out: Path, name: str, lang: str) -> Path:
    return out / MARKER_DIR / f"{name}.{lang}.json"


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
        (out / f"{name}.{lang}").unlink(missing_ok=True)
    remove_leftovers(out, re.compile("|".join(re.escape(f"{name}.{lang}") for lang in langs)))


def _write_markers(
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
        text = json.dumps({"file": f"{name}.{lang}", **info, "dropped_empty": dropped, "source": source}, indent=1)
        try:
            atomic_write_text(marker, text + "\n")
        except OSError as err:
            raise _disk_error(marker, err) from None


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
        path = out / f"{name}.{lang}"
        if marker is None or marker.get("source") != source or not path.is_file():
            return False
        if path.stat().st_size != marker.get("bytes"):
            return False
    return True


def _skipped_row(out: Path, name: str, langs: tuple[str, str], source: str) -> SummaryRow:
    marker = read_marker(out, name, langs[0]) or {}
    return SummaryRow(
        source,
        f"{name}.{langs[0]}|{langs[1]}",
        marker.get("lines", 0),
        marker.get("dropped_empty", 0),
        "complete, skipped",
    )


def _check_pair(pair: str) -> tuple[str, str]:
    if pair not in PAIRS:
        raise DownloadError(f"unknown --pair {pair!r}; use one of: {', '.join(PAIRS)}")
    return PAIRS[pair]
