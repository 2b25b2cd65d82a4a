"""The statmt.org source of ``tmt download wmt14 --source statmt``: the WMT14 training archives.

Each archive in ``STATMT_CORPORA`` is downloaded into ``OUT/archives/`` with HTTP
Range resumption (``fetch_archive``), checked against its size and sha256, and
extracted with path checks (``safe_extract``); ``download_statmt`` concatenates the
aligned members into OUT/train.* through the writer of
:mod:`transformer_mt.data.download_files`, as every source does.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from transformer_mt.data.download_files import (
    CHUNK,
    DownloadError,
    ParallelWriter,
    SummaryRow,
    check_pair,
    disk_error,
    is_complete,
    offline_hint,
    read_parallel,
    skipped_row,
)
from transformer_mt.files import atomic_open
from transformer_mt.progress import progress


@dataclass(frozen=True)
class Corpus:
    """One WMT training archive and the two aligned members it holds per language pair."""

    name: str
    url: str
    sha256: str | None  # None: only the size is checked
    size: int  # bytes
    members: dict[str, tuple[str, str]]  # pair -> (English member, other-language member); ".gz" is gunzipped


# URLs, sizes and sha256 from tensorflow/datasets, tensorflow_datasets/url_checksums/
# wmt14_translate.txt (europarl, commoncrawl, nc-v9) and wmt15_translate.txt (un, giga-fren).
# Member paths as in the archives (the same ones fairseq's prepare-wmt14en2{de,fr}.sh reads).
STATMT_CORPORA: tuple[Corpus, ...] = (
    Corpus(
        "europarl-v7",
        "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
        "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
        657_632_379,
        {
            "en-de": ("training/europarl-v7.de-en.en", "training/europarl-v7.de-en.de"),
            "en-fr": ("training/europarl-v7.fr-en.en", "training/europarl-v7.fr-en.fr"),
        },
    ),
    Corpus(
        "commoncrawl",
        "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
        "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
        918_311_367,
        {
            "en-de": ("commoncrawl.de-en.en", "commoncrawl.de-en.de"),
            "en-fr": ("commoncrawl.fr-en.en", "commoncrawl.fr-en.fr"),
        },
    ),
    Corpus(
        "news-commentary-v9",
        "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
        "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485",
        80_418_416,
        {
            "en-de": ("training/news-commentary-v9.de-en.en", "training/news-commentary-v9.de-en.de"),
            "en-fr": ("training/news-commentary-v9.fr-en.en", "training/news-commentary-v9.fr-en.fr"),
        },
    ),
    Corpus(
        "un",
        "http://www.statmt.org/wmt13/training-parallel-un.tgz",
        "29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47",
        2_365_634_246,
        {"en-fr": ("un/undoc.2000.fr-en.en", "un/undoc.2000.fr-en.fr")},
    ),
    Corpus(
        "giga-fren",
        "http://www.statmt.org/wmt10/training-giga-fren.tar",
        "3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a",
        2_595_102_720,
        {"en-fr": ("giga-fren.release2.fixed.en.gz", "giga-fren.release2.fixed.fr.gz")},
    ),
)

EXTRACT_PREFIX = ".extract-"  # OUT/archives/.extract-<random>/: the members of the archives, while they are read
Opener = Callable[..., Any]  # urllib.request.urlopen(request, timeout=...) or a stand-in with .status/.read


def download_statmt(
    pair: str,
    out: Path,
    corpora: Iterable[Corpus] = STATMT_CORPORA,
    opener: Opener = urllib.request.urlopen,
) -> list[SummaryRow]:
    """Download, verify and extract the WMT14 archives for ``pair``; concatenate them into OUT/train.*."""
    langs = check_pair(pair)
    corpora = [c for c in corpora if pair in c.members]
    label = "statmt " + "+".join(c.name for c in corpora)
    if is_complete(out, "train", langs, label):
        return [skipped_row(out, "train", langs, label)]
    archive_dir = out / "archives"
    archives = [fetch_archive(c, archive_dir, opener, pair) for c in corpora]
    extract_dir = _extract_dir(archive_dir)
    rows = []
    writer = ParallelWriter(out, "train", langs, label)
    try:
        with writer:
            for corpus, archive in zip(corpora, archives, strict=True):
                paths = safe_extract(archive, corpus.members[pair], extract_dir / corpus.name)
                before = (writer.pairs, writer.dropped)
                for src, tgt in read_parallel(*paths):
                    writer.add(src, tgt)
                shutil.rmtree(extract_dir / corpus.name, ignore_errors=True)  # the extracted text is large
                pairs, dropped = writer.pairs - before[0], writer.dropped - before[1]
                rows.append(SummaryRow(f"statmt {corpus.name}", f"train.{langs[0]}|{langs[1]}", pairs, dropped, "part"))
    finally:
        shutil.rmtree(extract_dir, ignore_errors=True)
    return [*rows, writer.summary()]


def _extract_dir(archive_dir: Path) -> Path:
    """A new private directory for the extracted members, under a random name nobody could have planted a link at.

    Those a killed run left behind (``.extract-*``, gigabytes of text) are removed first.
    """
    for old in archive_dir.glob(f"{EXTRACT_PREFIX}*"):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=EXTRACT_PREFIX, dir=archive_dir))


def fetch_archive(corpus: Corpus, dest_dir: Path, opener: Opener = urllib.request.urlopen, pair: str = "en-de") -> Path:
    """Download ``corpus.url`` into ``dest_dir``, resuming a ``.part`` file; verified before it is used."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / PurePosixPath(corpus.url).name
    part = final.with_name(final.name + ".part")
    if part.is_symlink():
        raise DownloadError(f"{part} is a symbolic link; tmt never writes through one: remove it and re-run")
    if final.exists():
        if _archive_ok(final, corpus):
            return final
        final.unlink()  # corrupt or replaced on disk: fetch again
    start = part.stat().st_size if part.exists() else 0
    if start > corpus.size:
        part.unlink()
        start = 0
    if start < corpus.size:
        _fetch_bytes(corpus, part, start, opener, pair)
    got = part.stat().st_size
    if got < corpus.size:
        raise DownloadError(
            f"{corpus.url}: download stopped at {got:,} of {corpus.size:,} bytes; "
            f"the partial file {part} is kept: re-run the same command to resume"
        )
    actual = _sha256(part) if corpus.sha256 is not None else None
    if got != corpus.size or actual != corpus.sha256:
        part.unlink()
        raise DownloadError(
            f"{part}: checksum mismatch for {corpus.url} (expected {corpus.size:,} bytes with sha256 "
            f"{corpus.sha256}, got {got:,} bytes with sha256 {actual}); "
            "the corrupt file was removed: re-run to download it again (if it fails again, the file on the "
            "server changed; use --source hf or --from DIR)"
        )
    os.replace(part, final)
    return final


def _fetch_bytes(corpus: Corpus, part: Path, start: int, opener: Opener, pair: str) -> None:
    headers = {"Range": f"bytes={start}-"} if start else {}
    request = urllib.request.Request(corpus.url, headers=headers)
    try:
        response = opener(request, timeout=60)
    except urllib.error.HTTPError as err:
        raise DownloadError(f"{corpus.url}: HTTP {err.code} {err.reason}; try --source hf or --from DIR") from None
    except OSError as err:  # URLError, timeouts, refused connections
        raise DownloadError(f"could not reach {corpus.url}: {err}\n{offline_hint(pair)}") from None
    with response:
        if start and getattr(response, "status", 200) != 206:
            start = 0  # the server ignored Range: start over
        bar = progress(total=corpus.size, initial=start, desc=corpus.name, unit="B", unit_scale=True, unit_divisor=1024)
        try:
            with _open_part(part, append=bool(start)) as f, bar:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    bar.update(len(chunk))
        except (OSError, http.client.HTTPException) as err:  # IncompleteRead is an HTTPException
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                raise DownloadError(
                    f"disk full while writing {part}; free space (or choose another --out) and re-run to resume"
                ) from None
            raise DownloadError(
                f"{corpus.url}: connection lost ({err}); the partial file {part} is kept: re-run to resume"
            ) from None


def _open_part(part: Path, append: bool) -> BinaryIO:
    """The ``.part`` file, appended to or started anew; ``O_NOFOLLOW``: a link planted there fails (ELOOP)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | getattr(os, "O_NOFOLLOW", 0)
    return open(os.open(part, flags, 0o666), "ab" if append else "wb")


def _archive_ok(path: Path, corpus: Corpus) -> bool:
    if path.stat().st_size != corpus.size:
        return False
    return corpus.sha256 is None or _sha256(path) == corpus.sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        progress(total=path.stat().st_size, desc=f"sha256 {path.name}", unit="B", unit_scale=True, leave=False) as bar,
    ):
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def safe_extract(archive: Path, members: Iterable[str], dest: Path) -> list[Path]:
    """Extract the named regular-file ``members`` of a tar archive into ``dest`` in one streaming pass.

    Every member of the archive is checked, not only the wanted ones: an absolute
    path, a ``..`` component, or a link pointing outside the archive means the
    archive is not what it claims to be, and nothing from it is used.
    """
    wanted = {name: dest / PurePosixPath(name).name for name in members}
    dest.mkdir(parents=True, exist_ok=True)
    found: set[str] = set()
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for member in tar:
                _check_member(member, archive)
                if member.name in wanted:
                    if not member.isfile():
                        raise DownloadError(f"{archive}: member {member.name} is not a regular file")
                    _copy_stream(tar.extractfile(member), wanted[member.name])
                    found.add(member.name)
    except OSError as err:
        shutil.rmtree(dest, ignore_errors=True)
        if err.errno == errno.ENOSPC:
            raise disk_error(dest, err) from None
        raise DownloadError(f"{archive}: could not extract ({err}); delete it and re-run") from None
    except (tarfile.TarError, EOFError) as err:
        shutil.rmtree(dest, ignore_errors=True)
        raise DownloadError(f"{archive}: not a readable tar archive ({err}); delete it and re-run") from None
    except DownloadError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    missing = [name for name in wanted if name not in found]
    if missing:
        raise DownloadError(f"{archive}: has no member {', '.join(missing)}")
    return list(wanted.values())


def _check_member(member: tarfile.TarInfo, archive: Path) -> None:
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise DownloadError(
            f"{archive}: unsafe member path {member.name!r} (absolute or with '..'); refusing to extract"
        )
    if member.issym() or member.islnk():
        base = path.parent if member.issym() else PurePosixPath()
        target = PurePosixPath(member.linkname)
        if target.is_absolute() or _escapes(base / target):
            raise DownloadError(
                f"{archive}: member {member.name!r} links to {member.linkname!r} outside the archive; refusing to extract"
            )
    elif not (member.isfile() or member.isdir()):
        raise DownloadError(f"{archive}: member {member.name!r} is a device or fifo; refusing to extract")


def _escapes(path: PurePosixPath) -> bool:
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return True
    return False


def _copy_stream(stream: BinaryIO | None, dest: Path) -> None:
    """Stream one archive member into ``dest`` through `transformer_mt.files.atomic_open`."""
    assert stream is not None  # only regular files reach here
    with atomic_open(dest) as f:
        shutil.copyfileobj(stream, f, CHUNK)
