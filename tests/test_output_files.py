"""Where a command's output goes: a full disk is one line naming the file, with nothing partial left behind, and an
output that is no regular file (a FIFO, a device) is written in place, never replaced by a regular file.

The commands run in processes of their own. A full disk is a file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes
past it fail with EFBIG, which tmt treats as ENOSPC) or /dev/full, which refuses every write with ENOSPC. Device
nodes are made in the test's directory where the process may (root): a writer that replaced them would replace
only those, never the machine's /dev/null.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import assert_user_error, tmt, write_checkpoint

from transformer_mt.config import Config

NO_ROOM = "cannot write (File too large); free space on that disk"


def limited(max_bytes: int):
    """A preexec_fn: files of this process may not grow past ``max_bytes``, and a write past it fails (EFBIG)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


def tmt_limited(max_bytes: int, *args: str) -> subprocess.CompletedProcess:
    """``tmt ARGS`` on a disk that is full past ``max_bytes`` per file."""
    return subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, preexec_fn=limited(max_bytes),
    )  # fmt: skip


def device(tmp_path: Path, name: str, minor: int) -> Path:
    """A character device of the memory driver (3: null, 7: full) in ``tmp_path``; skips where none may be made."""
    path = tmp_path / name
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("making a device node needs root (CAP_MKNOD)")
    return path


def read_fifo(path: Path) -> tuple[threading.Thread, list[bytes]]:
    """A thread reading the FIFO ``path`` until its writer closes it; the list holds what it read."""
    got: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as f:
            got.append(f.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, got


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    ["translate", "evaluate", "score", "score --json", "export spm", "export ctranslate2", "plot", "report",
     "attention"],
)  # fmt: skip
def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(
    command: str, toy_ckpt: Path, toy_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    hyp = toy_run.parent / "head.de"
    args = {
        "translate": ["translate", "-c", str(toy_ckpt), "-i", str(toy_run.parent / "head.en"), "-o", str(out / "t.txt")],
        "evaluate": ["evaluate", "toy", "-c", str(toy_ckpt), "--src", str(toy_run.parent / "head.en"), "--ref",
                     str(hyp), "-o", str(out / "ev")],
        "score": ["score", "--hyp", str(hyp), "--ref", str(hyp), "-o", str(out / "sc")],
        "score --json": ["score", "--hyp", str(hyp), "--ref", str(hyp), "--json", str(out / "s.json")],
        "export spm": ["export", "spm", "-c", str(toy_ckpt), "-o", str(out / "spm.model")],
        "export ctranslate2": ["export", "ctranslate2", "-c", str(toy_ckpt), "-o", str(out / "ct2")],
        "plot": ["plot", str(toy_run), "-o", str(out / "p.png")],
        "report": ["report", str(toy_run), "-o", str(out / "r.md")],
        "attention": ["attention", "-c", str(toy_ckpt), "-t", "The old man sees the red car.", "-o",
                      str(out / "a.png")],
    }[command]  # fmt: skip
    if command.startswith("export ctranslate2"):
        pytest.importorskip("ctranslate2")
    if command in ("plot", "report", "attention"):
        pytest.importorskip("matplotlib")
    line = assert_user_error(tmt_limited(64, *args), NO_ROOM)
    assert line.startswith(f"error: {out}/")
    assert [p for p in out.rglob("*") if not p.is_dir()] == []  # no partial file, no temporary one


@pytest.mark.slow
def test_a_full_disk_in_export_hf_is_safetensors_error_in_one_line(prepared_toy: Config, tmp_path: Path) -> None:
    """safetensors reports the refused write as its own error; the model is large enough (2 MB) that the limit
    passes the tokenizer's temporary files (0.3 MB) and stops the weights."""
    pytest.importorskip("safetensors")
    model = dataclasses.replace(prepared_toy.model, d_model=128, d_ff=512)
    write_checkpoint(dataclasses.replace(prepared_toy, model=model), tmp_path / "ck.pt", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    done = tmt_limited(1_000_000, "export", "hf", "-c", str(tmp_path / "ck.pt"), "-o", str(out / "hf"))
    assert_user_error(done, f"{out / 'hf' / 'model.safetensors'}: {NO_ROOM}")
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_a_full_temporary_directory_in_export_hf_names_it_and_tmpdir(toy_ckpt: Path, tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    done = tmt_limited(64, "export", "hf", "-c", str(toy_ckpt), "-o", str(tmp_path / "hf"))
    assert_user_error(done, NO_ROOM, "set TMPDIR to a directory on a disk with room")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_average_on_a_full_disk_names_the_checkpoint_in_one_line(toy_run: Path, tmp_path: Path) -> None:
    done = tmt_limited(64, "average", str(toy_run), "-o", str(tmp_path / "avg.pt"))
    assert_user_error(done, f"{tmp_path / 'avg.pt'}: could not write the checkpoint (File too large)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, where every write fails with ENOSPC")
def test_output_to_dev_full_is_no_space_in_one_line(toy_ckpt: Path, toy_run: Path, tmp_path: Path) -> None:
    full = device(tmp_path, "full", 7) if os.geteuid() == 0 else Path("/dev/full")  # root could replace /dev/full
    done = tmt("translate", "-c", str(toy_ckpt), "-i", str(toy_run.parent / "head.en"), "-o", str(full))
    assert_user_error(done, f"{full}: cannot write (No space left on device); free space on that disk")
    done = tmt("plot", str(toy_run), "-o", str(full))
    assert_user_error(done, f"{full}: cannot write (No space left on device)")
    assert stat.S_ISCHR(full.stat().st_mode)


@pytest.mark.slow
def test_a_fifo_and_a_device_as_output_are_written_in_place(toy_ckpt: Path, toy_run: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    thread, got = read_fifo(fifo)
    done = tmt("translate", "-c", str(toy_ckpt), "-i", str(toy_run.parent / "head.en"), "-o", str(fifo))
    thread.join(timeout=60)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode) and got[0].count(b"\n") == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no temporary file beside it
    null = device(tmp_path, "null", 3)
    for args in (
        ["average", str(toy_run), "-o", str(null)],
        ["plot", str(toy_run), "-o", str(null)],
        ["export", "spm", "-c", str(toy_ckpt), "-o", str(null)],
    ):
        done = tmt(*args)
        assert done.returncode == 0, done.stderr
        assert stat.S_ISCHR(null.stat().st_mode)


@pytest.mark.slow
def test_dev_null_as_output_stays_the_null_device(toy_ckpt: Path, toy_run: Path, tmp_path: Path) -> None:
    """Checked on a FIFO first: a writer that replaced its output would fail there, before touching /dev/null
    (which root may replace)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    thread, _ = read_fifo(fifo)
    tmt("translate", "-c", str(toy_ckpt), "-i", str(toy_run.parent / "head.en"), "-o", str(fifo))
    thread.join(timeout=60)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    done = tmt("translate", "-c", str(toy_ckpt), "-i", str(toy_run.parent / "head.en"), "-o", "/dev/null")
    assert done.returncode == 0, done.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
