"""The training loop: token-normalized gradient accumulation, the paper's schedule, exact resume, DDP.

One update = ``train.update_freq`` batches on each of the world's ranks; how
one update is computed (precision, token-normalized accumulation, the step)
lives in ``step.py``; what a run is built from (data, model, optimizer) in
``build.py``; validation in ``validation.py``. This module decides which
batches, when to validate, save and stop.

Everything that decides the trajectory lives in the checkpoint (weights,
optimizer, update number, epoch and position in the epoch's batch order, every
rank's RNG state), so a run interrupted and resumed follows the same
trajectory, bit for bit on CPU, as a run never stopped.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from transformer_mt.checkpoint import Checkpoint, Progress, TrainingState, write_checkpoint
from transformer_mt.config import Config, config_from_dict, field_differences
from transformer_mt.data.batching import epoch_batches, resume_position
from transformer_mt.data.dataset import Batch, collate, pad_to_multiple
from transformer_mt.malloc import release_free_memory
from transformer_mt.model.transformer import count_parameters, flops_per_token
from transformer_mt.train.build import build_stepper, compiled_graphs, load_run_data
from transformer_mt.train.checkpoint import (
    BEST_NAME,
    checkpoint_name,
    find_resume_checkpoint,
    prune_checkpoints,
    strip_older_checkpoints,
)
from transformer_mt.train.distributed import DistEnv, all_reduce_sum, barrier, cleanup, setup
from transformer_mt.train.init_from import load_init_weights
from transformer_mt.train.loss import perplexity
from transformer_mt.train.mfu import device_peak_flops, throughput_figures
from transformer_mt.train.prefetch import prefetched
from transformer_mt.train.run_files import (
    RunFiles,
    batching_changes,
    restore_rng,
    rng_state,
    start_record,
    write_config,
)
from transformer_mt.train.run_lock import hold_run_dir
from transformer_mt.train.schedule import Schedule, horizon_progress, load_optimizer_state
from transformer_mt.train.step import TrainError, UpdateStats, accumulate_gradients, apply_gradients, cpu_has_bf16
from transformer_mt.train.validation import ValidBleu, unconverged, validate

MIN_FP16_SCALE = 1e-4  # below this loss scale fp16 training has diverged (fairseq's min_loss_scale)


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


@dataclass
class Window:
    """Sums over the updates since the last metric line (all ranks): what a `train` record averages.

    With a stepper that defers host synchronization the sums are device
    tensors until `settle` reads them all at once (the update's only wait).
    """

    loss: float | torch.Tensor = 0.0  # label-smoothed loss, nats, summed over target tokens
    nll: float | torch.Tensor = 0.0
    tokens: float | torch.Tensor = 0.0  # target tokens
    sentences: float | torch.Tensor = 0.0
    gnorm: float | torch.Tensor = 0.0  # summed over updates
    updates: int = 0  # counted on the host, skipped ones included until `settle`
    start: float = field(default_factory=time.monotonic)  # seconds, monotonic clock
    skipped: float | torch.Tensor = 0.0  # updates the device skipped (non-finite), not yet settled
    nonfinite_run: float | torch.Tensor = 0.0  # non-finite updates in a row up to the latest (kept by `reset`)
    worst_run: float | torch.Tensor = 0.0  # the longest such run since the last `settle`

    def add(self, stats: UpdateStats) -> None:
        self.loss += stats.loss_sum
        self.nll += stats.nll_sum
        self.tokens += stats.tokens
        self.sentences += stats.sentences
        self.gnorm += stats.gnorm
        self.updates += 1
        if isinstance(stats.skipped, torch.Tensor):  # deferred: the run of non-finite updates, on the device
            self.skipped = stats.skipped + self.skipped
            self.nonfinite_run = (self.nonfinite_run + stats.nonfinite) * stats.nonfinite
            run, worst = self.nonfinite_run, self.worst_run
            self.worst_run = torch.maximum(run, worst) if isinstance(worst, torch.Tensor) else run.clamp_min(worst)

    def settle(self) -> None:
        """Read every figure still on the device into floats, in one host synchronization."""
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        if names:
            values = torch.stack([getattr(self, n).double() for n in names]).tolist()
            for name, value in zip(names, values, strict=True):
                setattr(self, name, value)

    def reset(self) -> None:
        self.loss = self.nll = self.tokens = self.sentences = self.gnorm = self.skipped = self.worst_run = 0.0
        self.updates, self.start = 0, time.monotonic()


# ---------------------------------------------------------------- the run


class Trainer:
    """One training run: built by `train_model`, driven by `run`."""

    def __init__(self, cfg: Config, env: DistEnv) -> None:
        tc = cfg.train
        self.cfg, self.env = cfg, env
        self.save_dir = Path(tc.save_dir)
        self.data = load_run_data(cfg, env)
        self.stepper = build_stepper(cfg, env, self.data.vocab_size)
        self.schedule = Schedule.from_config(tc, cfg.model.d_model)
        self.valid_bleu = ValidBleu(cfg, self.stepper.module, self.data.dir, env) if tc.valid_bleu_sentences else None
        self.progress = Progress()  # where the run is: saved in every checkpoint
        self.nonfinite_in_row = 0  # non-finite updates in a row (train.max_nonfinite); not saved
        self.lr = 0.0  # the lr of the last update
        self.stop_reason = ""  # why the run stops, as a user would set it ("max_updates=100"); "" while it runs
        self.last_valid_nll: float | None = None  # NLL of this process's last validation
        self.last_save_update = -1
        self.last_save_minutes = 0.0  # the run's clock in the last periodic checkpoint, where a resume goes on
        self.start_time = self.last_save_time = time.monotonic()
        self._epoch_cache: dict[int, list[np.ndarray]] = {}  # this rank's batches of the current (and next) epoch
        self.window = Window()  # the updates since the last metric line
        ds = self.data.train
        self.flops_per_token = flops_per_token(
            cfg.model, self.data.vocab_size, float(ds.src_lens.mean()), float(ds.tgt_lens.mean())
        )  # at the data's mean lengths, as the start record's (MFU counts real tokens, never padding)
        peak = device_peak_flops(env.device)
        self.peak_flops = None if peak is None else peak * env.world_size  # every device's tokens are counted
        self.graphs_before = compiled_graphs() if tc.compile else 0  # graphs torch.compile built before this run
        # Not a terminal (CI logs, nohup, a file): carriage-return updates would make one endless line, so
        # no bar there; _log_train prints a plain line every train.log_every updates instead.
        self.log_lines = not sys.stderr.isatty()
        resume = self._resume()
        if tc.init_from:
            self._init_from(resume)
        self.horizon_updates = self._horizon_updates()
        self.snapshots_done = self._snapshots_before(self._progress())
        self.files = RunFiles.open(self.save_dir, resume) if env.is_main else None
        if env.is_main:
            self._announce()

    # -- setup

    def _resume(self) -> int | None:
        """Load the newest readable checkpoint of save_dir, if any; returns its update."""
        found = find_resume_checkpoint(self.save_dir)
        if found is None:
            return None
        path, ck = found
        if ck.training is None:
            raise TrainError(self._not_resumable(path, ck))
        saved = config_from_dict(ck.config, origin=str(path))
        if saved.model != self.cfg.model:
            raise TrainError(
                f"{path} holds a different model than the config: "
                f"{field_differences(saved.model, self.cfg.model, 'model.')} (the checkpoint's value first); "
                "use a new train.save_dir, or restore the model section the run was started with"
            )
        self.stepper.module.load_state_dict(ck.model)
        load_optimizer_state(self.stepper.optimizer, ck.training.optimizer)
        if ck.training.scaler:
            self.stepper.scaler.load_state_dict(ck.training.scaler)
        p = self.progress = ck.progress
        p.batch_in_epoch = self._resume_position(path, p.batch_in_epoch, ck.training)
        restore_rng(ck.training.rng, self.env, self.cfg.train.seed, p.update)
        self.last_save_update, self.last_save_minutes = p.update, p.minutes
        if self.env.is_main:
            tqdm.write(f"resuming from {path} at update {p.update}", file=sys.stderr)
        return p.update

    def _not_resumable(self, path: Path, ck: Checkpoint) -> str:
        """Why a run cannot resume from ``path``, which holds no training state, and what to do instead."""
        if ck.averaged_from:
            return (
                f"{path} holds no training state (optimizer, RNG): it is an averaged checkpoint, not one of "
                "`tmt train`; move it out of train.save_dir"
            )
        return (
            f"{path} holds no training state (optimizer, RNG): a run keeps it only in its newest checkpoint and "
            f"in {BEST_NAME}, and the newer checkpoints of {self.save_dir} are unreadable (warned above) while "
            f"{BEST_NAME} is missing or older. To go on from these weights with a fresh optimizer, start a new "
            f"train.save_dir with --set train.init_from={path}"
        )

    def _init_from(self, resumed: int | None) -> None:
        """train.init_from: a new run starts from that checkpoint's weights; a resumed run keeps its own."""
        path = Path(self.cfg.train.init_from)
        if resumed is not None:
            if self.env.is_main:
                tqdm.write(
                    f"note: train.init_from={path} is ignored: {self.save_dir} holds this run's own checkpoints "
                    f"and it resumes from them (update {resumed}); to fine-tune anew, use another train.save_dir",
                    file=sys.stderr,
                )
            return
        spm_path = self.data.dir / "spm.model"
        update = load_init_weights(self.stepper.module, path, self.cfg.model, self.data.spm_model, spm_path)
        if self.env.is_main:
            tqdm.write(
                f"fine-tuning: weights from {path} (update {update} of its run); a fresh optimizer and the "
                "learning-rate schedule from update 0",
                file=sys.stderr,
            )

    def _resume_position(self, path: Path, batch_in_epoch: int, saved: TrainingState) -> int:
        """This rank's position in the epoch's batches: carried over, converted to this world size, or restarted.

        A change of what decides the batch order (`batching_key`) in the
        middle of an epoch restarts the epoch (`_restart_epoch`); a change of
        world size converts the position exactly where one exists.
        """
        saved_world_size, batching = saved.rng["world_size"], saved.batching
        changes = batching_changes(batching, self.data.batching) if batching else []  # None: written before it was kept
        if changes and batch_in_epoch > 0:
            return self._restart_epoch(path, changes, batch_in_epoch, int(batching["batches"]))
        ds, tc, env, epoch = self.data.train, self.cfg.train, self.env, self.progress.epoch
        position = resume_position(
            ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, epoch, batch_in_epoch, saved_world_size,
            env.world_size, self.data.max_len,
        )  # fmt: skip
        if position is None:
            raise TrainError(
                f"{path} was written by {saved_world_size} processes, {batch_in_epoch} batches each into epoch "
                f"{epoch}; with {env.world_size} processes the rest of this epoch's batches are dealt out differently, "
                f"so training would skip or repeat sentences. Resume with {saved_world_size} processes "
                f"(--nproc-per-node {saved_world_size}), or start a new train.save_dir"
            )
        return position

    def _restart_epoch(self, path: Path, changes: list[str], batch_in_epoch: int, saved_batches: int) -> int:
        """The position after the batch order changed mid-epoch: the epoch's start (or its end, if it was done).

        The sentences the old order had not reached cannot be cut into new
        batches without knowing them all, so the epoch starts over under the
        new order, deterministically: the sentences it had trained on are seen
        again this epoch, none is skipped. Said loudly, with how to avoid it.
        """
        epoch = self.progress.epoch
        if batch_in_epoch >= saved_batches:
            return len(self._epoch_batches())  # the epoch was finished: the next starts under the new order
        if self.env.is_main:
            tqdm.write(
                f"warning: {'; '.join(changes)}: {path} was written {batch_in_epoch:,} of {saved_batches:,} batches "
                f"into epoch {epoch}, and the change reorders that epoch's batches, so epoch {epoch} starts over "
                f"under the new order (the sentences of its first {batch_in_epoch:,} batches are trained on again). "
                "To continue it exactly instead, stop and resume with the old value(s); change them once a "
                "checkpoint ends an epoch (train.max_epochs) or before a run starts",
                file=sys.stderr,
            )
        return 0

    def _announce(self) -> None:
        """The run's shape on stderr (model size, processes, tokens per update, sentences left out); config.yaml."""
        tc, env = self.cfg.train, self.env
        tokens = tc.max_tokens * tc.update_freq * env.world_size
        tqdm.write(
            f"model: {count_parameters(self.stepper.module):,} parameters, vocabulary {self.data.vocab_size}; "
            f"{env.world_size} process(es) on {env.device.type}, precision {self.stepper.precision}; "
            f"tokens per update <= max_tokens {tc.max_tokens} x update_freq {tc.update_freq} x {env.world_size} "
            f"= {tokens:,}",
            file=sys.stderr,
        )
        tqdm.write(
            f"left out as longer than {self.data.max_len} tokens (min of train.max_tokens {tc.max_tokens} and "
            f"model.max_positions {self.cfg.model.max_positions}): {self.data.too_long['train']:,} of "
            f"{len(self.data.train):,} training and {self.data.too_long['valid']:,} of {len(self.data.valid):,} "
            "validation sentences",
            file=sys.stderr,
        )
        write_config(self.cfg, self.save_dir)
        assert self.files is not None
        ds = self.data.train
        self.files.log(start_record(
            self.cfg, env, self.progress.update, count_parameters(self.stepper.module), self.data.vocab_size,
            (float(ds.src_lens.mean()), float(ds.tgt_lens.mean())), self.stepper.precision,
        ))  # fmt: skip
        if self.stepper.precision == "bf16" and env.device.type == "cpu" and not cpu_has_bf16():
            self._warn("emulated_bf16", (
                "train.precision=bf16 on a CPU without bf16 instructions (AVX512-BF16 or AMX): PyTorch emulates bf16 "
                "here, several times slower than fp32; train.precision=auto trains in fp32 on this CPU"
            ))  # fmt: skip

    # -- checkpoints

    def _checkpoint(self) -> Checkpoint:
        """Everything that decides the rest of the run; a collective (the RNG states of every rank)."""
        scaler = self.stepper.scaler
        return Checkpoint(
            model=self.stepper.module.state_dict(),
            config=self.cfg.to_dict(),
            spm_model=self.data.spm_model,
            progress=dataclasses.replace(self.progress, minutes=self._minutes()),
            training=TrainingState(
                optimizer=self.stepper.optimizer.state_dict(),
                rng=rng_state(self.env),  # a collective: every rank calls _save
                scaler=scaler.state_dict() if scaler.is_enabled() else {},
                batching={**self.data.batching, "batches": len(self._epoch_batches())},  # see _resume_position
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
            self.last_save_update, self.last_save_time = self.progress.update, time.monotonic()
            self.last_save_minutes = ck.progress.minutes
        barrier(self.env)

    def _validate(self) -> tuple[float, float]:
        """Loss (and BLEU) on the validation split; keep checkpoint_best.pt and the patience count up to date."""
        p, tc = self.progress, self.cfg.train
        loss, nll = validate(self.stepper.module, self.data.valid, self.cfg, self.env, self.stepper.precision)
        bleu = self.valid_bleu() if self.valid_bleu is not None else None
        improved = self._record_validation(loss, nll, bleu)
        if self.files is not None:
            self._log_valid(loss, nll, bleu)
        if improved:
            self._save(best=True)
        if tc.patience > 0 and p.stale_validations >= tc.patience and not self.stop_reason:
            self.stop_reason = f"patience={tc.patience}"  # run() stops after this update
        self.last_valid_nll = nll
        return loss, nll

    def _record_validation(self, loss: float, nll: float, bleu: dict[str, Any] | None) -> bool:
        """Note a validation in `progress` (last and best figures, patience count); whether it is a new best."""
        p, tc = self.progress, self.cfg.train
        p.valid_loss, p.valid_update = loss, p.update
        p.valid_history = [*p.valid_history, [p.update, nll]][-3:]  # enough for `unconverged`
        improved = loss < p.best_valid_loss
        p.best_valid_loss = min(p.best_valid_loss, loss)
        if bleu is not None:
            if tc.best_metric == "bleu":
                improved = bleu["bleu"] > p.best_valid_bleu
            p.valid_bleu, p.best_valid_bleu = bleu["bleu"], max(p.best_valid_bleu, bleu["bleu"])
        p.stale_validations = 0 if improved else p.stale_validations + 1
        return improved

    def _log_valid(self, loss: float, nll: float, bleu: dict[str, Any] | None) -> None:
        """A ``valid`` record in metrics.jsonl and a line on stderr (rank 0)."""
        assert self.files is not None
        p, tc = self.progress, self.cfg.train
        record = {"kind": "valid", "update": p.update, "epoch": p.epoch, "loss": loss, "nll": nll}
        record.update(ppl=perplexity(nll), best_loss=p.best_valid_loss, minutes=self._minutes())
        line = f"loss {loss:.4f} nll {nll:.4f} ppl {perplexity(nll):.2f} (best {p.best_valid_loss:.4f})"
        if bleu is not None:
            record.update(bleu, best_bleu=p.best_valid_bleu)
            line += (
                f"; bleu {bleu['bleu']:.2f} (best {p.best_valid_bleu:.2f}; {bleu['bleu_sentences']} sentences, "
                f"{bleu['bleu_seconds']:.1f} s)"
            )
        if tc.patience > 0:
            line += f"; {p.stale_validations}/{tc.patience} validations without a new best {tc.best_metric}"
        self.files.log(record)
        tqdm.write(f"valid at update {p.update}: {line}", file=sys.stderr)

    def _final_warnings(self) -> list[tuple[str, str]]:
        """(reason, message) for each way this run ends badly trained: inside its warmup, or far from converged."""
        p, tc = self.progress, self.cfg.train
        found = []
        if self.schedule.warming_up(p.update, self._progress()):
            found.append((
                "warmup",
                f"training stopped at update {p.update}, inside {self._warmup_described()}: the learning rate never "
                "reached its peak, so the model is barely trained and translations may be empty; train longer "
                "(train.max_updates / train.max_minutes) or shorten the warmup (train.warmup, or "
                f"train.warmup_fraction with train.lr{', train.min_warmup' if tc.min_warmup > 0 else ''})",
            ))  # fmt: skip
        why = unconverged([(int(u), perplexity(nll)) for u, nll in p.valid_history], tc.validate_every)
        if why:
            found.append((
                "unconverged",
                f"training stopped at update {p.update} far from converged: {why}; train longer "
                "(train.max_updates / train.max_minutes): running it again with a higher limit resumes it",
            ))  # fmt: skip
        return found

    def _warmup_described(self) -> str:
        """The run's warmup as its keys set it, for the warning of a run that stopped inside it."""
        tc = self.cfg.train
        if tc.warmup_fraction <= 0:
            return f"its warmup of {tc.warmup} updates (train.warmup)"
        if tc.min_warmup <= 0:
            return f"its warmup of the first {tc.warmup_fraction:.0%} of its budget (train.warmup_fraction)"
        return (
            f"its warmup of the first {tc.warmup_fraction:.0%} of its budget, at least {tc.min_warmup} updates "
            "(train.warmup_fraction, train.min_warmup)"
        )

    def _compile_note(self) -> str:
        """How many graphs torch.compile built for this run: the first compilation, then one per recompilation."""
        graphs, multiple = compiled_graphs() - self.graphs_before, self.cfg.train.pad_to_multiple
        shapes = f"lengths padded to multiples of {multiple}" if multiple > 1 else "train.pad_to_multiple off"
        return f"torch.compile: {graphs} graph(s) compiled ({max(graphs - 1, 0)} recompilation(s); {shapes})"

    def _warn(self, reason: str, message: str) -> None:
        """A warning on stderr and as a ``warning`` record in metrics.jsonl (rank 0)."""
        assert self.files is not None
        tqdm.write(f"warning: {message}", file=sys.stderr)
        self.files.log({"kind": "warning", "update": self.progress.update, "reason": reason, "message": message})

    # -- the budget

    def _minutes(self) -> float:
        """Wall-clock minutes trained in this run, resumed processes included."""
        return self.progress.minutes + (time.monotonic() - self.start_time) / 60

    def _horizon_updates(self) -> int:
        """The update count at which the run ends by train.max_updates or train.max_epochs (0: no such bound)."""
        tc = self.cfg.train
        bounds = [tc.max_updates] if tc.max_updates > 0 else []
        if tc.max_epochs > 0:
            per_epoch = math.ceil(len(self._epoch_batches()) / tc.update_freq)
            bounds.append(tc.max_epochs * per_epoch)
        return min(bounds) if bounds else 0

    def _progress(self, update: int | None = None) -> float:
        """How far through its budget the run is (0..1) after ``update`` (default: the updates done)."""
        update = self.progress.update if update is None else update
        return horizon_progress(update, self._minutes(), self.horizon_updates, self.cfg.train.max_minutes)

    def _snapshots_before(self, progress: float) -> int:
        """How many of the ``average_last`` snapshot points (spread over the last ``snapshot_span``) lie at or
        before ``progress``: point i of k sits at ``1 - span + span * i / k``, the last at the end of the budget."""
        tc = self.cfg.train
        if tc.snapshot_span <= 0:
            return 0
        k = tc.average_last
        return sum(1 for i in range(1, k + 1) if progress >= 1.0 - tc.snapshot_span + tc.snapshot_span * i / k)

    def _snapshot_due(self) -> bool:
        """Whether the update just taken crossed the next snapshot point (a checkpoint for averaging)."""
        reached = self._snapshots_before(self._progress())
        due, self.snapshots_done = reached > self.snapshots_done, max(reached, self.snapshots_done)
        return due

    def _bound(self) -> str:
        """The budget that ends this run first, as a user would write it."""
        tc = self.cfg.train
        by_time = tc.max_minutes > 0 and (
            not self.horizon_updates or self._minutes() / tc.max_minutes >= self.progress.update / self.horizon_updates
        )
        if by_time:
            return f"max_minutes={tc.max_minutes:g}"
        if tc.max_updates > 0 and self.horizon_updates == tc.max_updates:
            return f"max_updates={tc.max_updates}"
        return f"max_epochs={tc.max_epochs}" if tc.max_epochs > 0 else "no bound"

    def _time_left(self) -> str:
        """An estimate of the wall-clock time to the end of the budget, from this run's pace so far."""
        progress, minutes = self._progress(), self._minutes()
        if progress <= 0:
            return "?"
        seconds = round(max(minutes / progress - minutes, 0.0) * 60)
        hours, rest = divmod(seconds, 3600)
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"

    # -- the loop

    def _epoch_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` (default: the current one), computed once per epoch (seconds on
        WMT's 4.5M sentences); the current and the next epoch are kept, as batches are read one update ahead."""
        ds, tc, env = self.data.train, self.cfg.train, self.env
        epoch = self.progress.epoch if epoch is None else epoch
        if epoch in self._epoch_cache:
            return self._epoch_cache[epoch]
        batches = epoch_batches(
            ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, epoch, env.rank, env.world_size, self.data.max_len
        )
        if not batches:
            raise TrainError(
                f"{self.data.dir}: no training batch: every sentence is longer than {self.data.max_len} tokens "
                f"(min of train.max_tokens={tc.max_tokens} and model.max_positions={self.cfg.model.max_positions}); "
                "raise train.max_tokens"
            )
        self._epoch_cache = {e: b for e, b in self._epoch_cache.items() if e >= self.progress.epoch}
        self._epoch_cache[epoch] = batches
        return batches

    def _updates(self) -> Iterator[tuple[list[np.ndarray], int, int]]:
        """This rank's batch groups, one per update, from the saved position on; ends when an epoch limit is hit.

        Each group comes with the position after it: (epoch, batches of it
        consumed). `run` moves ``progress`` there as it trains on the group,
        not when the group is read (one update ahead, `prefetched`), so a
        checkpoint written after an update records where the next one starts.
        """
        p, tc = self.progress, self.cfg.train
        if tc.patience > 0 and p.stale_validations >= tc.patience:  # resumed after patience had stopped it
            self.stop_reason = f"patience={tc.patience}"
            return
        epoch, position = p.epoch, p.batch_in_epoch
        while True:
            batches = self._epoch_batches(epoch)
            while position < len(batches):
                group = batches[position : position + tc.update_freq]
                position += len(group)
                yield group, epoch, position
            if tc.max_epochs > 0 and epoch >= tc.max_epochs:
                return  # `run` names the stop once the last group has trained, not when it is read
            epoch, position = epoch + 1, 0

    def _collate(self, item: tuple[list[np.ndarray], int, int]) -> list[Batch | None]:
        """The padded batches of one update (None: an empty shard), pinned on CUDA; run in the background."""
        group, tc = item[0], self.cfg.train
        pin = self.env.device.type == "cuda"
        batches: list[Batch | None] = []
        for idx in group:
            if not len(idx):
                batches.append(None)
                continue
            batch = pad_to_multiple(collate(self.data.train, idx), tc.pad_to_multiple, self.cfg.model.max_positions)
            batches.append(batch.pin_memory() if pin else batch)
        return batches

    def _time_flags(self) -> tuple[bool, bool]:
        """(stop, save) by the wall clock, agreed by all ranks (any rank's clock can trigger)."""
        tc, now = self.cfg.train, time.monotonic()
        if self.stepper.defer_sync and self.env.distributed and self.progress.update % tc.log_every:
            return False, False  # agreeing is a collective the host waits for: GPUs under DDP ask at log lines
        stop = tc.max_minutes > 0 and self._minutes() >= tc.max_minutes
        save = tc.save_every_minutes > 0 and now - self.last_save_time >= tc.save_every_minutes * 60
        stop_n, save_n = all_reduce_sum([float(stop), float(save)], self.env)
        return stop_n > 0, save_n > 0

    def run(self) -> TrainResult:
        """Train until a budget (or patience) stops the run; validate and save at the end."""
        p, tc = self.progress, self.cfg.train
        self.stepper.model.train()
        bar = tqdm(
            total=self.horizon_updates or None, initial=p.update, disable=not self.env.is_main or self.log_lines,
            file=sys.stderr, unit="upd", dynamic_ncols=True, desc="train",
        )  # fmt: skip
        window = self.window
        if tc.max_updates > 0 and p.update >= tc.max_updates:
            self.stop_reason = f"max_updates={tc.max_updates}"
        elif p.update > 0 and tc.max_minutes > 0 and p.minutes >= tc.max_minutes:
            self.stop_reason = f"max_minutes={tc.max_minutes}"  # spent before this process: no update at lr 0
        else:
            for (_, epoch, position), batches in prefetched(self._updates(), self._collate):
                p.epoch, p.batch_in_epoch = epoch, position
                stats = self._update(batches)
                self._after_update(stats, window, bar)
                self._save_or_stop(stats)
                if self.stop_reason:
                    break
            else:
                self.stop_reason = self.stop_reason or f"max_epochs={tc.max_epochs}"  # every group of the last epoch
        bar.close()
        return self._finish()

    def _update(self, batches: list[Batch | None]) -> UpdateStats:
        """One update from this rank's ``batches`` (every rank takes part): gradients, lr, optimizer step."""
        stats = accumulate_gradients(self.stepper, batches)
        update = self.progress.update + 1
        self.lr = self.schedule.lr(update, self._progress(update))
        return apply_gradients(self.stepper, stats, self.lr)

    def _save_or_stop(self, stats: UpdateStats) -> None:
        """After an update: a checkpoint when one is due, and the stop reason once a budget is spent."""
        p, tc = self.progress, self.cfg.train
        time_stop, time_save = self._time_flags()
        snapshot = self._snapshot_due()  # always: it advances the snapshot count even when a save is due anyway
        periodic = tc.save_every_updates > 0 and p.update % tc.save_every_updates == 0
        if stats.stepped and (periodic or time_save or snapshot):
            self._settle()
            self._save()
        at_limit = tc.max_updates > 0 and p.update >= tc.max_updates
        if at_limit:
            self._settle()  # the count may include updates the device skipped, unseen by the host so far
            at_limit = p.update >= tc.max_updates
        if at_limit:
            self.stop_reason = f"max_updates={tc.max_updates}"
        elif time_stop:
            self.stop_reason = f"max_minutes={tc.max_minutes}"

    def _after_update(self, stats: UpdateStats, window: Window, bar: tqdm) -> None:
        """Count the update (or the skip), log, validate."""
        p, tc = self.progress, self.cfg.train
        if not stats.stepped:
            self._skipped(stats)
            return
        p.update += 1
        self.nonfinite_in_row = 0
        window.add(stats)
        log = p.update % tc.log_every == 0
        if log:
            self._settle()
        if self.env.is_main:
            bar.update(1)
            if log or not self.stepper.defer_sync:  # deferred figures are read at log lines only
                self._show(window, bar, log)
        if log:
            window.reset()
            release_free_memory()  # freed blocks of varying batch shapes fragment the heap (transformer_mt/malloc.py)
        if tc.validate_every > 0 and p.update % tc.validate_every == 0:
            self._settle()
            self._validate()

    def _show(self, window: Window, bar: tqdm, log: bool) -> None:
        """The progress bar's figures, and at a log line the `train` record (rank 0)."""
        tokens = max(float(window.tokens), 1.0)
        seconds = max(time.monotonic() - window.start, 1e-9)
        bar.set_postfix(
            loss=f"{window.loss / tokens:.3f}", ppl=f"{perplexity(window.nll / tokens):.1f}",
            lr=f"{self.lr:.2e}", tok_s=f"{window.tokens / seconds:,.0f}", left=self._time_left(),
            refresh=False,
        )  # fmt: skip
        if log:
            self._log_train(window, seconds)

    def _settle(self) -> None:
        """Read the device's figures of the updates since the last metric line, and uncount those it skipped.

        Only a stepper that defers host synchronization leaves anything to read:
        it counts every update as taken and the device skips a non-finite one
        (`step._apply_on_device`), so the host learns of a skip here, at the
        next log line, validation, checkpoint or update limit. Until then the
        learning rate runs one update ahead per unseen skip. The stop rule
        (train.max_nonfinite in a row) and the fp16 loss-scale floor are
        checked here too.
        """
        window, p, tc = self.window, self.progress, self.cfg.train
        window.settle()
        skipped = round(window.skipped)
        if skipped:
            p.update -= skipped
            window.updates -= skipped
            window.skipped = 0.0
            if self.env.is_main and not self.stepper.scaler.is_enabled():  # fp16 overflows are the scaler's business
                tqdm.write(
                    f"warning: {skipped} update(s) up to update {p.update} had a non-finite loss or gradient; skipped",
                    file=sys.stderr,
                )
        if window.worst_run >= tc.max_nonfinite:
            raise TrainError(
                f"{round(window.worst_run)} updates in a row had a non-finite loss or gradient (by update "
                f"{p.update}); lower train.lr_scale (now {tc.lr_scale}), set train.clip_norm (e.g. 1.0), or use "
                "train.precision=bf16 instead of fp16"
            )
        window.worst_run = window.nonfinite_run
        if skipped and self.stepper.scaler.is_enabled() and self.stepper.scaler.get_scale() < MIN_FP16_SCALE:
            raise TrainError(
                f"fp16 loss scale fell below {MIN_FP16_SCALE} by update {p.update}: gradients keep overflowing; "
                "use train.precision=bf16 (or fp32), lower train.lr_scale or set train.clip_norm"
            )

    def _log_train(self, window: Window, seconds: float) -> None:
        p, tokens, updates = self.progress, max(window.tokens, 1.0), max(window.updates, 1)
        assert self.files is not None
        record = {
            "kind": "train",
            "update": p.update,
            "epoch": p.epoch,
            "loss": window.loss / tokens,
            "nll": window.nll / tokens,
            "ppl": perplexity(window.nll / tokens),
            "lr": self.lr,
            "gnorm": window.gnorm / updates,
            "tgt_tokens_per_update": window.tokens / updates,
            "tgt_tokens_per_s": window.tokens / seconds,
            "minutes": self._minutes(),
            "progress": self._progress(),
            **throughput_figures(self.flops_per_token, window.tokens / seconds, self.peak_flops),
        }
        if self.cfg.train.compile:
            record["compiled_graphs"] = compiled_graphs() - self.graphs_before
        self.files.log(record)
        if self.log_lines:
            total = f"/{self.horizon_updates}" if self.horizon_updates else ""
            mfu = f", MFU {record['mfu']:.1%}" if "mfu" in record else ""
            tqdm.write(
                f"train update {p.update}{total} epoch {p.epoch}: loss {record['loss']:.4f} ppl {record['ppl']:.2f} "
                f"lr {record['lr']:.2e} tgt tok/s {record['tgt_tokens_per_s']:,.0f}, model TFLOP/s "
                f"{record['model_tflops']:.3g}{mfu} ({record['minutes']:.1f} min, {self._bound()}, "
                f"{self._time_left()} left)",
                file=sys.stderr,
            )

    def _skipped(self, stats: UpdateStats) -> None:
        """A non-finite update: nothing was applied. fp16 overflows are the loss scaler's business."""
        p, tc = self.progress, self.cfg.train
        scaler = self.stepper.scaler
        if stats.tokens == 0:
            return
        if scaler.is_enabled() and math.isfinite(stats.loss_sum):
            if scaler.get_scale() < MIN_FP16_SCALE:
                raise TrainError(
                    f"fp16 loss scale fell below {MIN_FP16_SCALE} at update {p.update}: gradients keep overflowing; "
                    "use train.precision=bf16 (or fp32), lower train.lr_scale or set train.clip_norm"
                )
            return
        self.nonfinite_in_row += 1
        if self.env.is_main:
            tqdm.write(f"warning: non-finite loss or gradient after update {p.update}; update skipped", file=sys.stderr)
        if self.nonfinite_in_row >= tc.max_nonfinite:
            raise TrainError(
                f"{self.nonfinite_in_row} updates in a row had a non-finite loss or gradient (after update {p.update}); "
                f"lower train.lr_scale (now {tc.lr_scale}), set train.clip_norm (e.g. 1.0), "
                f"or use train.precision=bf16 instead of fp16"
            )

    def _finish(self) -> TrainResult:
        p = self.progress
        self._settle()
        nll = self.last_valid_nll
        validated = p.valid_update != p.update
        if validated:
            _, nll = self._validate()
        if self.last_save_update != p.update or validated:
            self._save()  # last, so that no record is later than the checkpoint a resume starts from
        warnings = self._final_warnings()
        if self.files is not None:
            bleu = f", valid bleu {p.valid_bleu:.2f} (best {p.best_valid_bleu:.2f})" if p.valid_bleu is not None else ""
            tqdm.write(
                f"done at update {p.update}, epoch {p.epoch} ({self.stop_reason}); valid loss {p.valid_loss:.4f}, "
                f"best {p.best_valid_loss:.4f}{bleu}; checkpoints in {self.save_dir}",
                file=sys.stderr,
            )
            if self.cfg.train.compile:
                tqdm.write(self._compile_note(), file=sys.stderr)
            for reason, message in warnings:
                self._warn(reason, message)
            self.files.log(
                {
                    "kind": "end",
                    "update": p.update,
                    "epoch": p.epoch,
                    "minutes": self.last_save_minutes,  # the final checkpoint's: a resumed run's clock goes on from it
                    "stop_reason": self.stop_reason,
                }
            )
            self.files.close()
        return TrainResult(
            p.update, p.epoch, p.valid_loss, nll, p.best_valid_loss, self.save_dir, self.stop_reason,
            self.data.too_long["train"], self.data.too_long["valid"],
            best_valid_bleu=p.best_valid_bleu if p.valid_bleu is not None else None,
            warnings=tuple(message for _, message in warnings),
        )  # fmt: skip


def train_model(cfg: Config) -> TrainResult:
    """Train (or resume) the run described by ``cfg`` until train.max_updates / max_epochs / max_minutes.

    Works the same alone or under torchrun; rank 0 writes all files and holds
    the run directory's lock (`hold_run_dir`), so a second trainer on the same
    train.save_dir stops before it touches anything.
    """
    threads = torch.get_num_threads()
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    env = setup()
    try:
        with hold_run_dir(Path(cfg.train.save_dir), env):
            return Trainer(cfg, env).run()
    finally:
        cleanup(env)
        torch.set_num_threads(threads)
