"""The WMT14 recipes: en-fr configs (Table 2 rows) and scripts/reproduce_wmt14.sh.

The script is run for real with a stand-in `tmt` on PATH that records its
arguments, so the test checks the exact stage commands without training.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from transformer_mt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "reproduce_wmt14.sh"


@pytest.mark.parametrize(
    ("name", "d_model", "heads", "dropout", "updates", "average"),
    [("en-fr-base", 512, 8, 0.1, 100_000, 5), ("en-fr-big", 1024, 16, 0.1, 300_000, 20)],
)
def test_en_fr_configs_are_the_papers(name, d_model, heads, dropout, updates, average):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("en", "fr")
    assert cfg.data.train == "data/wmt14_en_fr/train" and cfg.data.test == "data/wmt14_en_fr/newstest2014"
    assert cfg.data.valid == "data/wmt14_en_fr/newstest2013" and cfg.data.dir == "prepared/wmt14_en_fr"
    assert cfg.bpe.vocab_size == 32_000
    assert (cfg.model.d_model, cfg.model.heads, cfg.model.dropout) == (d_model, heads, dropout)
    assert (cfg.train.max_updates, cfg.train.average_last, cfg.train.save_every_minutes) == (updates, average, 10.0)
    assert cfg.train.max_tokens * cfg.train.update_freq == 25_000  # tokens per update on 1 GPU
    assert cfg.train.save_dir == f"runs/wmt14_en_fr_{name.rsplit('-', 1)[1]}"


def test_reproduce_en_de_base_on_8_gpus_runs_every_stage(run_recipe):
    code, err, calls = run_recipe(SCRIPT, "en-de", "base", "8", env_extra={"DOWNLOAD_ARGS": "--source statmt"})
    assert code == 0, err
    config = ROOT / "configs" / "base.yaml"
    assert calls == [
        "download wmt14 --pair en-de --out data/wmt14_en_de --source statmt",
        f"prepare {config}",
        f"train {config} --nproc-per-node 8 --set train.update_freq=1 --set train.save_every_minutes=0 "
        "--set train.save_every_updates=1500",
        "average runs/wmt14_en_de_base --last 5 -o runs/wmt14_en_de_base/average.pt",
        "evaluate newstest2014 -c runs/wmt14_en_de_base/average.pt -o runs/wmt14_en_de_base/eval --beam 4 "
        "--lenpen 0.6 --src data/wmt14_en_de/newstest2014.en --ref data/wmt14_en_de/newstest2014.de",
    ]
    assert "27.3" in err


@pytest.mark.parametrize(("gpus", "update_freq"), [("1", 8), ("2", 4), ("4", 2)])
@pytest.mark.slow
def test_reproduce_en_fr_big_keeps_25k_tokens_per_update(run_recipe, gpus, update_freq):
    code, err, calls = run_recipe(SCRIPT, "en-fr", "big", gpus)
    assert code == 0, err
    train = next(c for c in calls if c.startswith("train "))
    assert f"--set train.update_freq={update_freq}" in train and ("--nproc-per-node" in train) == (gpus != "1")
    assert "average runs/wmt14_en_fr_big --last 20 -o runs/wmt14_en_fr_big/average.pt" in calls
    assert "--set train.save_every_minutes=0 --set train.save_every_updates=600" in train  # the big pace
    assert calls[0] == "download wmt14 --pair en-fr --out data/wmt14_en_fr"


def test_train_args_come_after_the_checkpoint_spacing_and_override_it(run_recipe):
    code, err, calls = run_recipe(
        SCRIPT, "en-de", "base", env_extra={"TRAIN_ARGS": "--set train.save_every_updates=99"}
    )
    assert code == 0, err
    train = next(c for c in calls if c.startswith("train "))
    assert train.endswith("--set train.save_every_updates=1500 --set train.save_every_updates=99")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
@pytest.mark.parametrize("script", [SCRIPT, ROOT / "scripts" / "table3.sh"])
@pytest.mark.slow
def test_the_recipes_refuse_a_machine_without_gpus_before_downloading(run_recipe, tmp_path, script):
    args = ("en-de", "base") if script == SCRIPT else ("b_dk16",)
    code, err, calls = run_recipe(script, *args, env_extra={"ALLOW_CPU": ""})
    assert code == 2 and calls == []  # no tmt stage ran: nothing downloaded
    assert "sees 0 CUDA GPU(s)" in err and "set ALLOW_CPU=1 to go on anyway" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no data/ or runs/ either
    code, err, calls = run_recipe(script, *args, env_extra={"ALLOW_CPU": "1"})
    assert "going on because ALLOW_CPU=1" in err and calls[0].startswith("download wmt14 --pair en-de")


def test_reproduce_rejects_bad_arguments(run_recipe):
    for args in [(), ("en-de",), ("de-en", "base"), ("en-de", "huge"), ("en-de", "base", "zero")]:
        code, err, calls = run_recipe(SCRIPT, *args)
        assert code == 2 and calls == []
        assert "usage" in err or "error" in err


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_reproduce_script_is_shellcheck_clean():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
