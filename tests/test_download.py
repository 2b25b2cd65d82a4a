"""tmt download wmt14: Hugging Face layout, --from, sacreBLEU dev/test sets, markers, disk full.

Only the network transfer is replaced: the Hugging Face loader reads a local
directory in the Hub's layout, sacreBLEU's ``download_file`` is swapped for one
that writes the archive contents locally.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import urllib.error
from pathlib import Path

import pytest
from typer.testing import CliRunner

from transformer_mt import files
from transformer_mt.cli import app
from transformer_mt.data.download import download_hf, download_wmt14, fetch_testsets, format_summary
from transformer_mt.data.download_files import DownloadError, clean_pair, is_complete, read_marker
from transformer_mt.errors import UserError

ROWS = [
    ("Hello world.", "Hallo Welt."),
    ("A line\nwith a break.", "Eine Zeile\nmit Umbruch."),
    ("Tab\there.", "Tab\thier."),
    ("", "Leere Quelle."),
    ("Empty target.", "   "),
    ("Carriage\rreturn and\u2028separator.", "Wagen\rrücklauf."),
    ("Last one.", "Der letzte."),
]


def lines(path: Path) -> list[str]:
    return path.read_bytes().decode("utf-8").split("\n")[:-1]


# --------------------------------------------------------------------------- clean_pair


def test_clean_pair_joins_inner_breaks_and_drops_empty_sides():
    assert clean_pair(" a\nb\tc\r\n", "x\u2028y\x85z") == ("a b c", "x y z")
    assert clean_pair("", "x") is None
    assert clean_pair("x", " \t\n") is None
    for cleaned in clean_pair("p\vq\fr\x1cs\u2029t", "ok"):
        assert len(cleaned.splitlines()) == 1  # no reader sees two lines


# --------------------------------------------------------------------------- Hugging Face


def make_hub_dir(root: Path, config: str, langs: tuple[str, str], rows: list[tuple[str, str]]) -> Path:
    """A local copy of the wmt/wmt14 Hub layout: README configs + {config}/train-00000-of-00001.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / config).mkdir(parents=True)
    table = pa.table({"translation": [{langs[1]: t, langs[0]: s} for s, t in rows]})
    pq.write_table(table, root / config / "train-00000-of-00001.parquet")
    (root / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {config}\n  data_files:\n  - split: train\n    path: {config}/train-*\n---\n"
    )
    return root


def test_hf_stream_keeps_alignment_and_counts_dropped_pairs(tmp_path):
    hub = make_hub_dir(tmp_path / "hub", "de-en", ("en", "de"), ROWS)
    out = tmp_path / "out"
    [row] = download_hf("en-de", out, hub_path=str(hub))
    en, de = lines(out / "train.en"), lines(out / "train.de")
    assert en == ["Hello world.", "A line with a break.", "Tab here.", "Carriage return and separator.", "Last one."]
    assert de == ["Hallo Welt.", "Eine Zeile mit Umbruch.", "Tab hier.", "Wagen rücklauf.", "Der letzte."]
    assert (row.pairs, row.dropped, row.status) == (5, 2, "written")
    marker = read_marker(out, "train", "de")
    assert marker["lines"] == 5 and marker["dropped_empty"] == 2
    assert marker["sha256"] == hashlib.sha256((out / "train.de").read_bytes()).hexdigest()
    assert not list(out.glob("*.tmp"))


def test_hf_en_fr_uses_fr_en_config(tmp_path):
    hub = make_hub_dir(tmp_path / "hub", "fr-en", ("en", "fr"), [("Good morning.", "Bonjour.")])
    download_hf("en-fr", tmp_path / "out", hub_path=str(hub))
    assert lines(tmp_path / "out" / "train.fr") == ["Bonjour."]


def test_hf_rerun_skips_complete_files_and_redoes_damaged_ones(tmp_path):
    hub = make_hub_dir(tmp_path / "hub", "de-en", ("en", "de"), ROWS)
    out = tmp_path / "out"
    download_hf("en-de", out, hub_path=str(hub))
    before = (out / "train.en").stat().st_mtime_ns
    [row] = download_hf("en-de", out, hub_path=str(hub))
    assert row.status == "complete, skipped" and row.pairs == 5
    assert (out / "train.en").stat().st_mtime_ns == before
    (out / "train.de").write_text("truncated\n")  # size no longer matches the marker
    [row] = download_hf("en-de", out, hub_path=str(hub))
    assert row.status == "written" and len(lines(out / "train.de")) == 5


def test_hf_unreachable_hub_says_how_to_use_from(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wmt/wmt14' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DownloadError, match="--from DIR") as err:
        download_hf("en-de", tmp_path / "out")
    assert "~/.sacrebleu" in str(err.value)
    assert not (tmp_path / "out" / "train.en").exists()


def test_hf_row_without_language_is_a_clear_error(tmp_path):
    hub = make_hub_dir(tmp_path / "hub", "de-en", ("en", "cs"), [("a", "b")])  # wrong language column
    with pytest.raises(DownloadError, match="translation column has no 'de' .*languages: cs, en"):
        download_hf("en-de", tmp_path / "out", hub_path=str(hub))
    assert not list((tmp_path / "out").glob("train*"))


# --------------------------------------------------------------------------- disk full


class FullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes free: writes beyond it fail with ENOSPC."""

    room = 40

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_disk_full_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    hub = make_hub_dir(tmp_path / "hub", "de-en", ("en", "de"), ROWS * 20)
    out = tmp_path / "out"
    monkeypatch.setattr(files, "open", lambda fd, mode="r", *a, **k: FullDisk(fd, mode.replace("b", "")), raising=False)
    with pytest.raises(DownloadError, match=r"disk full while writing .*train\.en; nothing was kept"):
        download_hf("en-de", out, hub_path=str(hub))
    assert sorted(p.name for p in out.iterdir()) == []  # no train.*, no .tmp, no markers
    assert not is_complete(out, "train", ("en", "de"), f"hf {hub} de-en train")


def test_disk_full_during_from_copy(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.en").write_text("one sentence\n" * 10)
    (src / "train.de").write_text("ein Satz\n" * 10)
    monkeypatch.setattr(files, "open", lambda fd, mode="r", *a, **k: FullDisk(fd, mode.replace("b", "")), raising=False)
    with pytest.raises(DownloadError, match="disk full"):
        download_wmt14("en-de", tmp_path / "out", from_dir=src)
    assert not list((tmp_path / "out").glob("train*"))


# --------------------------------------------------------------------------- --from DIR


def write_pair(directory: Path, prefix: str, src: list[str], tgt: list[str], langs=("en", "de")) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{prefix}.{langs[0]}").write_text("".join(x + "\n" for x in src), encoding="utf-8")
    (directory / f"{prefix}.{langs[1]}").write_text("".join(x + "\n" for x in tgt), encoding="utf-8")


@pytest.fixture
def full_dir(tmp_path) -> Path:
    d = tmp_path / "given"
    write_pair(d, "train", ["a", "b", "c"], ["x", "y", "z"])
    write_pair(d, "newstest2013", ["dev1", "dev2"], ["Dev1", "Dev2"])
    write_pair(d, "newstest2014", ["test1"], ["Test1"])
    return d


def test_from_dir_copies_everything_and_skips_on_rerun(full_dir, tmp_path):
    out = tmp_path / "out"
    rows = download_wmt14("en-de", out, from_dir=full_dir)
    assert [(r.file, r.pairs, r.status) for r in rows] == [
        ("train.en|de", 3, "written"),
        ("newstest2013.en|de", 2, "written"),
        ("newstest2014.en|de", 1, "written"),
    ]
    for name in ("train.de", "newstest2013.en", "newstest2014.de"):
        assert (out / name).read_bytes() == (full_dir / name).read_bytes()
    rows = download_wmt14("en-de", out, from_dir=full_dir)
    assert {r.status for r in rows} == {"complete, skipped"}
    table = format_summary(rows, out)
    assert "train.en|de" in table and "complete, skipped" in table


def test_from_dir_mismatched_line_counts_name_both_files(full_dir, tmp_path):
    (full_dir / "train.de").write_text("x\ny\n")
    with pytest.raises(DownloadError, match=r"train\.en has 3 lines but train\.de has 2"):
        download_wmt14("en-de", tmp_path / "out", from_dir=full_dir)
    assert not list((tmp_path / "out").glob("train*"))


def test_from_dir_without_newline_at_end_and_not_utf8(full_dir, tmp_path):
    (full_dir / "train.de").write_bytes(b"x\ny\nz")  # no final newline: still 3 lines
    download_wmt14("en-de", tmp_path / "out", from_dir=full_dir)
    assert (tmp_path / "out" / "train.de").read_bytes() == b"x\ny\nz\n"
    (full_dir / "train.de").write_bytes(b"x\n\xff\xfe\nz\n")
    with pytest.raises(DownloadError, match=r"train\.de:2: not UTF-8"):
        download_wmt14("en-de", tmp_path / "out2", from_dir=full_dir)


def test_from_dir_without_train_files_lists_what_it_found(full_dir, tmp_path):
    (full_dir / "train.en").unlink()
    (full_dir / "train.de").unlink()
    with pytest.raises(DownloadError) as err:
        download_wmt14("en-de", tmp_path / "out", from_dir=full_dir)
    assert "newstest2013.en (2 lines)" in str(err.value) and "--train-from newstest2013" in str(err.value)
    with pytest.raises(DownloadError, match="test set"):
        download_wmt14("en-de", tmp_path / "out", from_dir=full_dir, train_from="newstest2014")
    rows = download_wmt14("en-de", tmp_path / "out", from_dir=full_dir, train_from="newstest2013")
    assert "stand-in" in rows[0].source
    assert lines(tmp_path / "out" / "train.en") == ["dev1", "dev2"]


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(DownloadError, match="en-de, en-fr"):
        download_wmt14("de-en", tmp_path)
    with pytest.raises(DownloadError, match="hf, statmt"):
        download_wmt14("en-de", tmp_path, source="opus")
    with pytest.raises(DownloadError, match="only works with --from"):
        download_wmt14("en-de", tmp_path, train_from="newstest2013")
    with pytest.raises(DownloadError, match="not a directory"):
        download_wmt14("en-de", tmp_path / "out", from_dir=tmp_path / "missing")


# --------------------------------------------------------------------------- planted links


def _plant(out: Path, names: list[str], target: Path) -> list[Path]:
    """Links to ``target`` at names someone could predict in OUT; returns them."""
    links = []
    for name in names:
        link = out / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        links.append(link)
    return links


PREDICTABLE = [
    "train.en.tmp",  # the temporary names of earlier versions
    "train.de.tmp",
    "newstest2013.en.tmp",
    ".complete/train.en.json.tmp",
    ".complete/train.de.json.tmp",
    "train.en",  # the final names: replaced, never written through
    ".complete/train.en.json",
]


def test_download_from_dir_never_writes_through_a_planted_link(full_dir, tmp_path):
    """`tmt download --from`: links at every predictable name in OUT; the file they point at stays untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious\n")
    out = tmp_path / "out"
    _plant(out, PREDICTABLE, elsewhere)
    result = CliRunner().invoke(
        app, ["download", "wmt14", "--pair", "en-de", "--from", str(full_dir), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert elsewhere.read_text() == "precious\n"
    assert (out / "train.en").read_bytes() == (full_dir / "train.en").read_bytes() and not (
        out / "train.en"
    ).is_symlink()
    assert is_complete(out, "train", ("en", "de"), f"from {full_dir.resolve() / 'train'}")


def test_hf_writer_never_writes_through_a_planted_link(tmp_path):
    hub = make_hub_dir(tmp_path / "hub", "de-en", ("en", "de"), ROWS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious\n")
    out = tmp_path / "out"
    _plant(out, PREDICTABLE, elsewhere)
    download_hf("en-de", out, hub_path=str(hub))
    assert elsewhere.read_text() == "precious\n"
    assert lines(out / "train.en")[0] == "Hello world." and read_marker(out, "train", "de")["lines"] == 5


def test_a_planted_marker_directory_is_refused(full_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / ".complete").symlink_to(elsewhere)
    with pytest.raises(DownloadError, match=r"\.complete is a symbolic link; tmt never writes through one"):
        download_wmt14("en-de", out, from_dir=full_dir)
    assert list(elsewhere.iterdir()) == []


def test_a_rewrite_removes_the_temporary_files_a_killed_run_left(full_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    left = [out / ".train.en.0123456789abcdef.tmp", out / ".train.de.0123456789abcdef.tmp"]
    other = out / ".newstest2014.en.0123456789abcdef.tmp"  # another pair's: removed when that pair is rewritten
    for path in [*left, other]:
        path.write_text("half\n")
    download_wmt14("en-de", out, from_dir=full_dir, train_from=None)
    assert not any(p.exists() for p in [*left, other])
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == []


@pytest.mark.parametrize("prefix", ["../secret", "sub/newstest2013", "/etc/passwd", "..", "."])
def test_train_from_must_name_files_inside_from(full_dir, tmp_path, prefix):
    (tmp_path / "secret.en").write_text("outside\n")
    (tmp_path / "secret.de").write_text("draußen\n")
    out = tmp_path / "out"
    with pytest.raises(DownloadError, match="give a file prefix inside --from DIR, such as newstest2013"):
        download_wmt14("en-de", out, from_dir=full_dir, train_from=prefix)
    assert not (out / "train.en").exists()


# --------------------------------------------------------------------------- sacreBLEU dev/test sets


def sgm(lines_: list[str]) -> str:
    segs = "".join(f'<seg id="{i}">{x}</seg>\n' for i, x in enumerate(lines_, 1))
    return f'<srcset setid="x" srclang="any">\n<doc sysid="ref" docid="d1" genre="news" origlang="en">\n{segs}</doc>\n</srcset>\n'


@pytest.fixture
def fake_sacrebleu(tmp_path, monkeypatch):
    """sacreBLEU with its cache in tmp_path and its network download replaced by local archive contents."""
    from sacrebleu.dataset import DATASETS, base

    content = {
        "test/newstest2013-src.en.sgm": sgm(["Dev one.", "Dev  two ."]),
        "test/newstest2013-src.de.sgm": sgm(["Dev eins.", "Dev zwei."]),
        "test-full/newstest2014-deen-src.en.sgm": sgm(["Test one.", "Test two.", "Test three."]),
        "test-full/newstest2014-deen-ref.de.sgm": sgm(["Test eins.", "Test zwei.", "Test drei."]),
    }
    calls = []

    def fake_download_file(url, dest_path, extract_to=None, expected_md5=None):
        calls.append(url)
        for member, text in content.items():
            path = Path(extract_to) / member
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")

    for name in ("wmt13", "wmt14/full"):
        cache = tmp_path / "sacrebleu" / name
        monkeypatch.setattr(DATASETS[name], "_outdir", str(cache))
        monkeypatch.setattr(DATASETS[name], "_rawdir", str(cache / "raw"))
    monkeypatch.setattr(base, "download_file", fake_download_file)
    return calls


def test_testsets_come_from_sacrebleu(fake_sacrebleu, tmp_path):
    out = tmp_path / "out"
    rows = fetch_testsets("en-de", out)
    assert [(r.source, r.pairs) for r in rows] == [("sacrebleu wmt13", 2), ("sacrebleu wmt14/full", 3)]
    assert lines(out / "newstest2013.en") == ["Dev one.", "Dev two ."]  # sacreBLEU collapses whitespace
    assert lines(out / "newstest2014.de") == ["Test eins.", "Test zwei.", "Test drei."]
    assert any(url.endswith("test-full.tgz") for url in fake_sacrebleu)  # the full newstest2014, not filtered
    assert {r.status for r in fetch_testsets("en-de", out)} == {"complete, skipped"}


def test_from_dir_with_train_only_fetches_testsets_from_sacrebleu(fake_sacrebleu, tmp_path):
    given = tmp_path / "given"
    write_pair(given, "train", ["a"], ["b"])
    rows = download_wmt14("en-de", tmp_path / "out", from_dir=given)
    assert [r.file for r in rows] == ["train.en|de", "newstest2013.en|de", "newstest2014.en|de"]
    assert rows[2].source == "sacrebleu wmt14/full"


def test_testsets_offline_mentions_from_and_cache(tmp_path, monkeypatch):
    from sacrebleu.dataset import DATASETS, base

    def offline(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    cache = tmp_path / "sacrebleu" / "wmt13"
    monkeypatch.setattr(DATASETS["wmt13"], "_outdir", str(cache))
    monkeypatch.setattr(DATASETS["wmt13"], "_rawdir", str(cache / "raw"))
    monkeypatch.setattr(base, "download_file", offline)
    with pytest.raises(UserError) as err:
        fetch_testsets("en-de", tmp_path / "out", names=["newstest2013"])
    assert "--from DIR" in str(err.value) and "$SACREBLEU" in str(err.value)


# --------------------------------------------------------------------------- command line


def test_cli_download_from_dir_prints_summary(full_dir, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["download", "wmt14", "--pair", "en-de", "--from", str(full_dir), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "newstest2014.en|de" in result.output
    assert json.loads((out / ".complete" / "train.en.json").read_text())["lines"] == 3
    result = CliRunner().invoke(app, ["download", "wmt14", "--pair", "en-xx", "--out", str(out)])
    assert result.exit_code == 2 and "unknown --pair" in result.output
