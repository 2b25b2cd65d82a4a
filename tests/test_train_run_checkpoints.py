"""A run directory's checkpoints: names, resume search and pruning (the files themselves: test_checkpoint.py)."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import load_state, save_state
from test_checkpoint import _state

from transformer_mt.checkpoint import checkpoint_problem, read_checkpoint
from transformer_mt.run_names import BEST_NAME, checkpoint_name
from transformer_mt.train import run_checkpoints as ck
from transformer_mt.train.run_checkpoints import (
    find_resume_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    strip_older_checkpoints,
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
        save_state(tmp_path / checkpoint_name(u), _state(u))
    newest = tmp_path / checkpoint_name(300)
    newest.write_bytes(newest.read_bytes()[:500])
    save_state(tmp_path / "checkpoint_best.pt", _state(999))
    path, found = find_resume_checkpoint(tmp_path)
    assert path.name == checkpoint_name(200) and found.progress.update == 200
    err = capsys.readouterr().err
    assert "skipping" in err and newest.name in err
    assert find_resume_checkpoint(tmp_path / "nothing") is None


def test_prune_keeps_newest(tmp_path):
    for u in range(1, 8):
        save_state(tmp_path / checkpoint_name(u * 10), _state(u * 10))
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
        save_state(tmp_path / checkpoint_name(u), _state(u))
    bad = tmp_path / checkpoint_name(40)
    data = bad.read_bytes()
    bad.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(2000), "empty": b""}[damage])
    assert checkpoint_problem(bad) and checkpoint_problem(tmp_path / checkpoint_name(30)) is None
    assert prune_checkpoints(tmp_path, 2) == [tmp_path / checkpoint_name(10)]
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [20, 30, 40]
    assert f"skipping {bad}: not a readable checkpoint" in capsys.readouterr().err
    save_state(tmp_path / checkpoint_name(50), _state(50))
    save_state(tmp_path / checkpoint_name(60), _state(60))
    prune_checkpoints(tmp_path, 2)  # the damaged file is now older than every kept one: it goes with them
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [50, 60]


def test_prune_deletes_nothing_while_too_few_readable_checkpoints_exist(tmp_path):
    save_state(tmp_path / checkpoint_name(10), _state(10))
    (tmp_path / checkpoint_name(20)).write_bytes(b"x")
    assert prune_checkpoints(tmp_path, 2) == []
    assert len(list_checkpoints(tmp_path)) == 2


def _big_state(update: int) -> dict:
    """A training checkpoint whose optimizer holds two moments as large as the weights, as Adam's do."""
    state = _state(update)
    g = torch.Generator().manual_seed(update)
    state["model"] = {"w": torch.randn(256, 256, generator=g)}
    moments = {"step": torch.tensor(3.0), "exp_avg": torch.randn(256, 256), "exp_avg_sq": torch.rand(256, 256)}
    state["optimizer"] = {"state": {0: moments}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    state["minutes"] = 1.5 * update
    return state


def test_only_the_newest_periodic_checkpoint_and_the_best_keep_the_training_state(tmp_path):
    for u in (10, 20, 30):
        save_state(tmp_path / checkpoint_name(u), _big_state(u))
    save_state(tmp_path / BEST_NAME, _big_state(20))
    full = (tmp_path / checkpoint_name(10)).stat().st_size
    newest = tmp_path / checkpoint_name(30)
    assert strip_older_checkpoints(tmp_path, newest) == [tmp_path / checkpoint_name(u) for u in (10, 20)]
    for u in (10, 20):
        path = tmp_path / checkpoint_name(u)
        stripped, before = read_checkpoint(path), _big_state(u)
        assert stripped.training is None and "optimizer" not in load_state(path)
        assert (
            torch.equal(stripped.model["w"], before["model"]["w"])
            and stripped.config.to_dict() == load_state(path)["config"]
        )
        assert stripped.spm_model == b"\x00spm\xff"  # translation and averaging need nothing else
        assert (stripped.progress.update, stripped.progress.epoch, stripped.progress.minutes) == (u, 2, 1.5 * u)
        assert path.stat().st_size < full / 2.5  # the weights are a third of weights + two moments
    assert read_checkpoint(newest).training is not None and read_checkpoint(tmp_path / BEST_NAME).training is not None
    assert strip_older_checkpoints(tmp_path, newest) == []  # nothing left to strip
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_NAME, *(checkpoint_name(u) for u in (10, 20, 30))]


def test_nothing_is_stripped_until_the_newest_checkpoint_reads_back(tmp_path):
    for u in (10, 20):
        save_state(tmp_path / checkpoint_name(u), _big_state(u))
    newest = tmp_path / checkpoint_name(20)
    newest.write_bytes(newest.read_bytes()[:2000])
    assert strip_older_checkpoints(tmp_path, newest) == []
    assert read_checkpoint(tmp_path / checkpoint_name(10)).training is not None


def test_resume_takes_the_best_checkpoint_when_the_newest_is_unreadable_and_the_rest_stripped(tmp_path, capsys):
    for u in (10, 20, 30):
        save_state(tmp_path / checkpoint_name(u), _big_state(u))
    strip_older_checkpoints(tmp_path, tmp_path / checkpoint_name(30))
    (tmp_path / checkpoint_name(30)).write_bytes(b"damaged")
    save_state(tmp_path / BEST_NAME, _big_state(25))
    path, found = find_resume_checkpoint(tmp_path)
    assert path.name == BEST_NAME and found.progress.update == 25 and found.training is not None
    assert f"skipping {tmp_path / checkpoint_name(30)}" in capsys.readouterr().err
    # a best checkpoint older than a readable weights-only one would rewind past it: the trainer refuses that one
    save_state(tmp_path / BEST_NAME, _big_state(15))
    path, found = find_resume_checkpoint(tmp_path)
    assert path.name == checkpoint_name(20) and found.training is None


_KILLED_IN_STRIP = """
import os, signal, sys
from transformer_mt.train.run_checkpoints import strip_older_checkpoints
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed once the stripped copy is written
strip_older_checkpoints(sys.argv[1], __import__("pathlib").Path(sys.argv[2]))
"""


def test_a_kill_while_stripping_leaves_every_checkpoint_whole_and_the_run_resumable(tmp_path):
    for u in (10, 20):
        save_state(tmp_path / checkpoint_name(u), _big_state(u))
    newest = tmp_path / checkpoint_name(20)
    child = subprocess.run([sys.executable, "-c", _KILLED_IN_STRIP, str(tmp_path), str(newest)], check=False)
    assert child.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{checkpoint_name(10)}.")  # killed mid-way
    assert read_checkpoint(tmp_path / checkpoint_name(10)).training is not None  # the old file, whole
    path, found = find_resume_checkpoint(tmp_path)
    assert path == newest and found.training is not None
    assert strip_older_checkpoints(tmp_path, newest) == [tmp_path / checkpoint_name(10)]  # the next save's turn
