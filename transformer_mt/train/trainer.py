"""The training loop: which batches, when to validate, save and stop.

One update = ``train.update_freq`` batches on each of the world's ranks; how
one update is computed (precision, token-normalized accumulation, the step)
lives in ``step.py``; what a run is built from (data, model, optimizer) in
``build.py``; its parts in modules named for them: ``resume.py`` (finding,
checking and restoring a run), ``budget.py`` (progress, horizon, snapshots,
the clock), ``epochs.py`` (the epoch's batches and the position in it),
``run_log.py`` (the metric window, log lines and records), ``nonfinite.py``
(skipped updates and divergence) and ``validation.py``.

Everything that decides the trajectory lives in the checkpoint (weights,
optimizer, update number, epoch and position in the epoch's batch order, every
rank's RNG state), so a run interrupted and resumed follows the same
trajectory, bit for bit on CPU, as a run never stopped.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer_mt.checkpoint import Checkpoint, TrainingProgress, TrainingState, write_checkpoint
from transformer_mt.config import Config
from transformer_mt.cpus import use_threads
from transformer_mt.data.dataset import Batch
from transformer_mt.malloc import release_free_memory
from transformer_mt.progress import Bar, progress
from transformer_mt.run_names import BEST_NAME, checkpoint_name
from transformer_mt.train.budget import Budget, Clock, horizon_updates, stop_reason
from transformer_mt.train.build import build_stepper, load_run_data
from transformer_mt.train.distributed import DistEnv, barrier, cleanup, peer_ended, setup
from transformer_mt.train.epochs import Epochs
from transformer_mt.train.nonfinite import NonfinitePolicy
from transformer_mt.train.prefetch import prefetched
from transformer_mt.train.resume import interrupted, resume, start_from_weights
from transformer_mt.train.run_checkpoints import prune_checkpoints, strip_older_checkpoints
from transformer_mt.train.run_files import RunFiles, rng_state
from transformer_mt.train.run_lock import hold_run_dir
from transformer_mt.train.run_log import RunLog, Window, final_warnings
from transformer_mt.train.schedule import Schedule
from transformer_mt.train.step import UpdateStats, accumulate_gradients, apply_gradients
from transformer_mt.train.validation import ValidBleu, collapse_warning, record_validation, validate_directions


@dataclass
class TrainResult:
    """What `train_model` returns: the final position and validation figures (per target token, nats)."""

    update: int
    epoch: int
    valid_loss: float | None
    valid_nll: float | None
    best_valid_loss: float
    save_dir: Path
    stop_reason: str
    too_long_train: int = 0  # training sentences left out: longer than min(max_tokens, max_positions)
    too_long_valid: int = 0  # validation sentences left out, same limit
    best_valid_bleu: float | None = None  # best validation sacreBLEU (None without train.valid_bleu_sentences)
    warnings: tuple[str, ...] = ()  # what the run warned about at its end (warmup, convergence), as printed


class Trainer:
    """One training run: built by `train_model`, driven by `run`."""

    def __init__(self, cfg: Config, env: DistEnv, clock: Clock = time.monotonic) -> None:
        started, tc = clock(), cfg.train
        self.cfg, self.env, self.save_dir = cfg, env, Path(tc.save_dir)
        self.data = load_run_data(cfg, env)
        self.stepper = build_stepper(cfg, env, self.data.vocab_size)
        self.schedule = Schedule.from_config(tc, cfg.model.d_model)
        self.valid_bleu = ValidBleu(cfg, self.stepper.module, self.data.dir, env) if tc.valid_bleu_sentences else None
        self.window = Window()  # the updates since the last metric line
        self.epochs = Epochs(cfg, env, self.data)
        resumed = resume(cfg, env, self.stepper, self.data, self.epochs)
        if tc.init_from:
            start_from_weights(cfg, env, self.stepper, self.data, None if resumed is None else resumed.update)
        p = self.progress = resumed or TrainingProgress()  # where the run is: saved in every checkpoint
        self.last_save_update = p.update if resumed else -1
        self.last_save_minutes = p.minutes  # the run's clock in the last periodic checkpoint, where a resume goes on
        horizon = horizon_updates(tc, len(self.epochs.batches(p.epoch)))
        self.budget = Budget(tc, horizon, p.minutes, started, clock)
        self.budget.begin(p.update)
        self.nonfinite = NonfinitePolicy(tc, self.stepper.scaler, env.is_main)
        self.lr = 0.0  # the lr of the last update
        self.stop_reason = ""  # why the run stops, as a user would set it ("max_updates=100"); "" while it runs
        self.last_valid_nll: float | None = None  # NLL of this process's last validation
        files = RunFiles.open(self.save_dir, None if resumed is None else p.update) if env.is_main else None
        self.log = RunLog(cfg, env, self.data, self.stepper, files)
        if env.is_main:
            self.log.announce(p.update)

    def run(self) -> TrainResult:
        """Train until a budget (or patience) stops the run; validate and save at the end."""
        p, tc = self.progress, self.cfg.train
        self.stepper.model.train()
        bar = progress(
            total=self.budget.horizon or None, initial=p.update, disable=not self.env.is_main or self.log.log_lines,
            unit="upd", dynamic_ncols=True, desc="train",
        )  # fmt: skip
        self.stop_reason = self._spent()
        if not self.stop_reason:
            for (_, epoch, position), batches in prefetched(
                self.epochs.updates(p.epoch, p.batch_in_epoch), self.epochs.collate
            ):
                p.epoch, p.batch_in_epoch = epoch, position
                stats = self._update(batches)
                self._after_update(stats, bar)
                self._save_or_stop(stats)
                if self.stop_reason:
                    break
            else:
                self.stop_reason = self.stop_reason or stop_reason(tc, "max_epochs")  # every group of the last epoch
        bar.close()
        return self._finish()

    def _spent(self) -> str:
        """Why a resumed run has nothing left to train, as a user would set it; "" when it has."""
        p, tc = self.progress, self.cfg.train
        if tc.max_updates > 0 and p.update >= tc.max_updates:
            return stop_reason(tc, "max_updates")
        if p.update > 0 and tc.max_minutes > 0 and p.minutes >= tc.max_minutes:
            return stop_reason(tc, "max_minutes")  # spent before this process: no update at lr 0
        if tc.patience > 0 and p.stale_validations >= tc.patience:  # resumed after patience had stopped it
            return stop_reason(tc, "patience")
        return ""

    def _update(self, batches: list[Batch | None]) -> UpdateStats:
        """One update from this rank's ``batches`` (every rank takes part): gradients, lr, optimizer step."""
        stats = accumulate_gradients(self.stepper, batches)
        update = self.progress.update + 1
        self.lr = self.schedule.lr(update, self.budget.progress(update))
        return apply_gradients(self.stepper, stats, self.lr)

    def _after_update(self, stats: UpdateStats, bar: Bar) -> None:
        """Count the update (or the skip), log, validate every train.validate_every updates."""
        p, tc, window = self.progress, self.cfg.train, self.window
        if not stats.stepped:
            self.nonfinite.skipped(stats, p.update)
            return
        p.update += 1
        self.nonfinite.stepped()
        window.add(stats)
        log = p.update % tc.log_every == 0
        if log:
            self._settle()
        if self.env.is_main:
            bar.update(1)
            if log or not self.stepper.defer_sync:  # deferred figures are read at log lines only
                self.log.show(window, bar, log, p, self.lr, self.budget)
        if log:
            window.reset()
            release_free_memory()  # freed blocks of varying batch shapes fragment the heap (transformer_mt/malloc.py)
        due = tc.validate_every > 0 and p.update % tc.validate_every == 0
        if due and self.budget.claim_validation("count", p.update, p.valid_update):
            self._settle()
            self._validate()

    def _save_or_stop(self, stats: UpdateStats) -> None:
        """After an update: a validation on the clock, a checkpoint when one is due, the stop once a budget is spent.

        Agreeing on the clock is a collective the host waits for, so GPUs under
        DDP (which must not wait for the device) ask only at log lines.
        """
        p, tc = self.progress, self.cfg.train
        ask = not (self.stepper.defer_sync and self.env.distributed and p.update % tc.log_every)
        clock = self.budget.time_flags(self.env, ask)
        if clock.validate and self.budget.claim_validation("clock", p.update, p.valid_update):
            self._settle()
            self._validate()
        snapshot = self.budget.snapshot_due(p.update)  # always: it advances the count even when a save is due anyway
        periodic = tc.save_every_updates > 0 and p.update % tc.save_every_updates == 0
        if stats.stepped and (periodic or clock.save or snapshot):
            self._settle()
            self._save()
        at_limit = tc.max_updates > 0 and p.update >= tc.max_updates
        if at_limit:
            self._settle()  # the count may include updates the device skipped, unseen by the host so far
            at_limit = p.update >= tc.max_updates
        if at_limit:
            self.stop_reason = stop_reason(tc, "max_updates")
        elif clock.stop:
            self.stop_reason = stop_reason(tc, "max_minutes")

    def _settle(self) -> None:
        """Read the device's figures of the updates since the last metric line, and uncount those it skipped.

        Only a stepper that defers host synchronization leaves anything to read: it counts every update as taken
        and the device skips a non-finite one, so the host learns of a skip here, at the next log line, validation,
        checkpoint or update limit. Until then the learning rate runs one update ahead per unseen skip.
        """
        skipped, worst_run = self.window.settle()
        self.progress.update -= skipped
        self.nonfinite.settled(skipped, worst_run, self.progress.update)

    def _checkpoint(self) -> Checkpoint:
        """Everything that decides the rest of the run; a collective (the RNG states of every rank)."""
        scaler, p = self.stepper.scaler, self.progress
        return Checkpoint(
            model=self.stepper.module.state_dict(),
            config=self.cfg,
            spm_model=self.data.spm_model,
            progress=dataclasses.replace(p, minutes=self.budget.minutes()),
            training=TrainingState(
                optimizer=self.stepper.optimizer.state_dict(),
                rng=rng_state(self.env),  # a collective: every rank calls _save
                scaler=scaler.state_dict() if scaler.is_enabled() else {},
                batching=dataclasses.replace(
                    self.data.batching, batches=len(self.epochs.batches(p.epoch))
                ),  # resume.py
            ),
        )

    def _save(self, best: bool = False) -> None:
        """Write checkpoint_u<update>.pt (or checkpoint_best.pt) from rank 0; every rank must call it."""
        ck = self._checkpoint()
        if self.env.is_main:
            path = self.save_dir / (BEST_NAME if best else checkpoint_name(self.progress.update))
            write_checkpoint(path, ck)
            if not best:
                prune_checkpoints(self.save_dir, self.cfg.train.keep_last)
                strip_older_checkpoints(self.save_dir, path)  # only the newest (and the best) can resume
        if not best:
            self.last_save_update, self.last_save_minutes = self.progress.update, ck.progress.minutes
            self.budget.saved()
        barrier(self.env)

    def _validate(self) -> tuple[float, float]:
        """Loss (and BLEU) on the validation split; keep checkpoint_best.pt and the patience count up to date."""
        p, tc = self.progress, self.cfg.train
        module, precision = self.stepper.module, self.stepper.precision
        loss, nll, by_direction = validate_directions(module, self.data, self.cfg, self.env, precision)
        bleu = self.valid_bleu() if self.valid_bleu is not None else None
        improved = record_validation(p, loss, nll, bleu, tc.best_metric)
        if self.log.files is not None:
            self.log.valid(p, loss, nll, bleu, self.budget.minutes(), by_direction)
            if collapsed := collapse_warning(self.stepper.module, self.data, self.env.device, p.update, tc.lr):
                self.log.warn("collapsed_encoder", p.update, collapsed)
        if improved:
            self._save(best=True)
        if tc.patience > 0 and p.stale_validations >= tc.patience and not self.stop_reason:
            self.stop_reason = stop_reason(tc, "patience")  # run() stops after this update
        self.last_valid_nll = nll
        return loss, nll

    def _finish(self) -> TrainResult:
        """The final validation and checkpoint (unless the last update had them), the end record, the result."""
        p = self.progress
        self._settle()
        nll = self.last_valid_nll
        validated = p.valid_update != p.update
        if validated:
            _, nll = self._validate()
        if self.last_save_update != p.update or validated:
            self._save()  # last, so that no record is later than the checkpoint a resume starts from
        elif self.env.is_main:  # a run found finished: end the strip that a kill may have cut short at its last save
            strip_older_checkpoints(self.save_dir, self.save_dir / checkpoint_name(p.update))
        warnings = final_warnings(self.cfg.train, p, self.schedule, self.budget.progress(p.update), self.log.trained)
        if self.log.files is not None:
            self.log.done(p, self.stop_reason, self.last_save_minutes, warnings)
        return TrainResult(
            p.update, p.epoch, p.valid_loss, nll, p.best_valid_loss, self.save_dir, self.stop_reason,
            self.data.too_long["train"], self.data.too_long["valid"],
            best_valid_bleu=p.best_valid_bleu if p.valid_bleu is not None else None,
            warnings=tuple(message for _, message in warnings),
        )  # fmt: skip


def train_model(cfg: Config, clock: Clock = time.monotonic) -> TrainResult:
    """Train (or resume) the run described by ``cfg`` until train.max_updates / max_epochs / max_minutes.

    Works the same alone or under torchrun; rank 0 writes all files and holds
    the run directory's lock (`hold_run_dir`), so a second trainer on the same
    train.save_dir stops before it touches anything. ``clock`` is the run's
    wall clock (seconds), which its time budget counts.
    """
    threads = torch.get_num_threads()
    chosen = use_threads(cfg.train.num_threads)
    env = setup()
    if env.is_main and env.device.type == "cpu":
        print(f"threads: {chosen.why}", file=sys.stderr)
    try:
        with hold_run_dir(Path(cfg.train.save_dir), env):
            trainer = Trainer(cfg, env, clock)
            try:
                return trainer.run()
            except KeyboardInterrupt:
                raise interrupted(trainer.progress.update, trainer.save_dir) from None
    except RuntimeError as e:  # a collective whose peer process ended: one line, not the transport's traceback
        if (ended := peer_ended(e, env)) is None:
            raise
        raise ended from None
    finally:
        cleanup(env)
        torch.set_num_threads(threads)
