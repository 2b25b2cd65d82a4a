"""Checkpoint files: the typed contents and their checks, round trip, atomic writes, corrupt and crafted files."""

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
from helpers import load_state, save_state

from transformer_mt.checkpoint import (
    Batching,
    Checkpoint,
    CheckpointError,
    RngState,
    TrainingProgress,
    TrainingState,
    checkpoint_problem,
    from_state,
    read_checkpoint,
    to_state,
    write_checkpoint,
)
from transformer_mt.config import Config, config_from_dict


def _state(update: int) -> dict:
    """A training checkpoint as an older `tmt train` wrote it: no minutes, batching, validation history or BLEU."""
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
    path = tmp_path / "checkpoint_u0001200.pt"
    ck = from_state(_state(1200), path)
    write_checkpoint(path, ck)
    assert _equal(load_state(path), to_state(ck))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_an_older_checkpoint_reads_with_defaults_for_the_entries_added_since(tmp_path):
    path = tmp_path / "old.pt"
    save_state(path, _state(1200))
    ck = read_checkpoint(path)
    assert ck.spm_model == b"\x00spm\xff" and ck.config == config_from_dict(_state(1)["config"])
    assert (ck.progress.update, ck.progress.epoch, ck.progress.batch_in_epoch) == (1200, 2, 17)
    assert ck.progress.minutes == 0.0 and ck.progress.valid_history == [] and ck.progress.stale_validations == 0
    assert ck.progress.best_valid_bleu == -math.inf and ck.progress.valid_loss is None
    assert ck.training is not None and ck.training.batching is None and ck.training.rng.world_size == 1
    assert ck.training.rng.torch_cuda is None


def test_typed_round_trip(tmp_path):
    progress = TrainingProgress(
        update=7, epoch=3, batch_in_epoch=2, valid_loss=4.5, minutes=1.5, valid_history=[[5, 4.0]]
    )
    training = TrainingState(
        optimizer={"state": {}, "param_groups": []},
        rng=RngState(world_size=2, torch_cpu=[]),
        batching=Batching(max_tokens=9, seed=1, max_len=8, sentences=5, lengths="ab", batches=3),
    )
    ck = Checkpoint({"w": torch.ones(2)}, Config(), b"spm", progress, training)
    write_checkpoint(tmp_path / "a.pt", ck)
    back = read_checkpoint(tmp_path / "a.pt")
    assert back.progress == progress and back.training == training and back.spm_model == b"spm"
    assert torch.equal(back.model["w"], ck.model["w"]) and back.averaged_from == []
    assert back.config == Config()


def test_the_typed_entries_are_stored_as_before(tmp_path):
    """`Config`, `RngState` and `Batching` are dicts on disk, of the keys an older `tmt train` wrote."""
    cpu, cuda = [torch.get_rng_state()], [torch.zeros(16, dtype=torch.uint8)]
    key = {"max_tokens": 9, "seed": 1, "max_len": 8, "sentences": 5, "lengths": "ab", "batches": 3}
    training = TrainingState({"state": {}, "param_groups": []}, RngState(1, cpu), batching=Batching(**key))
    state = to_state(Checkpoint({"w": torch.ones(2)}, Config(), b"spm", TrainingProgress(update=1), training))
    assert state["config"] == Config().to_dict() and state["batching"] == key
    assert state["rng"].keys() == {"world_size", "torch_cpu"} and state["scaler"] == {}
    sampled = dataclasses.replace(training, rng=RngState(1, cpu, cuda), batching=Batching(**key, sampling_alpha=0.5))
    state = to_state(Checkpoint({"w": torch.ones(2)}, Config(), b"spm", TrainingProgress(update=1), sampled))
    assert state["batching"] == {**key, "sampling_alpha": 0.5} and state["rng"]["torch_cuda"] is cuda
    save_state(tmp_path / "a.pt", state)
    assert read_checkpoint(tmp_path / "a.pt").training.batching == Batching(**key, sampling_alpha=0.5)


def test_without_training_state_only_the_update_is_stored(tmp_path):
    ck = Checkpoint({"w": torch.ones(2)}, Config(), b"spm", TrainingProgress(update=9, epoch=4), averaged_from=["a.pt"])
    assert set(to_state(ck)) == {"model", "config", "spm_model", "update", "averaged_from"}
    write_checkpoint(tmp_path / "avg.pt", ck)
    back = read_checkpoint(tmp_path / "avg.pt")
    assert back.training is None and back.progress == TrainingProgress(update=9) and back.averaged_from == ["a.pt"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("config"), "has no 'config' entry"),
        (lambda s: s.pop("spm_model"), "has no 'spm_model' entry"),
        (lambda s: s.update(config="en-de"), "'config' entry is a str, not dict"),
        (lambda s: s.update(spm_model=b"spm"), "'spm_model' entry is a bytes, not Tensor"),
        (lambda s: s.update(spm_model=torch.zeros(3)), "'spm_model' entry is not the bytes of a BPE model"),
        (lambda s: s.update(model=[torch.zeros(1)]), "'model' entry is a list, not dict"),
        (lambda s: s.update(model={"w": 1.0}), "'model' entry is not a state dict"),
        (lambda s: s.pop("epoch"), "has no 'epoch' entry"),
        (lambda s: s.update(update=True), "'update' entry is a bool, not int"),
        (lambda s: s.update(valid_history=[[1]]), "'valid_history' entry is not a list of"),
        (lambda s: s.update(rng={}), "'rng' entry lacks 'world_size'"),
        (lambda s: s["rng"].update(torch_cuda="x"), "'rng' entry's 'torch_cuda' is not a list of generator states"),
        (lambda s: s.update(batching={"seed": 1}), "'batching' entry's 'max_tokens' is missing or mistyped"),
        (lambda s: s.update(config={"model": {"heads": 0}}), "'config' entry is not a valid config: model.heads"),
        (lambda s: s.update(config={"modle": {}}), "'config' entry is not a valid config: unknown section 'modle'"),
        (lambda s: s.update(optimizer={"state": []}), "'optimizer' entry is not an optimizer's state dict"),
    ],
)
def test_a_crafted_checkpoint_is_refused_naming_the_file_and_the_entry(tmp_path, change, message):
    state = _state(3)
    change(state)
    path = tmp_path / "crafted.pt"
    save_state(path, state)
    with pytest.raises(CheckpointError, match=f"crafted\\.pt: .*{message}"):
        read_checkpoint(path)
    assert message in checkpoint_problem(path)  # retention and `tmt average --last` pass over it, too
    with pytest.raises(CheckpointError, match="not written by `tmt train`"):
        from_state(state, path)


def test_failed_write_leaves_old_file_and_no_partial(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint_u0000005.pt"
    save_state(path, _state(5))
    before = path.read_bytes()

    def exploding_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", exploding_save)
    with pytest.raises(CheckpointError, match=str(path)):
        write_checkpoint(path, from_state(_state(6), path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "new.pt"

    def interrupted(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(path, from_state(_state(1), path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_names_it(tmp_path, damage):
    path = tmp_path / "checkpoint_u0000007.pt"
    save_state(path, _state(7))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(2000), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=str(path)):
        read_checkpoint(path)


def test_code_in_a_pickle_is_never_run(tmp_path):
    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Evil()}, path)
    with pytest.raises(CheckpointError, match="evil.pt"):
        read_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


class _Code:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize(
    "content, reason",
    [
        (lambda path: torch.save({"model": {}, "x": _Code()}, path), "it holds Python objects other than tensors"),
        (lambda path: path.write_bytes(b"PK\x03\x04" + os.urandom(500)), "truncated, corrupt or not a checkpoint"),
        (lambda path: path.write_text("hello"), "a text file (a config?), not a checkpoint"),
    ],
)
def test_an_unreadable_file_never_echoes_the_advice_to_load_it_unsafely(tmp_path, content, reason):
    path = tmp_path / "bad.pt"
    content(path)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert f"bad.pt: {reason}" in str(err.value) or f"bad.pt: not a readable checkpoint: {reason}" in str(err.value)
    assert "weights_only" not in str(err.value) and "trusted source" not in str(err.value)
    assert "delete" not in str(err.value)  # not a file tmt wrote: never advise deleting it


def test_deleting_is_advised_only_for_a_run_s_own_truncated_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    for name in ("checkpoint_u0000100.pt", "average.pt", "mine.pt"):
        (run / name).write_bytes(b"PK\x03\x04" + b"\x01" * 300)
        with pytest.raises(CheckpointError) as err:
            read_checkpoint(run / name)
        assert ("delete it" in str(err.value)) == (name != "mine.pt"), str(err.value)
    config = tmp_path / "my.yaml"
    config.write_text("base: base.yaml\ntrain:\n  max_updates: 10\n")
    with pytest.raises(CheckpointError, match=r"my\.yaml: a text file \(a config\?\), not a checkpoint") as err:
        read_checkpoint(config)
    assert "delete" not in str(err.value)


def test_not_a_tmt_checkpoint(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="no 'model' entry"):
        read_checkpoint(path)
