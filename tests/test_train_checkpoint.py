"""A run directory's checkpoints: names, resume search and pruning (the files themselves: test_checkpoint.py)."""

import os

import pytest
from test_checkpoint import _state

from transformer_mt.checkpoint import checkpoint_problem, save_checkpoint
from transformer_mt.train import checkpoint as ck
from transformer_mt.train.checkpoint import (
    checkpoint_name,
    find_resume_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)


def test_names_sort_by_update(tmp_path):
    for u in (100, 20, 3000, 1200):
        (tmp_path / checkpoint_name(u)).write_bytes(b"x")
    (tmp_path / "checkpoint_best.pt").write_bytes(b"x")
    (tmp_path / "average.pt").write_bytes(b"x")
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [20, 100, 1200, 3000]
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == [p.name for p in list_checkpoints(tmp_path)]


def test_resume_skips_corrupt_newest(tmp_path, capsys):
    for u in (100, 200, 300):
        save_checkpoint(tmp_path / checkpoint_name(u), _state(u))
    newest = tmp_path / checkpoint_name(300)
    newest.write_bytes(newest.read_bytes()[:500])
    save_checkpoint(tmp_path / "checkpoint_best.pt", _state(999))
    path, found = find_resume_checkpoint(tmp_path)
    assert path.name == checkpoint_name(200) and found.progress.update == 200
    err = capsys.readouterr().err
    assert "skipping" in err and newest.name in err
    assert find_resume_checkpoint(tmp_path / "nothing") is None


def test_prune_keeps_newest(tmp_path):
    for u in range(1, 8):
        save_checkpoint(tmp_path / checkpoint_name(u * 10), _state(u * 10))
    (tmp_path / "checkpoint_best.pt").write_bytes(b"x")
    deleted = prune_checkpoints(tmp_path, 3)
    assert len(deleted) == 4
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [50, 60, 70]
    assert (tmp_path / "checkpoint_best.pt").exists()
    assert prune_checkpoints(tmp_path, 0) == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_an_unreadable_checkpoint_never_counts_toward_keep_last(tmp_path, capsys, damage):
    """keep_last 2 with the newest file damaged: the two newest good ones stay, the damaged one stays, warned about."""
    for u in (10, 20, 30, 40):
        save_checkpoint(tmp_path / checkpoint_name(u), _state(u))
    bad = tmp_path / checkpoint_name(40)
    data = bad.read_bytes()
    bad.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(2000), "empty": b""}[damage])
    assert checkpoint_problem(bad) and checkpoint_problem(tmp_path / checkpoint_name(30)) is None
    assert prune_checkpoints(tmp_path, 2) == [tmp_path / checkpoint_name(10)]
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [20, 30, 40]
    assert f"skipping {bad}: not a readable checkpoint" in capsys.readouterr().err
    save_checkpoint(tmp_path / checkpoint_name(50), _state(50))
    save_checkpoint(tmp_path / checkpoint_name(60), _state(60))
    prune_checkpoints(tmp_path, 2)  # the damaged file is now older than every kept one: it goes with them
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [50, 60]


def test_prune_deletes_nothing_while_too_few_readable_checkpoints_exist(tmp_path):
    save_checkpoint(tmp_path / checkpoint_name(10), _state(10))
    (tmp_path / checkpoint_name(20)).write_bytes(b"x")
    assert prune_checkpoints(tmp_path, 2) == []
    assert len(list_checkpoints(tmp_path)) == 2
