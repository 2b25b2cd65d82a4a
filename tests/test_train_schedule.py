"""The paper's learning-rate schedule (eq. 3) and the optimizer settings."""

import pytest
import torch

from transformer_mt.config import TrainConfig
from transformer_mt.train.schedule import build_optimizer, inverse_sqrt_lr, lr_function


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
    lr = lr_function(512, 4000, 1.0)
    assert lr(2000) == pytest.approx(lr(1000) * 2)
    assert lr(16_000) == pytest.approx(lr(4000) / 2)


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
