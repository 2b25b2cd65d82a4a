"""The training loop on the prepared toy corpus: learning, exact resume, stop rules and user-facing errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_state, metric_records, run_config, save_state

from transformer_mt.config import Config, ConfigError, load_config
from transformer_mt.data.batching import resume_position, too_long
from transformer_mt.data.dataset import Batch, ParallelDataset
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import UserError
from transformer_mt.metrics import corpus_sacrebleu
from transformer_mt.model.transformer import Transformer, count_parameters, flops_per_token
from transformer_mt.run_names import BEST_NAME, checkpoint_name
from transformer_mt.train.average import average_checkpoints
from transformer_mt.train.budget import clock_marks, close_behind
from transformer_mt.train.distributed import DistEnv, setup
from transformer_mt.train.run_checkpoints import checkpoint_update, list_checkpoints
from transformer_mt.train.run_files import batching_changes, batching_key
from transformer_mt.train.run_log import Window, bleu_share, final_warnings
from transformer_mt.train.step import (
    Stepper,
    TrainError,
    UpdateStats,
    accumulate_gradients,
    apply_gradients,
    cpu_has_bf16,
    resolve_precision,
)
from transformer_mt.train.trainer import Trainer, train_model
from transformer_mt.train.validation import unconverged


@pytest.mark.slow
def test_one_epoch_lowers_validation_loss_and_writes_the_run(prepared_toy, tmp_path):
    run = tmp_path / "run"
    cfg = run_config(
        prepared_toy, run, max_updates=0, max_epochs=1, update_freq=2, validate_every=5, save_every_updates=20,
        keep_last=2, log_every=10,
    )  # fmt: skip
    result = train_model(cfg)
    last = load_state(run / checkpoint_name(result.update))
    # stopped by max_epochs, after every batch of epoch 1, grouped 2 per update
    assert result.stop_reason == "max_epochs=1" and last["epoch"] == 1
    assert result.update == math.ceil(last["batch_in_epoch"] / 2) > 40
    valid = [m for m in metric_records(run) if m["kind"] == "valid"]
    assert [m["update"] for m in valid] == [*range(5, result.update + 1, 5), result.update]
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.5
    assert result.valid_loss == pytest.approx(valid[-1]["loss"])
    assert valid[-1]["ppl"] == pytest.approx(math.exp(valid[-1]["nll"]))
    train = [m for m in metric_records(run) if m["kind"] == "train"]
    assert [m["update"] for m in train] == list(range(10, result.update + 1, 10))
    assert all(m["tgt_tokens_per_s"] > 0 and m["lr"] > 0 and m["nll"] < m["loss"] for m in train)
    # keep_last=2 periodic checkpoints (the final one included) + the best one; each is self-contained
    assert [p.name for p in list_checkpoints(run)] == [checkpoint_name(40), checkpoint_name(result.update)]
    best = load_state(run / BEST_NAME)
    assert best["valid_loss"] == pytest.approx(min(m["loss"] for m in valid))
    spm = (Path(prepared_toy.data.dir) / "spm.model").read_bytes()
    assert bytes(last["spm_model"].tolist()) == spm
    assert last["config"] == cfg.to_dict()
    assert (run / "config.yaml").read_text() == cfg.to_yaml()


@pytest.mark.slow
def test_resume_is_bit_identical_even_from_an_older_checkpoint(prepared_toy, tmp_path, capsys):
    """12 updates, crash, resume, 12 more == 24 straight (dropout on, update_freq 2, crossing an epoch).

    Every periodic checkpoint newer than the best validation (5 or 10) is damaged and the older ones hold only
    weights, so the run resumes from the best one, which keeps its training state.
    """
    common = dict(max_tokens=2048, update_freq=2, validate_every=5, save_every_updates=4, log_every=4, keep_last=50)
    assert prepared_toy.model.dropout > 0
    straight = tmp_path / "straight"
    train_model(run_config(prepared_toy, straight, max_updates=24, **common))

    interrupted = tmp_path / "interrupted"
    train_model(run_config(prepared_toy, interrupted, max_updates=12, **common))
    best = min((m for m in metric_records(interrupted) if m["kind"] == "valid"), key=lambda m: m["loss"])["update"]
    assert best < 12, "the validation at the end was the best: this test needs an earlier best"
    newer = [path for path in list_checkpoints(interrupted) if checkpoint_update(path) > best]
    for path in newer:
        path.write_bytes(path.read_bytes()[:1000])  # the crash cut them short
    capsys.readouterr()
    result = train_model(run_config(prepared_toy, interrupted, max_updates=24, **common))
    err = capsys.readouterr().err
    assert all(f"skipping {path}" in err for path in newer)
    assert f"resuming from {interrupted / BEST_NAME} at update {best}" in err
    assert result.epoch == 2  # the run crossed into the second epoch

    a = load_state(straight / checkpoint_name(24))
    b = load_state(interrupted / checkpoint_name(24))
    assert (a["epoch"], a["batch_in_epoch"]) == (b["epoch"], b["batch_in_epoch"])
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    for i, state in a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], b["optimizer"]["state"][i]["exp_avg_sq"])
    assert torch.equal(a["rng"]["torch_cpu"][0], b["rng"]["torch_cpu"][0])

    # the metrics of the replayed updates are not duplicated; each process adds its start record
    def trajectory(run):
        return [(m["kind"], m["update"]) for m in metric_records(run) if m["kind"] in ("train", "valid")]

    assert trajectory(interrupted) == trajectory(straight)
    assert [m["update"] for m in metric_records(interrupted) if m["kind"] == "start"] == [0, best]


_KILLED_BEFORE_STRIPPING = """
import os, signal, sys
from transformer_mt.config import load_config
from transformer_mt.train import trainer

saves = []
def killed(run_dir, newest):  # the second save: its checkpoint written, the one before not yet stripped
    saves.append(newest)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
trainer.strip_older_checkpoints = killed
trainer.train_model(load_config(sys.argv[1]))
"""


@pytest.mark.slow
def test_resume_after_a_kill_between_writing_a_checkpoint_and_stripping_the_one_before(prepared_toy, tmp_path):
    """Killed at update 8 with checkpoints 4 and 8 both whole: the resumed run equals a straight one."""
    common = dict(max_tokens=2048, validate_every=100, save_every_updates=4, keep_last=50)
    straight = tmp_path / "straight"
    train_model(run_config(prepared_toy, straight, max_updates=12, **common))
    killed = tmp_path / "killed"
    config = tmp_path / "killed.yaml"
    config.write_text(run_config(prepared_toy, killed, max_updates=12, **common).to_yaml())
    child = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_STRIPPING, str(config)], check=False)
    assert child.returncode == -signal.SIGKILL
    assert all("optimizer" in load_state(killed / checkpoint_name(u)) for u in (4, 8))
    train_model(run_config(prepared_toy, killed, max_updates=12, **common))
    a, b = (load_state(run / checkpoint_name(12)) for run in (straight, killed))
    assert all(torch.equal(tensor, b["model"][key]) for key, tensor in a["model"].items())
    assert [("optimizer" in load_state(killed / checkpoint_name(u))) for u in (4, 8, 12)] == [False, False, True]


def test_older_checkpoints_keep_only_what_averaging_and_translation_need(prepared_toy, tmp_path):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=6, save_every_updates=2, keep_last=50, validate_every=3))
    paths = list_checkpoints(run)
    assert [p.name for p in paths] == [checkpoint_name(u) for u in (2, 4, 6)]
    assert [("optimizer" in load_state(p)) for p in paths] == [False, False, True]
    assert "optimizer" in load_state(run / BEST_NAME)
    older = load_state(paths[0])
    assert older["minutes"] > 0 and older["epoch"] == 1 and older["update"] == 2  # the run's progress stays
    full, stripped = paths[-1].stat().st_size, paths[0].stat().st_size
    assert full > 2.5 * stripped  # Adam's two moments are twice the weights
    average_checkpoints(paths, run / "average.pt")  # averaging (and translation) read the weights only
    assert len(Translator.from_checkpoints([paths[0]], "cpu").translate_lines(["a b c", "d e"])) == 2


def test_already_finished_run_does_nothing(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=3, validate_every=100))
    mtime = (run / checkpoint_name(3)).stat().st_mtime_ns
    result = train_model(run_config(prepared_toy, run, max_updates=3, validate_every=100))
    assert result.update == 3 and (run / checkpoint_name(3)).stat().st_mtime_ns == mtime


def test_wall_clock_limits(prepared_toy, tmp_path):
    """max_minutes stops the run; save_every_minutes writes a checkpoint whenever that much time has passed."""
    result = train_model(run_config(prepared_toy, tmp_path / "a", max_updates=50, max_minutes=1e-9, validate_every=100))
    assert result.update == 1 and result.stop_reason.startswith("max_minutes")
    run = tmp_path / "b"
    train_model(run_config(prepared_toy, run, max_updates=3, save_every_minutes=1e-9, keep_last=50, validate_every=100))
    assert [p.name for p in list_checkpoints(run)] == [checkpoint_name(u) for u in (1, 2, 3)]


def _ticking(seconds: float):
    """A clock for a timed run that does not wait: each reading is ``seconds`` later than the one before."""
    readings = itertools.count()
    return lambda: next(readings) * seconds


def test_a_timed_run_validates_on_its_clock(prepared_toy, tmp_path):
    """With a time budget, a run validates at every train.validate_every_fraction of it, though it never
    reaches train.validate_every updates: 10 times in all (the last at the end), each after its mark."""
    common = dict(max_updates=0, max_minutes=1, validate_every=1000, save_every_minutes=0, log_every=1000)
    run = tmp_path / "run"
    result = train_model(run_config(prepared_toy, run, **common), clock=_ticking(0.5))
    assert result.stop_reason == "max_minutes=1" and result.update < 1000
    valid = [m for m in metric_records(run) if m["kind"] == "valid"]
    assert len(valid) == 10
    assert all(m["minutes"] >= (k + 1) / 10 for k, m in enumerate(valid))


@pytest.mark.parametrize("name", ["base.yaml", "big.yaml"])
def test_the_paper_configs_validate_by_updates_only(name):
    """The paper's configs have no time budget, so train.validate_every_fraction adds no validation there."""
    tc = load_config(Path(__file__).resolve().parents[1] / "configs" / name).train
    assert tc.max_minutes == 0 and tc.validate_every_fraction == 0.1
    assert clock_marks(tc, 1e9) == 0
    assert clock_marks(dataclasses.replace(tc, max_minutes=20.0), 6.0) == 3  # 2, 4 and 6 minutes
    with pytest.raises(ConfigError, match=r"train.validate_every_fraction must be in \[0, 1\), got 1.5"):
        load_config(overrides=["train.validate_every_fraction=1.5"])


def test_a_validation_close_behind_one_by_the_other_rule_is_skipped():
    """A clock mark one update before a multiple of validate_every (or after it) would validate twice in a row:
    within a tenth of validate_every updates (at least one) of the other rule's last validation, it is skipped."""
    assert close_behind(200, 199, 200) and close_behind(219, 200, 200)  # 1 and 19 < 200 // 10
    assert not close_behind(220, 200, 200) and not close_behind(5, None, 200)
    assert close_behind(12, 12, 6) and not close_behind(13, 12, 6)  # at least one: the same update only
    assert close_behind(5, 5, 0) and not close_behind(6, 5, 0)


@pytest.mark.parametrize(("per_mark", "validated"), [(19, [19, 38, 40]), (21, [20, 40, 42])])
def test_the_count_and_the_clock_validate_once_where_they_meet(
    prepared_toy, tmp_path, monkeypatch, per_mark, validated
):
    """A clock that moves with the updates puts a mark every ``per_mark`` updates beside validate_every 20: a mark
    at 19 stands for the count's 20 and the count's 20 for a mark at 21 (one update apart), but two updates apart
    (38 and 40, 40 and 42) both validate."""
    updates = [0]
    take = Trainer._update

    def counted(self, batches):
        updates[0] += 1
        return take(self, batches)

    monkeypatch.setattr(Trainer, "_update", counted)
    seconds = 6.0 / per_mark  # max_minutes 1: a mark every 6 seconds
    common = dict(max_updates=validated[-1], max_minutes=1, validate_every=20, save_every_minutes=0, log_every=1000)
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, **common), clock=lambda: updates[0] * seconds)
    assert [m["update"] for m in metric_records(run) if m["kind"] == "valid"] == validated


def test_validating_on_the_clock_leaves_the_trajectory_alone(prepared_toy, tmp_path):
    """Validation draws no random number and takes no step: 12 updates end with the same weights, bit for bit,
    with validations on the clock or without (the schedule here counts updates, not minutes)."""
    common = dict(max_updates=12, max_minutes=1, validate_every=1000, save_every_minutes=0, log_every=1000)
    weights = []
    for fraction in (0.1, 0.0):
        run = tmp_path / str(fraction)
        train_model(run_config(prepared_toy, run, validate_every_fraction=fraction, **common), clock=_ticking(0.5))
        weights.append(load_state(run / checkpoint_name(12))["model"])
        valid = [m for m in metric_records(run) if m["kind"] == "valid"]
        assert (len(valid) > 1) == (fraction > 0)  # without the clock's, the final validation only
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_resumed_timed_run_validates_at_the_marks_after_its_checkpoint(prepared_toy, tmp_path):
    """The marks are fixed points of the budget's clock, so a resumed run knows from its checkpoint's minutes
    which are behind it: no mark is validated twice, none skipped."""
    common = dict(max_minutes=1, validate_every=1000, save_every_minutes=0, log_every=1000)
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=12, **common), clock=_ticking(0.5))
    minutes = load_state(run / checkpoint_name(12))["minutes"]
    assert 0.1 < minutes < 0.9
    before = len(metric_records(run))
    train_model(run_config(prepared_toy, run, max_updates=0, **common), clock=_ticking(0.5))
    resumed = [m for m in metric_records(run)[before:] if m["kind"] == "valid"]
    assert len(resumed) == 10 - math.floor(minutes * 10)
    assert resumed[0]["minutes"] >= math.ceil(minutes * 10) / 10


def _set_model(cfg: Config, **model) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


@pytest.mark.slow
def test_sentences_longer_than_max_positions_are_left_out_and_counted(prepared_toy, tmp_path, capsys):
    """max_positions 40 is below the longest toy sentences (63 tokens): a whole epoch runs, they are counted."""
    cfg = _set_model(
        run_config(prepared_toy, tmp_path / "run", max_tokens=2048, update_freq=5, max_updates=0), max_positions=40
    )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_epochs=1, validate_every=100))
    d = cfg.data
    expected = {}
    for split in ("train", "valid"):
        ds = ParallelDataset(d.dir, split, d.src_lang, d.tgt_lang)
        expected[split] = (int(too_long(ds.src_lens, ds.tgt_lens, 40).sum()), len(ds))
    assert all(0 < n < total for n, total in expected.values())  # some, not all, are too long
    result = train_model(cfg)
    assert result.stop_reason == "max_epochs=1" and math.isfinite(result.valid_loss)
    assert (result.too_long_train, result.too_long_valid) == (expected["train"][0], expected["valid"][0])
    (train_n, train_total), (valid_n, valid_total) = expected["train"], expected["valid"]
    err = capsys.readouterr().err
    assert (
        f"left out as longer than 40 tokens (min of train.max_tokens 2048 and model.max_positions 40): "
        f"{train_n:,} of {train_total:,} training and {valid_n} of {valid_total} validation sentences"
    ) in err


def _non_convertible(cfg: Config) -> tuple[int, int]:
    """(world size, batches per rank) at which 1 process cannot continue the epoch exactly."""
    d, tc = cfg.data, cfg.train
    ds = ParallelDataset(d.dir, "train", d.src_lang, d.tgt_lang)
    for world_size in (2, 3, 4, 5):
        for consumed in range(1, 60):
            if resume_position(ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, 1, consumed, world_size, 1) is None:
                return world_size, consumed
    raise AssertionError("every position converts")


def test_resume_with_another_world_size_refuses_when_the_position_does_not_carry_over(prepared_toy, tmp_path):
    """A checkpoint as N processes would write it, where 1 process's batch order differs: a clear error."""
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100))
    path = run / checkpoint_name(1)
    state = load_state(path)
    world_size, state["batch_in_epoch"] = _non_convertible(prepared_toy)
    state["rng"]["world_size"] = world_size
    save_state(path, state)
    pattern = rf"written by {world_size} processes.*skip or repeat.*--nproc-per-node {world_size}"
    with pytest.raises(TrainError, match=pattern):
        train_model(run_config(prepared_toy, run, max_updates=2, validate_every=100))


def test_resume_with_another_world_size_converts_the_position_when_it_carries_over(prepared_toy, tmp_path, capsys):
    """2 processes, 3 batches each, at a point where 1 process's batch order is the same: it continues at batch 6."""
    d, tc = prepared_toy.data, prepared_toy.train
    ds = ParallelDataset(d.dir, "train", d.src_lang, d.tgt_lang)
    assert resume_position(ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, 1, 3, 2, 1) == 6
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100))
    path = run / checkpoint_name(1)
    state = load_state(path)
    state["batch_in_epoch"], state["rng"]["world_size"] = 3, 2
    save_state(path, state)
    capsys.readouterr()
    train_model(run_config(prepared_toy, run, max_updates=2, validate_every=100))
    assert load_state(run / checkpoint_name(2))["batch_in_epoch"] == 7
    assert "written by 2 processes, this run has 1; dropout masks are reseeded" in capsys.readouterr().err


@pytest.mark.parametrize(("key", "value"), [("max_tokens", 400), ("seed", 7)])
def test_a_batch_order_change_mid_epoch_restarts_the_epoch_and_says_so(prepared_toy, tmp_path, capsys, key, value):
    """Resumed 3 batches into epoch 1 with another max_tokens or seed: epoch 1 starts over, no sentence skipped."""
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=3, validate_every=100))
    state = load_state(run / checkpoint_name(3))
    assert (state["batch_in_epoch"], state["batching"][key]) == (3, getattr(prepared_toy.train, key))
    capsys.readouterr()
    train_model(run_config(prepared_toy, run, max_updates=4, validate_every=100, **{key: value}))
    err = capsys.readouterr().err
    old = getattr(prepared_toy.train, key)
    assert f"warning: train.{key} was {old}, now {value}: {run / checkpoint_name(3)} was written 3 of" in err
    assert "epoch 1 starts over" in err and "first 3 batches are trained on again" in err
    assert "resume with the old value(s)" in err
    state = load_state(run / checkpoint_name(4))
    assert (state["epoch"], state["batch_in_epoch"], state["batching"][key]) == (1, 1, value)
    train_model(run_config(prepared_toy, run, max_updates=5, validate_every=100, **{key: value}))  # the new order holds
    assert "starts over" not in capsys.readouterr().err
    assert load_state(run / checkpoint_name(5))["batch_in_epoch"] == 2


def test_a_batch_order_change_at_the_end_of_an_epoch_goes_on_to_the_next(prepared_toy, tmp_path, capsys):
    """A checkpoint that finished its epoch (as train.max_epochs leaves it): the change takes effect at once, quietly."""
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100))
    path = run / checkpoint_name(1)
    state = load_state(path)
    state["batch_in_epoch"] = state["batching"]["batches"]
    save_state(path, state)
    capsys.readouterr()
    train_model(run_config(prepared_toy, run, max_updates=2, validate_every=100, max_tokens=400))
    assert "starts over" not in capsys.readouterr().err
    state = load_state(run / checkpoint_name(2))
    assert (state["epoch"], state["batch_in_epoch"]) == (2, 1)


def test_a_checkpoint_without_a_batching_record_resumes_as_before(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100))
    path = run / checkpoint_name(1)
    state = load_state(path)
    del state["batching"]
    save_state(path, state)
    train_model(run_config(prepared_toy, run, max_updates=2, validate_every=100, seed=7))
    assert "starts over" not in capsys.readouterr().err
    assert load_state(run / checkpoint_name(2))["batch_in_epoch"] == 2


def test_batching_changes_name_each_key_and_the_data():
    lens = np.array([3, 4, 5])
    key = batching_key(lens, lens, 512, 1, 256)
    assert batching_changes(key, key) == []
    assert batching_changes(key, batching_key(lens, lens, 600, 2, 256)) == [
        "train.max_tokens was 512, now 600",
        "train.seed was 1, now 2",
    ]
    assert batching_changes(key, batching_key(lens[:2], lens[:2], 512, 1, 256)) == [
        "the training data in data.dir changed (3 sentences, now 2)"
    ]
    assert batching_changes(key, batching_key(lens + 1, lens, 512, 1, 256)) == [
        "the training data in data.dir changed (3 sentences, now 3, other lengths)"
    ]


def test_fresh_start_empties_old_metrics_and_logs_plain_lines_off_a_terminal(prepared_toy, tmp_path, capsys):
    """No checkpoint to resume from: every update runs again, so old metric lines go; stderr is not a terminal here."""
    run = tmp_path / "run"
    run.mkdir()
    stale = [{"kind": "train", "update": u, "loss": 9.0} for u in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in stale) + '{"kind": "tr')
    train_model(run_config(prepared_toy, run, max_updates=2, log_every=1, validate_every=100))
    records = [(m["kind"], m["update"]) for m in metric_records(run) if m["kind"] != "warning"]  # 2 updates: warnings
    assert records == [("start", 0), ("train", 1), ("train", 2), ("valid", 2), ("end", 2)]
    err = capsys.readouterr().err
    assert "train update 1/2 epoch 1: loss " in err and "train update 2/2 epoch 1: loss " in err
    assert "\r" not in err  # no progress bar


def test_free_memory_is_released_at_each_metric_line(prepared_toy, tmp_path, monkeypatch):
    """Varying batch shapes fragment the heap: the trainer gives free pages back at every log line."""
    calls = []
    monkeypatch.setattr("transformer_mt.train.trainer.release_free_memory", lambda: calls.append(1) or True)
    train_model(run_config(prepared_toy, tmp_path / "run", max_updates=4, log_every=2, validate_every=100))
    assert len(calls) == 2


def test_start_and_end_records_say_what_the_run_cost_and_ran_on(prepared_toy, tmp_path):
    """What `tmt report` reads: model size, FLOPs per target token, device; where and when the run stopped."""
    run = tmp_path / "run"
    cfg = run_config(prepared_toy, run, max_updates=3, log_every=1, validate_every=2)
    train_model(cfg)
    train_model(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_updates=4)))  # resumed
    records = metric_records(run)
    start = records[0]
    ds = ParallelDataset(prepared_toy.data.dir, "train", "en", "de")
    vocab = start["vocab_size"]
    assert start["parameters"] == count_parameters(Transformer(cfg.model, vocab))
    assert start["flops_per_token"] == pytest.approx(
        flops_per_token(cfg.model, vocab, float(ds.src_lens.mean()), float(ds.tgt_lens.mean()))
    )
    expected = resolve_precision("auto", torch.device("cpu"))  # bf16 on a CPU with bf16 instructions
    assert start["device"].startswith("CPU") and (start["world_size"], start["precision"]) == (1, expected)
    ends = [m for m in records if m["kind"] == "end"]
    assert [(m["update"], m["stop_reason"]) for m in ends] == [(3, "max_updates=3"), (4, "max_updates=4")]
    assert [m["update"] for m in records if m["kind"] == "start"] == [0, 3]
    minutes = [m["minutes"] for m in records if "minutes" in m]
    assert minutes == sorted(minutes) and ends[-1]["minutes"] == minutes[-1] > 0  # one clock, across the resume
    for end in ends:  # each process's clock stops at its final checkpoint, where the next one's goes on
        assert end["minutes"] == load_state(run / checkpoint_name(end["update"]))["minutes"]
    assert all("minutes" in m for m in records if m["kind"] == "valid")


def test_progress_bar_on_a_terminal_and_no_log_lines(prepared_toy, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    train_model(run_config(prepared_toy, tmp_path / "run", max_updates=2, log_every=1, validate_every=100))
    err = capsys.readouterr().err
    assert "train: " in err and "2/2" in err and "train update" not in err


# ---------------------------------------------------------------- never fail silently; validation BLEU, patience


def test_stopping_inside_the_warmup_warns_on_stderr_and_in_the_metrics(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    result = train_model(run_config(prepared_toy, run, max_updates=5, warmup=4000, validate_every=100))
    err = capsys.readouterr().err
    assert (
        "warning: training stopped at update 5, inside its warmup of 4000 updates (train.warmup): the learning rate "
        "never reached its peak, so the model is barely trained and translations may be empty"
    ) in err
    warnings = [m for m in metric_records(run) if m["kind"] == "warning"]
    assert [(w["update"], w["reason"]) for w in warnings] == [(5, "warmup"), (5, "unconverged")]
    assert "far from converged: validation perplexity" in warnings[1]["message"] and "is above 100" in err
    assert result.warnings == tuple(w["message"] for w in warnings)


@pytest.mark.parametrize("has_bf16", [False, True])
def test_bf16_on_a_cpu_without_bf16_instructions_warns(prepared_toy, tmp_path, capsys, monkeypatch, has_bf16):
    """Explicit bf16 where the CPU only emulates it trains (the same numbers) but is told it is slow."""
    monkeypatch.setattr("transformer_mt.train.run_log.cpu_has_bf16", lambda: has_bf16)
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100, precision="bf16"))
    warned = [m for m in metric_records(run) if m["kind"] == "warning" and m["reason"] == "emulated_bf16"]
    assert len(warned) == (0 if has_bf16 else 1)
    assert ("without bf16 instructions (AVX512-BF16 or AMX)" in capsys.readouterr().err) == (not has_bf16)


def test_the_warmup_warning_names_the_floor_under_the_fraction(prepared_toy, tmp_path):
    """A budgeted run always leaves a fraction's warmup (the floor takes at most half the budget); one stopped
    early, here before its first update, is warned with both keys named."""
    schedule = dict(lr=1e-3, warmup_fraction=0.1, min_warmup=100)
    trainer = Trainer(
        run_config(prepared_toy, tmp_path / "run", max_updates=3, validate_every=100, **schedule), setup()
    )
    ((reason, message),) = final_warnings(trainer.cfg.train, trainer.progress, trainer.schedule, 0.0)
    trainer.log.files.close()
    assert reason == "warmup"
    assert (
        "training stopped at update 0, inside its warmup of the first 10% of its budget, at least 100 updates "
        "(train.warmup_fraction, train.min_warmup): the learning rate never reached its peak"
    ) in message
    assert not trainer.schedule.warming_up(3, 1.0)  # where the budget of 3 updates ends


def test_the_convergence_rule():
    assert "perplexity 150.0 is above 100" in unconverged([(5, 150.0)], 100)
    assert unconverged([(5, 20.0)], 100) is None and unconverged([], 100) is None
    # a Multi30k run stopped at update 400 (validate_every 132): 396 -> 400 is too close, 264 -> 400 shows the trend
    history = [(264, 39.31), (396, 23.63), (400, 22.60)]
    assert "fell 43% in the last 136 updates (39.31 at update 264, 22.60 at 400)" in unconverged(history, 132)
    assert unconverged([(1000, 5.2), (2000, 4.9), (2003, 4.89)], 1000) is None  # 6% over an interval: converging
    assert unconverged([(2000, 4.9), (3000, 4.3)], 1000) is not None  # 12%


def test_a_run_that_ends_before_its_second_validation_is_judged_by_its_training_perplexity():
    """One validation (the final one, perplexity 40) shows no trend; the training perplexity, falling 25% over
    the second half of the run, does. A flat one, or too few records to reach back half the run, warn nothing."""
    falling = [(100, 80.0), (200, 60.0), (300, 52.0), (400, 45.0)]
    why = unconverged([(400, 40.0)], 1000, falling)
    assert why == (
        "no validation came train.validate_every=1000 updates before the last to compare with, and the training "
        "perplexity fell 25% in the last 200 updates (60.00 at update 200, 45.00 at 400), more than 10%: the model "
        "is still learning fast"
    )
    assert unconverged([(400, 40.0)], 1000, [(200, 46.0), (300, 45.5), (400, 45.0)]) is None  # 2%: converging
    assert unconverged([(400, 40.0)], 1000, [(300, 60.0), (400, 45.0)]) is None  # nothing in the first half
    assert unconverged([(400, 40.0)], 1000) is None  # no training record (train.log_every above the run)
    # a validation trend, where there is one, decides: the training records are not read
    assert unconverged([(0, 41.0), (1000, 40.0)], 1000, falling) is None


def test_the_unconverged_warning_reads_the_runs_training_records(prepared_toy, tmp_path):
    trainer = Trainer(run_config(prepared_toy, tmp_path / "run", max_updates=3, validate_every=100), setup())
    trainer.progress.update, trainer.progress.valid_history = 400, [[400, math.log(40.0)]]
    trained = [(200, math.log(60.0)), (400, math.log(45.0))]
    warnings = final_warnings(trainer.cfg.train, trainer.progress, trainer.schedule, 1.0, trained)
    trainer.log.files.close()
    assert [reason for reason, _ in warnings] == ["unconverged"]
    assert "training stopped at update 400 far from converged: no validation came" in warnings[0][1]
    assert not final_warnings(trainer.cfg.train, trainer.progress, trainer.schedule, 1.0)

    run = tmp_path / "ran"
    trainer = Trainer(run_config(prepared_toy, run, max_updates=3, log_every=1, validate_every=100), setup())
    trainer.run()
    assert trainer.log.trained == [(m["update"], m["nll"]) for m in metric_records(run) if m["kind"] == "train"]
    assert [u for u, _ in trainer.log.trained] == [1, 2, 3]


def test_the_valid_line_gives_validation_bleus_share_of_the_time():
    assert bleu_share(3.0, 100.0) == "validation BLEU so far 3% of the time"
    assert bleu_share(17.0, 100.0) == (
        "validation BLEU so far 17% of the time: fewer train.valid_bleu_sentences cost less (0: none)"
    )


def _valid_sentences(cfg: Config, n: int) -> tuple[list[str], list[str]]:
    d = cfg.data
    src, ref = (Path(f"{d.valid}.{lang}").read_text(encoding="utf-8").splitlines()[:n] for lang in ("en", "de"))
    return src, ref


@pytest.mark.slow
def test_validation_bleu_is_logged_and_checkpoint_best_follows_it(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    common = dict(max_updates=20, validate_every=5, warmup=5, save_every_updates=20)
    result = train_model(run_config(prepared_toy, run, valid_bleu_sentences=12, best_metric="bleu", **common))
    valid = [m for m in metric_records(run) if m["kind"] == "valid"]
    assert [m["update"] for m in valid] == [5, 10, 15, 20]
    assert all(m["bleu_sentences"] == 12 and 0 <= m["empty_hypotheses"] <= 12 for m in valid)
    bleus = [m["bleu"] for m in valid]
    assert [m["best_bleu"] for m in valid] == [max(bleus[: i + 1]) for i in range(4)]
    assert len(set(bleus)) > 1  # the scores move, so the choice of the best checkpoint means something
    best = load_state(run / BEST_NAME)
    assert best["update"] == valid[bleus.index(max(bleus))]["update"] and best["valid_bleu"] == max(bleus)
    assert result.best_valid_bleu == max(bleus) and not [m for m in metric_records(run) if m.get("reason") == "warmup"]
    err = capsys.readouterr().err
    assert f"bleu {bleus[-1]:.2f} (best {max(bleus):.2f}; 12 sentences" in err
    assert len(re.findall(r"s; validation BLEU so far \d+% of the time", err)) == 4  # its cost, at every validation

    # the logged figure is what `tmt evaluate` would compute: the same weights, beam 1, sacreBLEU
    translator = Translator.from_checkpoints([run / BEST_NAME], device="cpu", overrides=["decode.beam_size=1"])
    translator.show_progress = False
    sources, refs = _valid_sentences(prepared_toy, 12)
    assert corpus_sacrebleu(translator.translate_lines(sources), refs)["score"] == max(bleus)

    # and decoding leaves training as it was: the model is back in train mode (dropout), no random draw is taken
    plain = tmp_path / "plain"
    train_model(run_config(prepared_toy, plain, **common))
    a, b = load_state(run / checkpoint_name(20))["model"], load_state(plain / checkpoint_name(20))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_patience_stops_the_run_and_its_count_survives_a_resume(prepared_toy, tmp_path, capsys):
    """lr 0: the validation loss never improves, so patience 3 stops the run 3 validations after the first."""
    common = dict(lr_scale=0.0, validate_every=2, patience=3, max_updates=50)
    straight = train_model(run_config(prepared_toy, tmp_path / "straight", **common))
    assert (straight.update, straight.stop_reason) == (8, "patience=3")
    assert "3/3 validations without a new best loss" in capsys.readouterr().err

    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, **{**common, "max_updates": 6}))  # validations at 2 (the best), 4 and 6
    assert load_state(run / checkpoint_name(6))["stale_validations"] == 2
    resumed = train_model(run_config(prepared_toy, run, **common))
    assert (resumed.update, resumed.stop_reason) == (8, "patience=3")  # not 12: the count went on from 2
    assert load_state(run / BEST_NAME)["update"] == 2
    again = train_model(run_config(prepared_toy, run, **common))  # a run patience has stopped stays stopped
    assert (again.update, again.stop_reason) == (8, "patience=3")


def test_window_adds_updates_and_resets():
    w = Window()
    w.add(UpdateStats(loss_sum=6.0, nll_sum=4.0, tokens=10, sentences=2, gnorm=1.5))
    w.add(UpdateStats(loss_sum=3.0, nll_sum=2.0, tokens=5, sentences=1, gnorm=0.5))
    assert (w.loss, w.nll, w.tokens, w.sentences, w.gnorm, w.updates) == (9.0, 6.0, 15, 3, 2.0, 2)
    start = w.start
    w.reset()
    assert (w.loss, w.nll, w.tokens, w.sentences, w.gnorm, w.updates) == (0, 0, 0, 0, 0, 0) and w.start >= start


def test_nonfinite_updates_stop_with_advice(prepared_toy, tmp_path):
    cfg = run_config(prepared_toy, tmp_path / "run", lr_scale=1e38, max_nonfinite=3, warmup=1)
    with pytest.raises(TrainError, match=r"3 updates in a row.*lower train.lr_scale.*clip_norm"):
        train_model(cfg)


def test_missing_data_is_a_user_error(prepared_toy, tmp_path):
    data = dataclasses.replace(prepared_toy.data, train=str(tmp_path / "nope/train"), dir=str(tmp_path / "prep"))
    cfg = dataclasses.replace(run_config(prepared_toy, tmp_path / "run"), data=data)
    with pytest.raises(UserError, match="nope"):
        train_model(cfg)


def test_resume_refuses_a_different_model(prepared_toy, tmp_path):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100))
    other = dataclasses.replace(
        run_config(prepared_toy, run, max_updates=2), model=dataclasses.replace(prepared_toy.model, d_ff=128)
    )
    with pytest.raises(
        TrainError,
        match=r"different model than the config: model\.d_ff 64 ≠ 128 \(the checkpoint.s value first\); use a new train.save_dir",
    ):
        train_model(other)


def test_resume_refuses_an_averaged_checkpoint_and_passes_over_a_crafted_one(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=1, validate_every=100))
    average_checkpoints([run / checkpoint_name(1)], run / checkpoint_name(2))
    with pytest.raises(TrainError, match=r"checkpoint_u0000002\.pt holds no training state .*averaged checkpoint"):
        train_model(run_config(prepared_toy, run, max_updates=3, validate_every=100))
    state = load_state(run / checkpoint_name(1))
    state["config"] = "not a config"
    save_state(run / checkpoint_name(2), state)
    train_model(run_config(prepared_toy, run, max_updates=2, validate_every=100))  # resumes from update 1
    assert "skipping" in capsys.readouterr().err and load_state(run / checkpoint_name(2))["update"] == 2


def test_out_of_memory_names_the_batch_and_a_smaller_max_tokens():
    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, src, tgt_in, pack=False):
            raise torch.OutOfMemoryError("CUDA out of memory")

    module = Exploding()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    env = DistEnv(0, 1, 0, torch.device("cpu"), True)
    step = Stepper(module, module, torch.optim.SGD(module.parameters()), scaler, env, "fp32", 0.1, 0.0, 4096, 2)
    batch = Batch(
        torch.ones(8, 30, dtype=torch.long), torch.ones(8, 25, dtype=torch.long), torch.ones(8, 25, dtype=torch.long)
    )
    with pytest.raises(TrainError, match=r"src \(8, 30\), tgt \(8, 25\).*max_tokens=2048.*update_freq=4"):
        accumulate_gradients(step, [batch])


def test_num_threads_is_applied_and_restored(prepared_toy, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("transformer_mt.train.trainer.Trainer.run", lambda self: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    train_model(run_config(prepared_toy, tmp_path / "run", num_threads=1))
    assert seen == [1] and torch.get_num_threads() == before


def _linear_stepper(clip_norm: float, grad: float) -> tuple[torch.nn.Linear, Stepper]:
    m = torch.nn.Linear(3, 2)
    for p in m.parameters():
        p.grad = torch.full_like(p, grad)
    env = DistEnv(0, 1, 0, torch.device("cpu"), True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return m, Stepper(m, m, torch.optim.SGD(m.parameters(), lr=0.0), scaler, env, "fp32", 0.1, clip_norm)


def test_clip_norm_scales_the_whole_gradient_to_the_limit():
    m, step = _linear_stepper(clip_norm=1.0, grad=10.0)
    before = torch.cat([p.detach().flatten() for p in m.parameters()])
    stats = apply_gradients(step, UpdateStats(loss_sum=1.0, tokens=5), lr=1.0)
    after = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert stats.stepped and stats.gnorm == pytest.approx(10.0 * 8**0.5)  # reported before clipping
    assert (before - after).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_nonfinite_gradient_skips_the_step():
    m, step = _linear_stepper(clip_norm=0.0, grad=float("nan"))
    before = [p.detach().clone() for p in m.parameters()]
    stats = apply_gradients(step, UpdateStats(loss_sum=1.0, tokens=5), lr=1.0)
    assert not stats.stepped and all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("native_bf16", [True, False])
def test_precision_resolution(monkeypatch, native_bf16):
    """``auto`` on a CPU: bf16 where it has bf16 instructions (AVX512-BF16 or AMX), fp32 where bf16 is emulated."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: native_bf16)
    assert cpu_has_bf16() is native_bf16
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == ("bf16" if native_bf16 else "fp32")
    assert resolve_precision("fp32", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(TrainError, match="fp16 needs a CUDA device"):
        resolve_precision("fp16", cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_gpu(prepared_toy, tmp_path, precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    run = tmp_path / "run"
    result = train_model(run_config(prepared_toy, run, precision=precision, max_updates=20, validate_every=10))
    state = load_state(run / checkpoint_name(20))
    assert result.update == 20 and math.isfinite(result.valid_loss)
    assert bool(state["scaler"]) == (precision == "fp16")
    assert len(state["rng"]["torch_cuda"]) == 1


# ---------------------------------------------------------------- budget-aware schedule and snapshots


def test_snapshots_are_spread_over_the_end_of_the_budget(prepared_toy, tmp_path):
    """snapshot_span 0.4 with average_last 4 over 20 updates: checkpoints at 70%, 80%, 90% and 100% of the run."""
    run = tmp_path / "run"
    cfg = run_config(
        prepared_toy, run, max_updates=20, snapshot_span=0.4, average_last=4, keep_last=50, validate_every=100
    )
    train_model(cfg)
    assert [p.name for p in list_checkpoints(run)] == [checkpoint_name(u) for u in (14, 16, 18, 20)]


def test_linear_schedule_reaches_zero_at_the_budget_and_logs_progress(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = run_config(
        prepared_toy, run, max_updates=10, schedule="linear", lr=1e-3, warmup_fraction=0.2, log_every=1,
        validate_every=100,
    )  # fmt: skip
    train_model(cfg)
    train = [m for m in metric_records(run) if m["kind"] == "train"]
    assert [m["lr"] for m in train] == pytest.approx([5e-4, 1e-3, *(1e-3 * (1 - u / 10) / 0.8 for u in range(3, 11))])
    assert [m["progress"] for m in train] == pytest.approx([u / 10 for u in range(1, 11)])
    err = capsys.readouterr().err
    assert "train update 3/10" in err and "max_updates=10" in err and " left)" in err


def test_the_wall_clock_budget_counts_the_minutes_before_a_resume(prepared_toy, tmp_path):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=2, validate_every=100))
    state = load_state(run / checkpoint_name(2))
    assert 0 < state["minutes"] < 5
    state["minutes"] = 30.0  # as if this run had already trained for half an hour
    save_state(run / checkpoint_name(2), state)
    files = {p.name: p.stat().st_mtime_ns for p in run.glob("checkpoint_*.pt")}
    result = train_model(run_config(prepared_toy, run, max_updates=50, max_minutes=30, validate_every=100))
    assert result.update == 2 and result.stop_reason == "max_minutes=30"  # spent already: not one more update
    assert {p.name: p.stat().st_mtime_ns for p in run.glob("checkpoint_*.pt")} == files  # nothing written or rotated
    result = train_model(run_config(prepared_toy, run, max_updates=3, max_minutes=31, validate_every=100))
    assert result.update == 3  # a higher budget continues the run


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), MemoryError()])
def test_out_of_memory_while_validating_is_the_same_advice(prepared_toy, error, monkeypatch):
    from transformer_mt.data.dataset import ParallelDataset
    from transformer_mt.train import validation

    def explode(*args, **kwargs):
        raise error

    monkeypatch.setattr(validation, "forward_loss", explode)
    ds = ParallelDataset(prepared_toy.data.dir, "valid", prepared_toy.data.src_lang, prepared_toy.data.tgt_lang)
    env = DistEnv(0, 1, 0, torch.device("cpu"), True)
    with pytest.raises(TrainError, match=r"out of memory validating on a batch of src .*train\.max_tokens=256"):
        validation.validate(torch.nn.Linear(1, 1), ds, prepared_toy, env, "fp32")


def test_a_finished_run_run_again_ends_the_strip_a_kill_cut_short(prepared_toy, tmp_path):
    """Killed while stripping the checkpoint before its final one: running the finished run again strips it,
    and leaves the final checkpoint, which resumes, as it was."""
    run = tmp_path / "run"
    cfg = run_config(prepared_toy, run, max_updates=4, save_every_updates=2, keep_last=50, validate_every=100)
    train_model(cfg)
    older, final = run / checkpoint_name(2), run / checkpoint_name(4)
    state, training = load_state(older), load_state(final)
    save_state(older, {**state, **{k: training[k] for k in ("optimizer", "rng", "scaler", "batching")}})
    mtime = final.stat().st_mtime_ns
    assert train_model(cfg).update == 4
    assert "optimizer" not in load_state(older) and "optimizer" in load_state(final)
    assert final.stat().st_mtime_ns == mtime
