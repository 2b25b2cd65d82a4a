"""The run's budget: how far through it the run is, when it snapshots, validates on the clock, stops by time.

A run ends at the first of train.max_updates, train.max_epochs and
train.max_minutes; its progress (0..1) is the larger of the update and the
wall-clock fraction (`horizon_progress`), which the schedule, the snapshots
for averaging and the estimate of the time left all read. The wall clock is
counted across resumes: a checkpoint records the minutes trained before it
(`TrainingProgress.minutes`), and a resumed process goes on from them.

The clock is a parameter (``time.monotonic`` in a real run), so a test can
drive a timed run with a clock of its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from transformer_mt.config import TrainConfig
from transformer_mt.train.distributed import DistEnv, all_reduce_sum
from transformer_mt.train.schedule import horizon_progress

Rule = Literal["count", "clock"]  # what made a validation due: train.validate_every, or a clock mark

Clock = Callable[[], float]  # seconds, monotonic


def stop_reason(tc: TrainConfig, key: str) -> str:
    """``key=value`` for the train setting ``key`` that stops the run, as a user sets it (``max_minutes=60``): one
    spelling in the log line, the end record of metrics.jsonl and `TrainResult`, whatever the value's type."""
    value = getattr(tc, key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 60.0 from a YAML 60 or a default: the user wrote 60
    return f"{key}={value}"


def horizon_updates(tc: TrainConfig, batches_per_epoch: int) -> int:
    """The update count at which the run ends by train.max_updates or train.max_epochs (0: no such bound)."""
    bounds = [tc.max_updates] if tc.max_updates > 0 else []
    if tc.max_epochs > 0:
        bounds.append(tc.max_epochs * math.ceil(batches_per_epoch / tc.update_freq))
    return min(bounds) if bounds else 0


def snapshots_before(tc: TrainConfig, progress: float) -> int:
    """How many of the ``average_last`` snapshot points (spread over the last ``snapshot_span``) lie at or
    before ``progress``: point i of k sits at ``1 - span + span * i / k``, the last at the end of the budget."""
    if tc.snapshot_span <= 0:
        return 0
    k, span = tc.average_last, tc.snapshot_span
    return sum(1 for i in range(1, k + 1) if progress >= 1.0 - span + span * i / k)


def clock_marks(tc: TrainConfig, minutes: float) -> int:
    """How many train.validate_every_fraction marks of train.max_minutes lie at or before ``minutes``.

    Mark i sits at ``i * fraction * max_minutes``; without a time budget (or
    with the fraction 0) there is none. A count of fixed marks, not a time
    since the last validation, so that a resumed run finds from its
    checkpoint's minutes which marks are behind it.
    """
    if tc.max_minutes <= 0 or tc.validate_every_fraction <= 0:
        return 0
    return math.floor(minutes / (tc.validate_every_fraction * tc.max_minutes) + 1e-9)


def close_behind(update: int, other: int | None, validate_every: int) -> bool:
    """Whether the last validation by the other rule (train.validate_every's count or the clock's marks), at update
    ``other`` (None: none yet in this process), lies fewer than a tenth of validate_every updates (at least one)
    before ``update``: then a validation due by this rule is skipped.

    The two rules run independently, so a clock mark can fall one update before
    a multiple of validate_every; a second validation there shows nothing new
    and, for a model of many directions, costs most of a minute. Validations by
    the same rule are never skipped: clock marks stay at every fraction of the
    budget, however close together in updates.
    """
    return other is not None and update - other < max(1, validate_every // 10)


@dataclass
class TimeFlags:
    """What the wall clock asks for after an update, agreed by every rank (`Budget.time_flags`)."""

    stop: bool = False  # train.max_minutes is spent
    save: bool = False  # train.save_every_minutes have passed since the last checkpoint
    validate: bool = False  # the clock passed another train.validate_every_fraction mark


@dataclass
class Budget:
    """The budget of one process's part of a run: its clock, its horizon, the snapshots and clock marks behind it."""

    tc: TrainConfig
    horizon: int  # `horizon_updates`
    minutes_before: float  # trained before this process (the resumed checkpoint's `TrainingProgress.minutes`)
    start: float  # the clock when this process started
    clock: Clock = time.monotonic
    last_save_time: float = field(init=False)  # the clock at the last periodic checkpoint (or the start)
    snapshots_done: int = field(init=False, default=0)  # snapshot points passed (`begin` counts a resumed run's)
    marks_done: int = field(init=False)  # clock marks passed (`clock_marks`)
    validated_by: dict[Rule, int] = field(init=False, default_factory=dict)  # each rule's last validation

    def __post_init__(self) -> None:
        self.last_save_time = self.start
        self.marks_done = clock_marks(self.tc, self.minutes_before)

    def begin(self, update: int) -> None:
        """Count the snapshot points already behind a run at ``update`` (a resumed one), so none is taken again."""
        self.snapshots_done = snapshots_before(self.tc, self.progress(update))

    def claim_validation(self, rule: Rule, update: int, valid_update: int) -> bool:
        """Whether a validation due by ``rule`` (validate_every's count, or a clock mark) at ``update`` runs, noted
        if so: not when this update has had one (``valid_update``) or the other rule's last lies `close_behind`."""
        other = self.validated_by.get("clock" if rule == "count" else "count")
        if valid_update == update or close_behind(update, other, self.tc.validate_every):
            return False
        self.validated_by[rule] = update
        return True

    def minutes(self) -> float:
        """Wall-clock minutes trained in this run, resumed processes included."""
        return self.minutes_before + (self.clock() - self.start) / 60

    def progress(self, update: int) -> float:
        """How far through its budget the run is (0..1) after ``update`` updates."""
        return horizon_progress(update, self.minutes(), self.horizon, self.tc.max_minutes)

    def snapshot_due(self, update: int) -> bool:
        """Whether the update just taken crossed the next snapshot point (a checkpoint for averaging)."""
        reached = snapshots_before(self.tc, self.progress(update))
        due, self.snapshots_done = reached > self.snapshots_done, max(reached, self.snapshots_done)
        return due

    def time_flags(self, env: DistEnv, ask: bool) -> TimeFlags:
        """Stop, save and validate by the wall clock, agreed by all ranks (any rank's clock can trigger).

        Agreeing is a collective; ``ask`` False (a GPU under DDP between log
        lines, which must not wait for the device) skips it and the clock.
        """
        if not ask:
            return TimeFlags()
        tc = self.tc
        minutes = self.minutes()
        stop = tc.max_minutes > 0 and minutes >= tc.max_minutes
        save = tc.save_every_minutes > 0 and self.clock() - self.last_save_time >= tc.save_every_minutes * 60
        marks = clock_marks(tc, minutes)
        validate, self.marks_done = marks > self.marks_done, max(marks, self.marks_done)
        stop_n, save_n, validate_n = all_reduce_sum([float(stop), float(save), float(validate)], env)
        return TimeFlags(stop_n > 0, save_n > 0, validate_n > 0)

    def saved(self) -> None:
        """A periodic checkpoint was written: train.save_every_minutes counts from now."""
        self.last_save_time = self.clock()

    def bound(self, update: int) -> str:
        """The budget that ends this run first, as a user would write it."""
        tc = self.tc
        by_time = tc.max_minutes > 0 and (not self.horizon or self.minutes() / tc.max_minutes >= update / self.horizon)
        if by_time:
            return stop_reason(tc, "max_minutes")
        if tc.max_updates > 0 and self.horizon == tc.max_updates:
            return stop_reason(tc, "max_updates")
        return stop_reason(tc, "max_epochs") if tc.max_epochs > 0 else "no bound"

    def time_left(self, update: int) -> str:
        """An estimate of the wall-clock time to the end of the budget, from this run's pace so far."""
        progress, minutes = self.progress(update), self.minutes()
        if progress <= 0:
            return "?"
        seconds = round(max(minutes / progress - minutes, 0.0) * 60)
        hours, rest = divmod(seconds, 3600)
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
