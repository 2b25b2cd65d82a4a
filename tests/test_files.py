import errno
import os
import re
import stat
import threading
from pathlib import Path

import pytest

from transformer_mt import files
from transformer_mt.files import atomic_open, atomic_path, atomic_write_lines, atomic_write_text, remove_leftovers


def test_write_text_and_bytes(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "één\ntwee\n")
    with atomic_open(tmp_path / "b.bin") as f:
        f.write(b"\x00\xff")
    assert (tmp_path / "a.txt").read_bytes() == "één\ntwee\n".encode()
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin"]  # no temporary file left


def test_write_lines_streams_with_unix_line_ends_into_a_new_directory(tmp_path):
    path = tmp_path / "new" / "hyp.de"
    atomic_write_lines(path, (line for line in ["eins", "", "drei\r"]))
    assert path.read_bytes() == b"eins\n\ndrei\r\n"
    assert os.listdir(path.parent) == ["hyp.de"]


def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old", encoding="utf-8")
    atomic_write_text(path, "new")
    assert path.read_text(encoding="utf-8") == "new"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_temp_file_is_beside_the_target_and_streams(tmp_path):
    path = tmp_path / "big.txt"
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        assert tmp.parent == tmp_path and tmp != path
        f.write("line\n")
        f.flush()
        assert not path.exists()  # invisible under the real name until complete
    assert path.read_text(encoding="utf-8") == "line\n"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failure_leaves_no_target_and_no_temp(tmp_path, error):
    with pytest.raises(type(error)), atomic_path(tmp_path / "new.txt") as tmp, open(tmp, "wb") as f:
        f.write(b"half")
        raise error
    assert os.listdir(tmp_path) == []


def test_failure_keeps_the_existing_target(tmp_path):
    path = tmp_path / "keep.txt"
    path.write_bytes(b"complete")
    with pytest.raises(ValueError, match="boom"), atomic_path(path) as tmp:
        tmp.write_bytes(b"partial")
        raise ValueError("boom")
    assert path.read_bytes() == b"complete"
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_temporary_names_are_random_and_never_follow_a_planted_link(tmp_path, monkeypatch):
    """A link planted under the next temporary name is refused (O_EXCL), left alone, and another name is drawn."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious", encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    names = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    planted = run / f".out.txt.{'0' * 16}.tmp"
    planted.symlink_to(outside)
    atomic_write_text(run / "out.txt", "mine")
    assert outside.read_text(encoding="utf-8") == "precious"
    assert planted.is_symlink() and (run / "out.txt").read_text(encoding="utf-8") == "mine"


def test_atomic_open_streams_text_and_binary(tmp_path):
    with atomic_open(tmp_path / "a.txt", "w", encoding="utf-8") as f:
        f.write("één\r\n")
        assert not (tmp_path / "a.txt").exists()
    with pytest.raises(KeyboardInterrupt), atomic_open(tmp_path / "b.bin") as f:
        f.write(b"half")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["a.txt"]
    assert (tmp_path / "a.txt").read_bytes() == "één\r\n".encode()


def test_remove_leftovers_takes_only_the_owned_pattern_in_that_directory(tmp_path):
    owned = re.compile(r"checkpoint_u\d+\.pt")
    ours = [
        tmp_path / ".checkpoint_u0000010.pt.0123abcd.tmp",
        tmp_path / ".checkpoint_u0000020.pt.0123456789abcdef.tmp",
    ]
    others = [
        tmp_path / ".average.pt.0123abcd.tmp",  # another writer's target
        tmp_path / "checkpoint_u0000010.pt",  # a real checkpoint
        tmp_path / ".checkpoint_u0000010.pt.tmp",  # not our pattern
        tmp_path / "sub" / ".checkpoint_u0000030.pt.0123abcd.tmp",  # below the directory
    ]
    for path in ours + others:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    link = tmp_path / ".checkpoint_u0000040.pt.0123abcd.tmp"
    link.symlink_to(outside)
    assert remove_leftovers(tmp_path, owned) == sorted([*ours, link])
    assert all(p.exists() for p in others) and outside.read_bytes() == b"keep"


@pytest.mark.parametrize("opener", ["atomic_open", "atomic_path"])
def test_an_interrupt_right_after_the_temp_file_is_created_leaves_nothing(tmp_path, monkeypatch, opener):
    """Ctrl-C can land between the creation of the temporary file and the code that would clean it up."""
    real_open = os.open

    def open_then_interrupt(*args, **kwargs):
        real_open(*args, **kwargs)  # the file now exists on disk
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt), getattr(files, opener)(tmp_path / "out.txt"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_fifo_is_written_in_place_never_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write_lines(fifo, ["eins", "zwei"])
    reader.join(timeout=10)
    assert got == [b"eins\nzwei\n"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert os.listdir(tmp_path) == ["fifo"]


def test_a_descriptors_name_is_written_through_whatever_it_leads_to(tmp_path):
    """/dev/fd/N (as /dev/stdout) on a regular file: written at its end, the file kept, the name no file of ours."""
    out = tmp_path / "out.txt"
    with open(out, "w", encoding="utf-8") as f:
        f.write("before\n")
        f.flush()
        name = Path(f"/dev/fd/{f.fileno()}")
        assert files.is_in_place(name)
        atomic_write_text(name, "after\n")
    assert out.read_text(encoding="utf-8") == "before\nafter\n" and os.listdir(tmp_path) == ["out.txt"]
    assert not files.is_in_place(out) and not files.is_in_place(tmp_path) and not files.is_in_place(tmp_path / "no")


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT])
def test_no_room_names_the_file_the_os_did_not(tmp_path, number):
    with pytest.raises(OSError) as raised, atomic_open(tmp_path / "out.txt", "w") as f:
        f.write("half")
        raise OSError(number, os.strerror(number))
    assert (raised.value.errno, raised.value.filename) == (number, str(tmp_path / "out.txt"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError) as raised, atomic_open(tmp_path / "out.txt", "w"):
        raise OSError(errno.EIO, "Input/output error")  # not a matter of room: left as the OS said it
    assert raised.value.filename is None
