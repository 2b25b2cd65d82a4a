"""What a run does about non-finite updates: skip them, warn, and stop once training has diverged.

One policy for both ways the trainer learns of a skip: at once, after each
update, when the host reads the update's figures (`NonfinitePolicy.skipped`),
or in arrears, at the next log line, validation or checkpoint, from the
device's counts (`NonfinitePolicy.settled`, with ``Stepper.defer_sync``). An
fp16 overflow is the loss scaler's business (it lowers the scale and the step
is skipped): it neither warns nor counts towards train.max_nonfinite, but a
scale below `MIN_FP16_SCALE` means the gradients keep overflowing.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from transformer_mt.config import TrainConfig
from transformer_mt.train.step import TrainError, UpdateStats

MIN_FP16_SCALE = 1e-4  # below this loss scale fp16 training has diverged (fairseq's min_loss_scale)


@dataclass
class NonfinitePolicy:
    """Counts non-finite updates in a row (not saved: a resumed run starts at 0) and stops the run at the limit."""

    tc: TrainConfig
    scaler: torch.amp.GradScaler
    is_main: bool  # warnings on rank 0 only
    in_row: int = 0  # non-finite updates in a row, as the host has seen them

    def stepped(self) -> None:
        """An update was applied: the run of non-finite ones is broken."""
        self.in_row = 0

    def skipped(self, stats: UpdateStats, update: int) -> None:
        """A host-synced update was skipped (``stats.stepped`` False) after ``update`` updates."""
        if stats.tokens == 0:
            return
        if self.scaler.is_enabled() and math.isfinite(stats.loss_sum):
            self.check_scale(f"at update {update}")
            return
        self.in_row += 1
        if self.is_main:
            tqdm.write(f"warning: non-finite loss or gradient after update {update}; update skipped", file=sys.stderr)
        self.check_run(self.in_row, f"after update {update}")

    def settled(self, skipped: int, worst_run: int, update: int) -> None:
        """The device skipped ``skipped`` deferred updates up to ``update``, at most ``worst_run`` non-finite in a row."""
        if skipped and self.is_main and not self.scaler.is_enabled():
            tqdm.write(
                f"warning: {skipped} update(s) up to update {update} had a non-finite loss or gradient; skipped",
                file=sys.stderr,
            )
        self.check_run(worst_run, f"by update {update}")
        if skipped and self.scaler.is_enabled():
            self.check_scale(f"by update {update}")

    def check_run(self, run: int, when: str) -> None:
        """Stop once train.max_nonfinite updates in a row were non-finite: training has diverged."""
        if run >= self.tc.max_nonfinite:
            raise TrainError(
                f"{run} updates in a row had a non-finite loss or gradient ({when}); lower train.lr_scale "
                f"(now {self.tc.lr_scale}), set train.clip_norm (e.g. 1.0), or use train.precision=bf16 instead of fp16"
            )

    def check_scale(self, when: str) -> None:
        """Stop once the fp16 loss scale fell below `MIN_FP16_SCALE`: the gradients keep overflowing."""
        if self.scaler.is_enabled() and self.scaler.get_scale() < MIN_FP16_SCALE:
            raise TrainError(
                f"fp16 loss scale fell below {MIN_FP16_SCALE} {when}: gradients keep overflowing; "
                "use train.precision=bf16 (or fp32), lower train.lr_scale or set train.clip_norm"
            )
