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

Every output goes through `transformer_mt.data.download_files.ParallelWriter`
(or its `writing_pair`): written whole under an exclusive random temporary
name, never through a planted link, then marked complete. The statmt source
lives in :mod:`transformer_mt.data.download_statmt`; the test-set table in
:mod:`transformer_mt.data.testsets`.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from transformer_mt.data.download_files import (
    CHUNK,
    DownloadError,
    Output,
    ParallelWriter,
    SummaryRow,
    check_pair,
    is_complete,
    offline_hint,
    read_parallel,
    skipped_row,
    write_markers,
    writing_pair,
)
from transformer_mt.data.download_statmt import download_statmt
from transformer_mt.data.raw_files import raw_file
from transformer_mt.data.testsets import TESTSETS, fetch_testset
from transformer_mt.progress import progress

SOURCES = ("hf", "statmt")
HF_HUB_PATH = "wmt/wmt14"
# The dev and test sets written next to train.*, by their names in `transformer_mt.data.testsets.TESTSETS`
# (which maps each to its sacreBLEU set: newstest2014 is "wmt14/full", the 3003-line full set).
DOWNLOADED_TESTSETS = ("newstest2013", "newstest2014")


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
    langs = check_pair(pair)
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
    rows = download_hf(pair, out) if source == "hf" else download_statmt(pair, out)
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


# ---------------------------------------------------------------------------------------------
# Hugging Face


def download_hf(pair: str, out: Path, hub_path: str = HF_HUB_PATH) -> list[SummaryRow]:
    """Stream the ``train`` split of ``hub_path`` (config ``de-en`` / ``fr-en``) into OUT/train.*.

    ``hub_path`` is a Hub id or a local directory in the Hub layout (``de-en/train-*.parquet``).
    """
    langs = check_pair(pair)
    config = f"{langs[1]}-{langs[0]}"
    label = f"hf {hub_path} {config} train"
    if is_complete(out, "train", langs, label):
        return [skipped_row(out, "train", langs, label)]
    writer = ParallelWriter(out, "train", langs, label)
    with writer, progress(desc=f"{config} train", unit=" pairs", unit_scale=True) as bar:
        for sources, targets in _hf_batches(hub_path, config, "train", pair):
            for src, tgt in zip(sources, targets, strict=True):
                writer.add(src or "", tgt or "")
            bar.update(len(sources))
    return [writer.summary()]


def _hf_batches(hub_path: str, config: str, split: str, pair: str) -> Iterator[tuple[list[str], list[str]]]:
    """(English sentences, other-language sentences) in batches, read as Arrow: ~50x faster than row dicts."""
    import datasets

    langs = check_pair(pair)
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
# dev and test sets (sacreBLEU)


def fetch_testsets(pair: str, out: Path, names: Iterable[str] = DOWNLOADED_TESTSETS) -> list[SummaryRow]:
    """Write OUT/newstest2013.* and OUT/newstest2014.* as sacreBLEU has them (downloaded into its cache)."""
    langs = check_pair(pair)
    rows = []
    for name in names:
        label = f"sacrebleu {TESTSETS[name]}"
        if is_complete(out, name, langs, label):
            rows.append(skipped_row(out, name, langs, label))
            continue
        src_path, ref_path = fetch_testset(name, *langs, offline_hint=offline_hint(pair))
        writer = ParallelWriter(out, name, langs, label, keep_empty=True)
        with writer:
            for src, ref in read_parallel(src_path, ref_path):
                writer.add(src, ref)
        rows.append(writer.summary())
    return rows


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
        return skipped_row(out, name, langs, label)
    with writing_pair(out, name, langs) as files:
        infos = [_copy_text(raw_file(from_dir / prefix, lang), f) for lang, f in zip(langs, files, strict=True)]
        if infos[0]["lines"] != infos[1]["lines"]:
            raise DownloadError(
                f"--from {from_dir}: {prefix}.{langs[0]} has {infos[0]['lines']:,} lines but {prefix}.{langs[1]} has "
                f"{infos[1]['lines']:,}; parallel files must be aligned line by line (fix or remove the extra lines)"
            )
    write_markers(out, name, langs, infos, label)
    return SummaryRow(label, f"{name}.{langs[0]}|{langs[1]}", infos[0]["lines"])


def _copy_text(src: Path, fout: Output) -> dict[str, Any]:
    """Copy ``src`` into ``fout`` checking it is UTF-8; count lines, bytes, sha256 (adds a final newline if missing)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    digest, lines, size, last = hashlib.sha256(), 0, 0, b"\n"
    with (
        open(src, "rb") as fin,
        progress(total=src.stat().st_size, desc=src.name, unit="B", unit_scale=True, leave=False) as bar,
    ):
        while chunk := fin.read(CHUNK):
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
    return all(raw_file(directory / prefix, lang).is_file() for lang in langs)


def _describe_dir(directory: Path, langs: tuple[str, str]) -> str:
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    shown = [f"{n} ({_count_lines(directory / n):,} lines)" for n in files if n.rsplit(".", 1)[-1] in langs]
    return ", ".join(shown) or f"no *.{langs[0]} or *.{langs[1]} files ({len(files)} other files)"


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(CHUNK), b""))
