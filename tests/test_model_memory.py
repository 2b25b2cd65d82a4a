"""A model too large for the machine is refused before it is allocated: one line with its size and the memory
left, never torch's allocation error after a 51 GB request. The sizes are real (hundreds of GB): no machine
that runs these tests has that much memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from helpers import assert_user_error, load_state, save_state, tmt

from transformer_mt.config import Config
from transformer_mt.model.transformer import Transformer, model_bytes

HUGE = ["--set", "model.d_model=65536", "--set", "model.heads=8"]  # inside the range checks: 825 GB to train


def test_model_bytes_counts_what_the_model_allocates_without_allocating_it(prepared_toy: Config) -> None:
    model = Transformer(prepared_toy.model, 300)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    assert model_bytes(prepared_toy.model, 300) == sum(t.numel() * t.element_size() for t in tensors)
    huge = dataclasses.replace(prepared_toy.model, d_model=65536, heads=8)
    assert model_bytes(huge, 300) > 100e9  # counted on the meta device: this test would not run otherwise


def test_training_a_model_larger_than_memory_is_one_line_before_building_it(
    prepared_toy: Config, tmp_path: Path
) -> None:
    config = tmp_path / "toy.yaml"
    config.write_text(prepared_toy.to_yaml(), encoding="utf-8")
    done = tmt(
        "train", str(config), *HUGE, "--set", f"train.save_dir={tmp_path / 'run'}", "--set", "train.num_threads=1"
    )
    line = assert_user_error(
        done, "training the model of this config (model.d_model 65536", "with its gradients and Adam's two moments",
        "GB of memory available", "make the model smaller",
    )  # fmt: skip
    assert " would take 8" in line  # 825.5 GB


def test_a_checkpoint_whose_config_describes_a_huge_model_is_refused_before_allocating(
    toy_ckpt: Path, tmp_path: Path
) -> None:
    state = load_state(toy_ckpt)
    state["config"]["model"].update(d_model=65536, heads=8)
    save_state(tmp_path / "huge.pt", state)
    source = tmp_path / "in.en"
    source.write_text("a b c\n", encoding="utf-8")
    for command in (["translate", "-i", str(source)], ["evaluate", "x", "--src", str(source), "--ref", str(source)]):
        done = tmt(*command, "-c", str(tmp_path / "huge.pt"), "-o", str(tmp_path / "out"))
        assert_user_error(done, "huge.pt: the 'model' entry does not fit the model its config describes")
