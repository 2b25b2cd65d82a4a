"""Checkpoint averaging: element-wise mean in float64, key/shape checks, the `last K` choice and the CLI.

`read_average`'s own rules are tested on small hand-made states; what `tmt average` writes, on real tiny
Transformer checkpoints with the toy corpus's BPE model, since it refuses a mean that decoding could not load.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import load_state, save_state
from typer.testing import CliRunner

from transformer_mt.checkpoint import read_average, to_state
from transformer_mt.cli import app
from transformer_mt.config import Config, save_config
from transformer_mt.data.bpe import PAD, load_bpe_bytes
from transformer_mt.errors import UserError
from transformer_mt.model.transformer import Transformer
from transformer_mt.run_names import checkpoint_name
from transformer_mt.train.average import AverageError, average_checkpoints, last_checkpoints


@pytest.fixture(scope="module")
def toy(prepared_toy: Config) -> tuple[Config, bytes]:
    """The toy corpus's config and BPE model: what a real checkpoint of the tiny toy model carries."""
    return prepared_toy, (Path(prepared_toy.data.dir) / "spm.model").read_bytes()


def _ckpt(path, update, model, spm=b"spm", config=None):
    save_state(
        path,
        {
            "model": model,
            "config": config or {"train": {"seed": update}},
            "spm_model": torch.tensor(list(spm), dtype=torch.uint8),
            "update": update,
            "optimizer": {"state": {}, "param_groups": []},
            "rng": {"world_size": 1, "torch_cpu": []},
            "epoch": 1,
            "batch_in_epoch": 0,
        },
    )
    return path


def _model(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(5, 4, generator=g).to(dtype),
        "fc.bias": torch.randn(4, generator=g).to(dtype),
        "steps": torch.tensor([3], dtype=torch.long),
    }


def _config(toy, update) -> dict:
    cfg = toy[0]
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=update)).to_dict()


def _real_model(toy, seed, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The state of the toy config's tiny Transformer, random weights drawn from ``seed``."""
    cfg, spm = toy
    torch.manual_seed(seed)
    state = Transformer(cfg.model, load_bpe_bytes(spm).get_piece_size(), pad_id=PAD).state_dict()
    return {key: tensor.to(dtype) for key, tensor in state.items()}


def _real_ckpt(toy, path, update, model=None):
    """A checkpoint `tmt translate` could load: the toy model (``model``, or random weights), config and BPE model."""
    model = _real_model(toy, update) if model is None else model
    return _ckpt(path, update, model, spm=toy[1], config=_config(toy, update))


def test_mean_of_parameters(tmp_path, toy):
    models = [_real_model(toy, s) for s in (1, 2, 3)]
    updates = (30, 10, 20)
    paths = [_real_ckpt(toy, tmp_path / checkpoint_name(u), u, model=m) for u, m in zip(updates, models, strict=True)]
    out = tmp_path / "average.pt"
    average_checkpoints(paths, out)
    avg = load_state(out)
    assert avg["model"].keys() == models[0].keys()
    for key in models[0]:
        expected = torch.stack([m[key].double() for m in models]).mean(0).float()
        assert avg["model"][key].dtype == torch.float32
        assert torch.equal(avg["model"][key], expected)
    # metadata of the newest input (highest update), whatever the order given
    assert avg["update"] == 30 and avg["config"] == _config(toy, 30)
    assert bytes(avg["spm_model"].tolist()) == toy[1]
    assert "optimizer" not in avg and "epoch" not in avg and avg["averaged_from"] == [str(p) for p in paths]


def test_integer_buffers_are_copied_not_averaged(tmp_path):
    paths = [_ckpt(tmp_path / f"{u}.pt", u, _model(u)) for u in (1, 2)]
    assert torch.equal(read_average(paths).model["steps"], _model(1)["steps"])


def test_average_states_is_what_average_checkpoints_writes(tmp_path, toy):
    paths = [_real_ckpt(toy, tmp_path / f"{u}.pt", u) for u in (2, 1)]
    state = to_state(read_average(paths))
    assert not list(tmp_path.glob("avg*"))  # nothing written
    average_checkpoints(paths, tmp_path / "avg.pt")
    saved = load_state(tmp_path / "avg.pt")
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved["model"][k], state["model"][k]) for k in state["model"])
    assert saved["update"] == state["update"] == 2 and saved["config"] == state["config"]
    typed = read_average(paths)
    assert typed.progress.update == 2 and typed.training is None and typed.model.keys() == state["model"].keys()


def test_rejects_different_bpe_models(tmp_path):
    a = _ckpt(tmp_path / "a.pt", 1, _model(1), spm=b"one")
    b = _ckpt(tmp_path / "b.pt", 2, _model(2), spm=b"two")
    with pytest.raises(UserError, match=r"b\.pt: a different BPE model \(spm_model\) than .*a\.pt"):
        average_checkpoints([a, b], tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_rejects_different_integer_buffers(tmp_path):
    other = _model(2)
    other["steps"] = torch.tensor([4])
    a, b = _ckpt(tmp_path / "a.pt", 1, _model(1)), _ckpt(tmp_path / "b.pt", 2, other)
    with pytest.raises(UserError, match=r"b\.pt: integer buffer 'steps' differs"):
        average_checkpoints([a, b], tmp_path / "out.pt")


def test_bf16_is_cast_back_after_float64_accumulation(tmp_path, toy):
    models = [_real_model(toy, s, torch.bfloat16) for s in (4, 5)]
    paths = [_real_ckpt(toy, tmp_path / f"{i}.pt", i, model=m) for i, m in enumerate(models)]
    average_checkpoints(paths, tmp_path / "avg.pt")
    avg = load_state(tmp_path / "avg.pt")["model"]["embed.weight"]
    assert avg.dtype == torch.bfloat16
    pair = [m["embed.weight"].double() for m in models]
    assert torch.equal(avg, ((pair[0] + pair[1]) / 2).bfloat16())


@pytest.mark.parametrize("damage", ["integer weights", "missing layer"])
def test_refuses_a_mean_that_decoding_could_not_load(tmp_path, toy, damage):
    """Inputs that agree with each other but not with their config: refused, naming the weight, nothing written."""
    model = _real_model(toy, 1)
    key = "encoder.0.ffn.fc1.weight"
    if damage == "integer weights":
        model[key] = model[key].round().to(torch.int64)
    else:
        del model[key]
    paths = [_real_ckpt(toy, tmp_path / checkpoint_name(u), u, model=model) for u in (1, 2)]
    result = CliRunner().invoke(app, ["average", str(tmp_path), "--last", "2"])
    assert result.exit_code != 0
    message = " ".join(result.output.split())
    assert str(paths[0]) in message and "does not fit the model its config describes" in message
    assert key in message and not (tmp_path / "average.pt").exists()


def test_rejects_mismatched_keys(tmp_path):
    a = _ckpt(tmp_path / "a.pt", 1, _model(1))
    other = _model(2)
    other["extra.weight"] = torch.zeros(2)
    b = _ckpt(tmp_path / "b.pt", 2, other)
    with pytest.raises(UserError, match=r"b\.pt.*extra\.weight"):
        average_checkpoints([a, b], tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_rejects_mismatched_shapes(tmp_path):
    a = _ckpt(tmp_path / "a.pt", 1, _model(1))
    other = _model(2)
    other["fc.bias"] = torch.zeros(5)
    b = _ckpt(tmp_path / "b.pt", 2, other)
    with pytest.raises(UserError, match=r"b\.pt.*fc\.bias.*\(5,\)"):
        average_checkpoints([a, b], tmp_path / "out.pt")


def test_rejects_corrupt_input(tmp_path):
    a = _ckpt(tmp_path / "a.pt", 1, _model(1))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="bad.pt"):
        average_checkpoints([a, bad], tmp_path / "out.pt")


def test_last_checkpoints(tmp_path, capsys):
    for u in (100, 900, 300, 1200, 50):
        _ckpt(tmp_path / checkpoint_name(u), u, _model(u))
    _ckpt(tmp_path / "checkpoint_best.pt", 5000, _model(0))
    _ckpt(tmp_path / "average.pt", 5000, _model(0))
    assert [p.name for p in last_checkpoints(tmp_path, 3)] == [checkpoint_name(u) for u in (300, 900, 1200)]
    assert len(last_checkpoints(tmp_path, 9)) == 5
    assert "fewer than --last 9" in capsys.readouterr().err
    best_only = tmp_path / "best_only"
    best_only.mkdir()
    _ckpt(best_only / "checkpoint_best.pt", 1, _model(0))
    with pytest.raises(AverageError, match="no checkpoint_u"):
        last_checkpoints(best_only, 3)


def test_last_checkpoints_passes_over_unreadable_files(tmp_path, capsys, toy):
    """--last 2 with the newest file truncated: the two newest readable ones are averaged, the bad one named."""
    for u in (10, 20, 30):
        _real_ckpt(toy, tmp_path / checkpoint_name(u), u)
    bad = tmp_path / checkpoint_name(30)
    bad.write_bytes(bad.read_bytes()[:300])
    assert last_checkpoints(tmp_path, 2) == [tmp_path / checkpoint_name(u) for u in (10, 20)]
    assert f"skipping {bad}" in capsys.readouterr().err
    result = CliRunner().invoke(app, ["average", str(tmp_path), "--last", "2"])
    assert result.exit_code == 0, result.output
    assert load_state(tmp_path / "average.pt")["update"] == 20
    for u in (10, 20):
        (tmp_path / checkpoint_name(u)).write_bytes(b"")
    with pytest.raises(AverageError, match="no readable checkpoint_u"):
        last_checkpoints(tmp_path, 2)


def test_cli_average(tmp_path, toy):
    for u in (10, 20, 30):
        _real_ckpt(toy, tmp_path / checkpoint_name(u), u)
    cfg = Config()
    cfg.train.average_last = 2
    save_config(cfg, tmp_path / "config.yaml")
    result = CliRunner().invoke(app, ["average", str(tmp_path)])  # --last from the run's train.average_last
    assert result.exit_code == 0, result.output
    avg = load_state(tmp_path / "average.pt")
    assert avg["averaged_from"] == [str(tmp_path / checkpoint_name(u)) for u in (20, 30)]
    out = tmp_path / "two.pt"
    a, b = (str(tmp_path / checkpoint_name(u)) for u in (10, 30))
    result = CliRunner().invoke(app, ["average", a, b, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert load_state(out)["update"] == 30
    result = CliRunner().invoke(app, ["average", str(tmp_path), "--last", "3", "-o", str(out)])
    assert len(load_state(out)["averaged_from"]) == 3
    result = CliRunner().invoke(app, ["average", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "no such run directory" in result.output
    result = CliRunner().invoke(app, ["average", a, b, "--last", "2"])
    assert result.exit_code == 2 and "--last 2 picks checkpoints of a run directory" in result.output


def test_cli_average_of_checkpoint_files_writes_to_the_working_directory(tmp_path, monkeypatch, toy):
    a, b = (_real_ckpt(toy, tmp_path / checkpoint_name(u), u) for u in (10, 20))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = CliRunner().invoke(app, ["average", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert load_state(work / "average.pt")["update"] == 20
    help_text = CliRunner().invoke(app, ["average", "--help"]).output
    assert "./average.pt" in " ".join(help_text.split())  # the help says so
