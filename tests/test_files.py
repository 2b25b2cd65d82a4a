import os

import pytest

from transformer_mt.files import atomic_path, atomic_write_bytes, atomic_write_text


def test_write_text_and_bytes(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "één\ntwee\n")
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\xff")
    assert (tmp_path / "a.txt").read_bytes() == "één\ntwee\n".encode()
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin"]  # no temporary file left


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
