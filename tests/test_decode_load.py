"""`decode.load`: the one checkpoint loader of every decode path, and the decoding flags as overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from transformer_mt.checkpoint import read_average
from transformer_mt.config import ConfigError
from transformer_mt.decode.load import (
    LoadError,
    change_decode,
    for_decoding,
    load_ensemble,
    load_model,
    override_config,
)
from transformer_mt.errors import UserError
from transformer_mt.model.onednn import OneDnnLinear, onednn_available

pytestmark = pytest.mark.usefixtures("one_thread")


def test_load_model_is_the_trained_fp32_model(toy_ckpt: Path) -> None:
    loaded = load_model([toy_ckpt], device="cpu")
    assert not loaded.model.training and loaded.device == torch.device("cpu")
    assert not any(isinstance(m, OneDnnLinear) for m in loaded.model.modules())  # what an export must receive
    stored = read_average([toy_ckpt])
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, stored.model[name]), name
    assert loaded.spm_model == stored.spm_model and loaded.bpe.get_piece_size() == loaded.model.vocab_size
    assert loaded.config.model == stored.config.model


@pytest.mark.skipif(not onednn_available(), reason="oneDNN Linear layers need an x86-64 CPU build of torch")
def test_for_decoding_swaps_layers_with_the_same_outputs(toy_ckpt: Path) -> None:
    plain = load_model([toy_ckpt], device="cpu")
    fast = for_decoding(load_model([toy_ckpt], device="cpu").model, plain.config)
    assert any(isinstance(m, OneDnnLinear) for m in fast.modules())
    assert sum(isinstance(m, nn.Linear) for m in plain.model.modules()) > 0
    src = torch.tensor([[5, 6, 7, 3]])
    tgt = torch.tensor([[2, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(fast(src, tgt), plain.model(src, tgt), rtol=1e-5, atol=1e-5)


def test_overrides_are_checked_once(toy_ckpt: Path) -> None:
    assert load_model([toy_ckpt], "cpu", ["decode.beam_size=2"]).config.decode.beam_size == 2
    with pytest.raises(ConfigError, match="only takes decode"):
        load_model([toy_ckpt], "cpu", ["train.lr=1"])
    with pytest.raises(
        ConfigError, match=r"decode\.nbest \(--nbest\) \(5\) .* cannot exceed decode\.beam_size \(--beam\) \(4\)"
    ):
        load_model([toy_ckpt], "cpu", ["decode.beam_size=4", "decode.nbest=5"])
    with pytest.raises(LoadError, match="no checkpoint given"):
        load_model([], "cpu")
    with pytest.raises(LoadError, match="--device cuda:7"):
        load_model([toy_ckpt], "cuda:7")


def test_ensemble_members_share_the_first_decode_settings(toy_ckpt: Path) -> None:
    members = load_ensemble([toy_ckpt, toy_ckpt], "cpu", ["decode.len_penalty=0.3"])
    assert len(members) == 2 and all(m.config.decode.len_penalty == 0.3 for m in members)
    assert members[0].model is not members[1].model


def test_a_run_directory_stands_for_its_average_then_its_best(toy_ckpt: Path, tmp_path: Path, capsys) -> None:
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(UserError, match="is a directory, not a checkpoint file; pass one of its checkpoint_u"):
        load_model([run], "cpu")
    shutil.copy(toy_ckpt, run / "checkpoint_best.pt")
    assert load_model([run], "cpu").config.model.d_model > 0
    assert f"decoding with {run / 'checkpoint_best.pt'}" in capsys.readouterr().err
    shutil.copy(toy_ckpt, run / "average.pt")
    load_model([run], "cpu")
    assert f"decoding with {run / 'average.pt'}" in capsys.readouterr().err


def test_typed_decode_changes_follow_the_override_rules(toy_ckpt: Path) -> None:
    """A server request's typed changes settle as the same ``--set`` overrides would: a smaller beam shortens the
    stored n-best, a sample takes no beam unless one is given, and the result is validated."""
    cfg = override_config(load_model([toy_ckpt], "cpu").config, ["decode.beam_size=4", "decode.nbest=3"])
    for changes, texts in (
        ({"beam_size": 2}, ["decode.beam_size=2"]),
        ({"sampling": "topk:5"}, ["decode.sampling=topk:5"]),
        (
            {"sampling": "topk:5", "beam_size": 1, "nbest": 3},
            ["decode.sampling=topk:5", "decode.beam_size=1", "decode.nbest=3"],
        ),
        ({"len_penalty": 1.0}, ["decode.len_penalty=1.0"]),
    ):
        assert change_decode(cfg, changes) == override_config(cfg, texts), changes
    assert change_decode(cfg, {"beam_size": 2}).decode.nbest == 2
    with pytest.raises(ConfigError, match="takes no beam"):
        change_decode(cfg, {"sampling": "topk:5", "beam_size": 3})
