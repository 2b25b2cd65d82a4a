"""--source statmt: resumable, checksummed archive downloads and safe tar extraction.

The archives are tiny tarballs in the statmt layout built here; the HTTP server
is a stand-in opener that honours Range requests, so everything else (resume,
checksum, extraction, alignment) runs for real.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import tarfile
import urllib.request
from pathlib import Path

import pytest

from transformer_mt.data.download_files import DownloadError, read_marker
from transformer_mt.data.download_statmt import Corpus, download_statmt, fetch_archive, safe_extract


def make_tar(members: dict[str, bytes], mode: str = "w:gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def corpus_for(name: str, data: bytes, members: dict[str, tuple[str, str]], sha: bool = True) -> Corpus:
    digest = hashlib.sha256(data).hexdigest() if sha else None
    return Corpus(name, f"http://statmt.example/{name}.tgz", digest, len(data), members)


class FakeServer:
    """Serves ``files`` (url -> bytes); honours ``Range``; can drop the connection or lie about content."""

    def __init__(
        self, files: dict[str, bytes], drop_after: int | None = None, honour_range: bool = True, drop_error=None
    ):
        self.files, self.drop_after, self.honour_range = files, drop_after, honour_range
        self.drop_error = drop_error or ConnectionResetError(104, "Connection reset by peer")
        self.ranges: list[str | None] = []

    def __call__(self, request: urllib.request.Request, timeout: float | None = None):
        data = self.files[request.full_url]
        header = request.get_header("Range")
        self.ranges.append(header)
        start = int(header.removeprefix("bytes=").rstrip("-")) if header and self.honour_range else 0
        return FakeResponse(data[start:], 206 if start else 200, self.drop_after, self.drop_error)


class FakeResponse(io.BytesIO):
    def __init__(self, body: bytes, status: int, drop_after: int | None, drop_error: Exception):
        super().__init__(body)
        self.status, self.drop_after, self.drop_error = status, drop_after, drop_error

    def read(self, n: int = -1) -> bytes:
        if self.drop_after is not None and self.tell() >= self.drop_after:
            raise self.drop_error
        limit = n if self.drop_after is None else min(n, self.drop_after - self.tell())
        return super().read(limit)


EUROPARL = {
    "training/europarl-v7.de-en.en": b"Resumption of the session\nI declare\n\nThank you.\n",
    "training/europarl-v7.de-en.de": b"Wiederaufnahme der Sitzung\nIch erkl\xc3\xa4re\nLeer\n\n",
    "training/europarl-v7.fr-en.en": b"ignored\n",
    "training/README": b"not wanted\n",
}
NEWS = {
    "training/news-commentary-v9.de-en.en": b"Gold\tprices\r\n",
    "training/news-commentary-v9.de-en.de": b"Goldpreise\r\n",
}


def test_statmt_concatenates_corpora_keeps_alignment_and_counts(tmp_path):
    europarl, news = make_tar(EUROPARL), make_tar(NEWS)
    corpora = [
        corpus_for("europarl", europarl, {"en-de": ("training/europarl-v7.de-en.en", "training/europarl-v7.de-en.de")}),
        corpus_for(
            "news", news, {"en-de": ("training/news-commentary-v9.de-en.en", "training/news-commentary-v9.de-en.de")}
        ),
        corpus_for("un", b"never fetched for en-de", {"en-fr": ("a", "b")}),
    ]
    server = FakeServer({c.url: d for c, d in zip(corpora, [europarl, news, b""], strict=True)})
    out = tmp_path / "out"
    killed = out / "archives" / ".extract-k1ll3d"  # the extraction directory of a killed run
    killed.mkdir(parents=True)
    (killed / "europarl-v7.de-en.en").write_text("gigabytes\n")
    rows = download_statmt("en-de", out, corpora, opener=server)
    assert (out / "train.en").read_text(encoding="utf-8").splitlines() == [
        "Resumption of the session",
        "I declare",
        "Gold prices",
    ]
    assert (out / "train.de").read_text(encoding="utf-8").splitlines() == [
        "Wiederaufnahme der Sitzung",
        "Ich erkläre",
        "Goldpreise",
    ]
    assert [(r.source, r.pairs, r.dropped) for r in rows] == [
        ("statmt europarl", 2, 2),
        ("statmt news", 1, 0),
        ("statmt europarl+news", 3, 2),
    ]
    assert read_marker(out, "train", "en")["lines"] == 3
    assert sorted(p.name for p in (out / "archives").iterdir()) == [
        "europarl.tgz",
        "news.tgz",
    ]  # extracted text removed, the killed run's too
    assert len(server.ranges) == 2
    assert download_statmt("en-de", out, corpora, opener=server)[0].status == "complete, skipped"
    assert len(server.ranges) == 2  # nothing fetched again


def test_statmt_gzipped_members_in_plain_tar(tmp_path):
    data = make_tar(
        {
            "giga-fren.release2.fixed.en.gz": gzip.compress(b"Hello\nWorld\n"),
            "giga-fren.release2.fixed.fr.gz": gzip.compress(b"Bonjour\nMonde\n"),
        },
        mode="w",
    )
    corpus = corpus_for("giga", data, {"en-fr": ("giga-fren.release2.fixed.en.gz", "giga-fren.release2.fixed.fr.gz")})
    download_statmt("en-fr", tmp_path, [corpus], opener=FakeServer({corpus.url: data}))
    assert (tmp_path / "train.fr").read_text() == "Bonjour\nMonde\n"


def test_statmt_misaligned_members_are_an_error(tmp_path):
    data = make_tar({"c.de-en.en": b"a\nb\nc\n", "c.de-en.de": b"x\ny\n"})
    corpus = corpus_for("c", data, {"en-de": ("c.de-en.en", "c.de-en.de")})
    with pytest.raises(DownloadError, match=r"not aligned: .*c\.de-en\.en has more lines after line 2"):
        download_statmt("en-de", tmp_path, [corpus], opener=FakeServer({corpus.url: data}))
    assert not list(tmp_path.glob("train*"))


@pytest.mark.parametrize("error", [ConnectionResetError(104, "reset"), http.client.IncompleteRead(b"", 10)])
def test_interrupted_download_resumes_with_range(tmp_path, error):
    data = make_tar({"big.en": b"x\n" * 5000, "big.de": b"y\n" * 5000})
    corpus = corpus_for("big", data, {"en-de": ("big.en", "big.de")})
    part = tmp_path / "big.tgz.part"
    with pytest.raises(DownloadError, match="connection lost .*partial file .* is kept"):
        fetch_archive(corpus, tmp_path, FakeServer({corpus.url: data}, drop_after=100, drop_error=error))
    assert part.stat().st_size == 100
    server = FakeServer({corpus.url: data})
    path = fetch_archive(corpus, tmp_path, server)
    assert server.ranges == ["bytes=100-"]
    assert path.read_bytes() == data and not part.exists()


def test_a_link_planted_at_the_partial_download_is_refused(tmp_path):
    """`.part` has a predictable name (it must, to resume): a link there is never written through."""
    data = make_tar({"a.en": b"a\n", "a.de": b"b\n"})
    corpus = corpus_for("a", data, {"en-de": ("a.en", "a.de")})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"precious")
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / "a.tgz.part").symlink_to(elsewhere)
    with pytest.raises(DownloadError, match=r"a\.tgz\.part is a symbolic link; tmt never writes through one"):
        fetch_archive(corpus, archives, FakeServer({corpus.url: data}))
    assert elsewhere.read_bytes() == b"precious"


def test_server_ignoring_range_restarts_cleanly(tmp_path):
    data = make_tar({"a.en": b"a\n", "a.de": b"b\n"})
    corpus = corpus_for("a", data, {"en-de": ("a.en", "a.de")})
    (tmp_path / "a.tgz.part").write_bytes(data[:10])
    path = fetch_archive(corpus, tmp_path, FakeServer({corpus.url: data}, honour_range=False))
    assert path.read_bytes() == data


def test_truncated_download_is_kept_for_resume_never_used(tmp_path):
    data = make_tar({"a.en": b"a\n", "a.de": b"b\n"})
    corpus = corpus_for("a", data, {"en-de": ("a.en", "a.de")})
    with pytest.raises(DownloadError, match=f"stopped at 20 of {len(data):,} bytes"):
        fetch_archive(corpus, tmp_path, FakeServer({corpus.url: data[:20]}))
    assert (tmp_path / "a.tgz.part").stat().st_size == 20 and not (tmp_path / "a.tgz").exists()


def test_corrupt_download_fails_checksum_and_is_removed(tmp_path):
    data = make_tar({"a.en": b"a\n", "a.de": b"b\n"})
    corpus = corpus_for("a", data, {"en-de": ("a.en", "a.de")})
    corrupt = bytes(len(data))
    with pytest.raises(DownloadError, match=r"a\.tgz\.part: checksum mismatch .*with sha256"):
        download_statmt("en-de", tmp_path, [corpus], opener=FakeServer({corpus.url: corrupt}))
    archives = tmp_path / "archives"
    assert not (archives / "a.tgz").exists() and not (archives / "a.tgz.part").exists()
    assert not list(tmp_path.glob("train*"))


def test_archive_without_checksum_is_size_checked(tmp_path):
    data = make_tar({"a.en": b"a\n", "a.de": b"b\n"})
    corpus = corpus_for("a", data, {"en-de": ("a.en", "a.de")}, sha=False)
    assert fetch_archive(corpus, tmp_path, FakeServer({corpus.url: data})).read_bytes() == data


def test_unreachable_server_says_how_to_use_from(tmp_path):
    import urllib.error

    def offline(request, timeout=None):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    corpus = corpus_for("a", b"xx", {"en-de": ("a.en", "a.de")})
    with pytest.raises(DownloadError, match="(?s)could not reach .*--from DIR"):
        fetch_archive(corpus, tmp_path, offline)


def unsafe_tar(path: Path, kind: str) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        good = tarfile.TarInfo("ok.en")
        good.size = 2
        tar.addfile(good, io.BytesIO(b"a\n"))
        info = tarfile.TarInfo({"dotdot": "../evil.en", "absolute": "/tmp/evil.en"}.get(kind, "inner/link"))
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "../../etc/passwd"
        elif kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "/etc/passwd"
        else:
            info.size = 2
        tar.addfile(info, io.BytesIO(b"b\n") if info.isfile() else None)
    return path


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink"])
def test_unsafe_member_paths_are_rejected(tmp_path, kind):
    archive = unsafe_tar(tmp_path / f"{kind}.tgz", kind)
    dest = tmp_path / "extract"
    with pytest.raises(DownloadError, match=f"{kind}.tgz: .*refusing to extract"):
        safe_extract(archive, ["ok.en"], dest)
    assert not dest.exists()
    assert not (tmp_path / "evil.en").exists()


def test_links_inside_the_archive_are_allowed(tmp_path):
    archive = tmp_path / "in.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("d/ok.en")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"a\n"))
        link = tarfile.TarInfo("d/alias.en")
        link.type, link.linkname = tarfile.SYMTYPE, "ok.en"
        tar.addfile(link)
    [path] = safe_extract(archive, ["d/ok.en"], tmp_path / "x")
    assert path.read_bytes() == b"a\n"
    with pytest.raises(DownloadError, match="has no member missing.en"):
        safe_extract(archive, ["missing.en"], tmp_path / "y")


def test_unreadable_archive_is_a_clear_error(tmp_path):
    archive = tmp_path / "garbage.tgz"
    archive.write_bytes(b"\x1f\x8b" + bytes(100))
    with pytest.raises(DownloadError, match="garbage.tgz: .*delete it and re-run"):
        safe_extract(archive, ["a.en"], tmp_path / "x")
    assert not (tmp_path / "x").exists()
