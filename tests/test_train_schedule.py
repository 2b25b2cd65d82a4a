"""The paper's learning-rate schedule (eq. 3), the budget-aware schedules, and the optimizer settings."""

import math

import pytest
import torch

from transformer_mt.config import ConfigError, TrainConfig, load_config
from transformer_mt.train.schedule import FLOOR_CAP, Schedule, build_optimizer, horizon_progress, inverse_sqrt_lr


@pytest.mark.parametrize("step", [1, 2, 100, 3999, 4000, 4001, 10_000, 100_000])
def test_formula(step):
    d_model, warmup = 512, 4000
    expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    assert inverse_sqrt_lr(step, d_model, warmup, 1.0) == pytest.approx(expected, rel=1e-15)
    assert inverse_sqrt_lr(step, d_model, warmup, 2.0) == pytest.approx(2 * expected, rel=1e-15)


def test_peak_at_warmup():
    d_model, warmup = 512, 4000
    lrs = [inverse_sqrt_lr(s, d_model, warmup) for s in range(1, 20_000)]
    peak = max(range(len(lrs)), key=lrs.__getitem__) + 1
    assert peak == warmup
    assert lrs[warmup - 1] == pytest.approx(d_model**-0.5 * warmup**-0.5, rel=1e-12)
    assert lrs[warmup - 1] == pytest.approx(6.9877e-4, rel=1e-4)


def test_linear_warmup_then_inverse_sqrt_decay():
    sched = Schedule.from_config(TrainConfig(), 512)
    lr = lambda step: sched.lr(step, 0.0)  # noqa: E731 - the paper's schedule ignores the budget
    assert lr(2000) == pytest.approx(lr(1000) * 2)
    assert lr(16_000) == pytest.approx(lr(4000) / 2)


@pytest.mark.parametrize("step", [1, 79, 80, 81, 400, 783])
@pytest.mark.parametrize("progress", [0.0, 0.3, 1.0])
def test_default_schedule_is_the_paper_formula_whatever_the_budget(step, progress):
    for cfg, d_model in [(TrainConfig(), 512), (TrainConfig(warmup=80, lr_scale=0.1431), 256)]:
        expected = inverse_sqrt_lr(step, d_model, cfg.warmup, cfg.lr_scale)
        assert Schedule.from_config(cfg, d_model).lr(step, progress) == pytest.approx(expected, rel=1e-12)


def test_fixed_peak_with_paper_decay_is_fairseq_inverse_sqrt():
    """train.lr with warmup in updates: lr rises linearly to train.lr, then train.lr * sqrt(warmup / step)."""
    sched = Schedule.from_config(TrainConfig(lr=1e-3, warmup=80), 256)
    for step in [1, 40, 80, 200, 783]:
        expected = 1e-3 * step / 80 if step <= 80 else 1e-3 * math.sqrt(80 / step)
        assert sched.lr(step, 0.5) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["linear", "cosine", "inverse_sqrt"])
@pytest.mark.parametrize("progress", [0.0, 0.01, 0.05, 0.1, 0.2, 0.55, 0.9, 1.0])
def test_warmup_fraction_schedules_against_their_formulas(kind, progress):
    f, peak = 0.1, 2e-3
    sched = Schedule.from_config(TrainConfig(schedule=kind, lr=peak, warmup_fraction=f), 256)
    if progress < f:
        expected = peak * progress / f
    elif kind == "linear":
        expected = peak * (1 - progress) / (1 - f)
    elif kind == "cosine":
        expected = peak * 0.5 * (1 + math.cos(math.pi * (progress - f) / (1 - f)))
    else:
        expected = peak * math.sqrt(f / progress)
    assert sched.lr(123, progress) == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert sched.warming_up(123, progress) == (progress < f)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_with_warmup_in_updates_ends_at_zero_with_the_budget(kind):
    sched = Schedule.from_config(TrainConfig(schedule=kind, lr=1e-3, warmup=10), 256)
    assert sched.lr(5, 0.05) == pytest.approx(5e-4)  # ramp: step / warmup
    assert sched.warming_up(5, 0.05) and not sched.warming_up(10, 0.1)
    lin = 1e-3 * (1 - 0.5) if kind == "linear" else 1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert sched.lr(50, 0.5) == pytest.approx(lin)
    assert sched.lr(100, 1.0) == pytest.approx(0.0, abs=1e-18)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("progress", [0.02, 0.1, 0.5, 0.7, 0.75, 0.85, 0.94, 1.0])
def test_decay_fraction_holds_the_peak_then_decays_over_the_end(kind, progress):
    """Warmup-stable-decay: ramp over 10%, the peak until 70%, then decay to 0 over the last 30% of the budget."""
    f, d, peak = 0.1, 0.3, 1e-3
    sched = Schedule.from_config(TrainConfig(schedule=kind, lr=peak, warmup_fraction=f, decay_fraction=d), 256)
    t = max(progress - (1 - d), 0.0) / d
    decay = 1 - t if kind == "linear" else 0.5 * (1 + math.cos(math.pi * t))
    expected = peak * min(progress / f, decay)
    assert sched.lr(7, progress) == pytest.approx(expected, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("step", [1, 20, 40, 79, 80, 81, 130, 160, 200])
def test_min_warmup_is_a_floor_under_the_warmup_fraction(step):
    """A 200-update budget with a 10% warmup would warm up over 20 updates; a floor of 80 makes it 80."""
    f, d, floor, peak, budget = 0.1, 0.3, 80, 1e-3, 200
    cfg = TrainConfig(schedule="linear", lr=peak, warmup_fraction=f, decay_fraction=d, min_warmup=floor)
    sched, progress = Schedule.from_config(cfg, 256), step / budget
    decay = 1 - max(progress - (1 - d), 0.0) / d
    assert sched.lr(step, progress) == pytest.approx(peak * min(progress / f, step / floor, decay), rel=1e-12)
    assert sched.warming_up(step, progress) == (step < floor)


@pytest.mark.parametrize("step", [1, 30, 46, 47, 60, 93])
def test_min_warmup_never_takes_more_than_half_the_budget(step):
    """A clock-bounded run that manages only 93 updates warms up over the first half of them, not over 80."""
    f, floor, peak, budget = 0.1, 80, 1e-3, 93
    cfg = TrainConfig(schedule="linear", lr=peak, warmup_fraction=f, decay_fraction=0.3, min_warmup=floor)
    sched, progress = Schedule.from_config(cfg, 256), step / budget
    ramp = min(progress / f, max(step / floor, progress / FLOOR_CAP))
    assert FLOOR_CAP == 0.5
    assert sched.lr(step, progress) == pytest.approx(peak * min(ramp, 1 - max(progress - 0.7, 0.0) / 0.3))
    assert sched.warming_up(step, progress) == (step <= 46)


@pytest.mark.parametrize(("step", "budget"), [(1, 2000), (80, 2000), (200, 2000), (900, 2000), (80, 200), (160, 200)])
def test_min_warmup_with_inverse_sqrt_decays_from_where_the_ramp_ends(step, budget):
    """inverse_sqrt is ``peak * min(ramp, ramp^-1/2)`` whichever warmup is the longer."""
    f, floor, peak = 0.1, 80, 1e-3
    sched = Schedule.from_config(TrainConfig(lr=peak, warmup_fraction=f, min_warmup=floor), 256)
    progress = step / budget
    ramp = min(progress / f, max(step / floor, progress / FLOOR_CAP))
    assert sched.lr(step, progress) == pytest.approx(peak * min(ramp, ramp**-0.5), rel=1e-12)
    assert sched.lr(200, 0.1) == pytest.approx(peak)  # 2000 updates: the peak where the 10% warmup ends
    assert sched.lr(80, 0.4) == pytest.approx(peak)  # 200 updates: where the floor's warmup ends
    assert sched.lr(160, 0.8) == pytest.approx(peak * math.sqrt(80 / 160))


def test_progress_is_the_bound_reached_first():
    assert horizon_progress(50, 1.0, 100, 0) == 0.5
    assert horizon_progress(50, 15.0, 100, 20) == 0.75  # the clock is ahead of the update count
    assert horizon_progress(90, 1.0, 100, 20) == 0.9
    assert horizon_progress(5, 30.0, 0, 20) == 1.0  # capped
    assert horizon_progress(5, 3.0, 0, 0) == 0.0  # no bound known


def test_schedule_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(overrides=["train.warmup_fraction=0.1"])
    with pytest.raises(ConfigError, match="warmup_fraction"):
        load_config(overrides=["train.warmup_fraction=1.5", "train.lr=0.001"])
    with pytest.raises(ConfigError, match="lr_scale"):
        load_config(overrides=["train.lr=0.001", "train.lr_scale=0.5"])
    with pytest.raises(ConfigError, match="decay_fraction"):
        load_config(overrides=["train.decay_fraction=0.2"])  # inverse_sqrt has no end to decay to
    with pytest.raises(ConfigError, match="snapshot_span"):
        load_config(overrides=["train.snapshot_span=-0.1"])
    with pytest.raises(ConfigError, match="min_warmup"):
        load_config(overrides=["train.min_warmup=80"])  # a floor under nothing: the warmup is in updates
    with pytest.raises(ConfigError, match="min_warmup"):
        load_config(overrides=["train.min_warmup=-1", "train.lr=0.001", "train.warmup_fraction=0.1"])
    with pytest.raises(ConfigError, match="'linear'"):
        load_config(overrides=["train.schedule=linaer"])


def test_step_counts_from_one():
    with pytest.raises(ValueError, match="from 1"):
        inverse_sqrt_lr(0, 512, 4000)


def test_optimizer_is_paper_adam_or_adamw_with_decay():
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(params, TrainConfig())
    assert type(opt) is torch.optim.Adam
    g = opt.param_groups[0]
    assert g["betas"] == (0.9, 0.98) and g["eps"] == 1e-9 and g["weight_decay"] == 0
    opt = build_optimizer(params, TrainConfig(weight_decay=0.01))
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.01
