"""Checkpoint files: round trip, atomic writes, corrupt files, resume search and pruning."""

import os
from pathlib import Path

import pytest
import torch

from transformer_mt.train import checkpoint as ck
from transformer_mt.train.checkpoint import (
    CheckpointError,
    checkpoint_name,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


def _state(update: int) -> dict:
    g = torch.Generator().manual_seed(update)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "config": {"train": {"seed": 1, "lr_scale": 1.0, "precision": "auto"}},
        "spm_model": torch.tensor(list(b"\x00spm\xff"), dtype=torch.uint8),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "update": update,
        "epoch": 2,
        "batch_in_epoch": 17,
        "scaler": {},
        "rng": {"world_size": 1, "torch_cpu": [torch.get_rng_state()]},
        "best_valid_loss": float("inf"),
        "valid_loss": None,
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_round_trip(tmp_path):
    state = _state(1200)
    path = tmp_path / checkpoint_name(1200)
    save_checkpoint(path, state)
    assert path.name == "checkpoint_u0001200.pt"
    assert _equal(load_checkpoint(path), state)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_names_sort_by_update(tmp_path):
    for u in (100, 20, 3000, 1200):
        (tmp_path / checkpoint_name(u)).write_bytes(b"x")
    (tmp_path / "checkpoint_best.pt").write_bytes(b"x")
    (tmp_path / "average.pt").write_bytes(b"x")
    assert [ck.checkpoint_update(p) for p in list_checkpoints(tmp_path)] == [20, 100, 1200, 3000]
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == [p.name for p in list_checkpoints(tmp_path)]


def test_failed_write_leaves_old_file_and_no_partial(tmp_path, monkeypatch):
    path = tmp_path / checkpoint_name(5)
    save_checkpoint(path, _state(5))
    before = path.read_bytes()

    def exploding_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", exploding_save)
    with pytest.raises(CheckpointError, match=str(path)):
        save_checkpoint(path, _state(6))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "new.pt"

    def interrupted(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, _state(1))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_names_it(tmp_path, damage):
    path = tmp_path / checkpoint_name(7)
    save_checkpoint(path, _state(7))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(2000), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_code_in_a_pickle_is_never_run(tmp_path):
    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Evil()}, path)
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_not_a_tmt_checkpoint(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="no 'model' entry"):
        load_checkpoint(path)


def test_resume_skips_corrupt_newest(tmp_path, capsys):
    for u in (100, 200, 300):
        save_checkpoint(tmp_path / checkpoint_name(u), _state(u))
    newest = tmp_path / checkpoint_name(300)
    newest.write_bytes(newest.read_bytes()[:500])
    save_checkpoint(tmp_path / "checkpoint_best.pt", _state(999))
    path, state = find_resume_checkpoint(tmp_path)
    assert path.name == checkpoint_name(200) and state["update"] == 200
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
    assert ck.checkpoint_problem(bad) and ck.checkpoint_problem(tmp_path / checkpoint_name(30)) is None
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
