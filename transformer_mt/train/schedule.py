"""The paper's learning-rate schedule (Vaswani et al., 2017, eq. 3) and the optimizer it drives."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from transformer_mt.config import TrainConfig


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), with ``step`` counted from 1.

    Linear warm-up for ``warmup`` updates, then decay with the inverse square
    root of the update number; the peak, at ``step == warmup``, is
    ``scale * (d_model * warmup)^-0.5`` (7.0e-4 for the base model).
    """
    if step < 1:
        raise ValueError(f"the schedule counts updates from 1, got step {step}")
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 update, got {warmup}")
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def lr_function(d_model: int, warmup: int, scale: float) -> Callable[[int], float]:
    """The schedule with the model's constants bound: ``lr_at(step)``."""
    return functools.partial(inverse_sqrt_lr, d_model=d_model, warmup=warmup, scale=scale)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply the schedule directly: the schedule's only state is the update number, saved in the checkpoint."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam(beta1, beta2, eps) as in the paper; AdamW (decoupled decay) only when ``weight_decay > 0``.

    The initial lr is a placeholder: the trainer sets the scheduled lr before every update.
    """
    kwargs = {"lr": 0.0, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    if cfg.weight_decay > 0:
        return torch.optim.AdamW(params, weight_decay=cfg.weight_decay, **kwargs)
    return torch.optim.Adam(params, **kwargs)
