"""Learning-rate schedules: the paper's (Vaswani et al., 2017, eq. 3) and budget-aware variants, and the optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


# `train.min_warmup` never takes more than this share of the budget: a run far slower than its floor assumed
# (a busy machine, a tiny time budget) still leaves its warmup halfway and trains at the peak.
FLOOR_CAP = 0.5


def warmup_ramp(step: int, progress: float, schedule: Schedule) -> float:
    """How far through its warmup update ``step`` is: below 1 while warming up, the fraction of the peak reached.

    ``step / warmup`` (warmup in updates), or ``progress / warmup_fraction``;
    with ``min_warmup`` as well, the slower of that and ``step / min_warmup``
    (but never slower than ``progress / FLOOR_CAP``), so that a tiny budget
    still warms up over enough updates for post-norm to stay stable.
    """
    f, floor = schedule.warmup_fraction, schedule.min_warmup
    if f <= 0:
        return step / schedule.warmup
    progress = min(max(progress, 0.0), 1.0)
    ramp = progress / f
    if floor > 0:
        ramp = min(ramp, max(step / floor, progress / FLOOR_CAP))
    return ramp


def warmup_decay_lr(step: int, progress: float, schedule: Schedule) -> float:
    """The learning rate of update ``step`` (from 1), ``progress`` (0..1) of the way through the run's horizon.

    ``lr = peak * min(ramp, decay)``, the ramp from `warmup_ramp`. The decay
    after it:

    - ``inverse_sqrt``: ``ramp^-1/2``, that is ``sqrt(warmup / step)`` or
      ``sqrt(warmup_fraction / progress)``: with the paper's peak this is
      exactly eq. 3 (`inverse_sqrt_lr`);
    - ``linear``: from the peak at the end of warmup to 0 at the end of the horizon;
    - ``cosine``: half a cosine over the same span.

    With ``decay_fraction`` d > 0, ``linear`` and ``cosine`` hold the peak
    after warmup and decay only over the last d of the horizon
    (warmup-stable-decay): a short run learns at the full rate for longest and
    still ends annealed.

    ``progress`` is the larger of ``update / max_updates`` and ``minutes /
    max_minutes`` (see `horizon_progress`), so a run bounded by the clock
    finishes its warmup and its decay within its budget however fast it runs.
    """
    if step < 1:
        raise ValueError(f"the schedule counts updates from 1, got step {step}")
    f, d = schedule.warmup_fraction, schedule.decay_fraction
    p = min(max(progress, 0.0), 1.0)
    ramp = warmup_ramp(step, p, schedule)
    if schedule.kind == "inverse_sqrt":
        decay = 1.0 / math.sqrt(ramp) if ramp > 0 else 1.0
    else:
        # t: how much of the decay span (0..1) lies behind; 0 while warming up or holding the peak
        if d > 0:
            t = max(p - (1.0 - d), 0.0) / d
        elif f > 0:
            t = max(p - f, 0.0) / (1.0 - f)
        else:
            t = p if step >= schedule.warmup else 0.0
        decay = 1.0 - t if schedule.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return schedule.peak * max(min(ramp, decay), 0.0)


@dataclass(frozen=True)
class Schedule:
    """The run's learning-rate schedule: ``lr(step, progress)``; see `warmup_decay_lr`."""

    kind: str  # inverse_sqrt (the paper), linear or cosine
    peak: float  # lr at the end of warmup
    warmup: int  # warmup in updates (used when warmup_fraction is 0)
    warmup_fraction: float  # warmup as a fraction of the horizon; 0: use `warmup`
    decay_fraction: float = 0.0  # linear/cosine: decay over this last fraction of the horizon only; 0: all after warmup
    min_warmup: int = 0  # with warmup_fraction: warm up over at least this many updates (at most FLOOR_CAP); 0: none

    @classmethod
    def from_config(cls, cfg: TrainConfig, d_model: int) -> Schedule:
        """``train.lr`` is the peak; 0 means the paper's ``lr_scale * (d_model * warmup)^-0.5``."""
        peak = cfg.lr if cfg.lr > 0 else cfg.lr_scale * (d_model * cfg.warmup) ** -0.5
        return cls(cfg.schedule, peak, cfg.warmup, cfg.warmup_fraction, cfg.decay_fraction, cfg.min_warmup)

    def lr(self, step: int, progress: float) -> float:
        return warmup_decay_lr(step, progress, self)

    def warming_up(self, step: int, progress: float) -> bool:
        """Whether update ``step`` is still inside the warmup: a run stopped there has not trained at full lr."""
        return warmup_ramp(step, progress, self) < 1.0


def horizon_progress(update: int, minutes: float, max_updates: int, max_minutes: float) -> float:
    """How far the run is through its budget, 0..1: the larger of the update and wall-clock fractions.

    A bound of 0 is no bound. With neither bound the horizon is unknown: 0.
    """
    fractions = [update / max_updates if max_updates > 0 else 0.0, minutes / max_minutes if max_minutes > 0 else 0.0]
    return min(max(fractions), 1.0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply the schedule directly: the schedule's only state is the update number, saved in the checkpoint."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam(beta1, beta2, eps) as in the paper; AdamW (decoupled decay) only when ``weight_decay > 0``.

    The initial lr is a placeholder: the trainer sets the scheduled lr before every update. Fused when
    every parameter is on CUDA or every one on the CPU: one kernel for all parameters, on CUDA a step it
    can skip on the device (which keeps the update free of host synchronization), on the CPU 3x faster
    than torch's default loop over parameters (13 against 42 ms per update for 7.6M parameters).
    """
    params = list(params)
    kwargs: dict[str, Any] = {"lr": 0.0, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    if params and len({p.device.type for p in params}) == 1 and params[0].device.type in ("cuda", "cpu"):
        kwargs["fused"] = True
    if cfg.weight_decay > 0:
        return torch.optim.AdamW(params, weight_decay=cfg.weight_decay, **kwargs)
    return torch.optim.Adam(params, **kwargs)


IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable")  # how Adam runs, not what it computes


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a saved optimizer state, keeping this optimizer's implementation (fused, or what a newer torch picks).

    A state dict carries its param groups' implementation flags and loading
    adopts them, so without this a checkpoint written by an unfused run (an
    older version, other hardware) would switch this run to torch's slower
    loop over parameters, on a GPU with its step counts on the host.
    """
    groups = [
        {**saved, **{k: mine[k] for k in IMPLEMENTATION_FLAGS if k in mine}}
        for saved, mine in zip(state["param_groups"], optimizer.param_groups, strict=False)
    ]  # a different number of groups is load_state_dict's error to report
    optimizer.load_state_dict({**state, "param_groups": groups})
