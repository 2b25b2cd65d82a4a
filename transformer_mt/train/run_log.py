"""What a run tells: the metric window, the progress bar and log lines, and the records of metrics.jsonl.

The records are the dataclasses of `transformer_mt.runs` (`TrainRecord`,
`ValidRecord`, `WarningRecord`, `EndRecord`), which `tmt report` and
`tmt plot` read back. Rank 0 alone writes and prints; every rank keeps its
window, since each must read the device's figures at the same updates.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from transformer_mt.checkpoint import TrainingProgress
from transformer_mt.config import Config, TrainConfig
from transformer_mt.data.mix import CorpusMix
from transformer_mt.data.stats import shares_line
from transformer_mt.model.transformer import count_parameters, flops_per_token
from transformer_mt.progress import Bar, is_terminal
from transformer_mt.runs import EndRecord, TrainRecord, ValidRecord, WarningRecord
from transformer_mt.train.budget import Budget
from transformer_mt.train.build import RunData, compiled_graphs
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.loss import perplexity
from transformer_mt.train.mfu import device_peak_flops, throughput_figures
from transformer_mt.train.run_files import RunFiles, start_record, write_config
from transformer_mt.train.schedule import Schedule
from transformer_mt.train.step import Stepper, UpdateStats, cpu_has_bf16
from transformer_mt.train.validation import unconverged

BLEU_SHARE_HINT = 0.10  # validation BLEU past this share of the time: the valid line names the key that lowers it


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

    def settle(self) -> tuple[int, int]:
        """Read every figure still on the device into floats, in one host synchronization, and uncount the
        updates the device skipped; (skipped, the longest run of non-finite updates since the last settle)."""
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        if names:
            values = torch.stack([getattr(self, n).double() for n in names]).tolist()
            for name, value in zip(names, values, strict=True):
                setattr(self, name, value)
        skipped, worst = round(self.skipped), round(self.worst_run)
        self.updates -= skipped
        self.skipped, self.worst_run = 0.0, self.nonfinite_run
        return skipped, worst

    def reset(self) -> None:
        self.loss = self.nll = self.tokens = self.sentences = self.gnorm = self.skipped = self.worst_run = 0.0
        self.updates, self.start = 0, time.monotonic()


class RunLog:
    """The run's voice: stderr lines, the progress bar's figures and metrics.jsonl (``files``, rank 0's)."""

    def __init__(self, cfg: Config, env: DistEnv, data: RunData, stepper: Stepper, files: RunFiles | None) -> None:
        self.cfg, self.env, self.data, self.stepper, self.files = cfg, env, data, stepper, files
        ds = data.train
        self.flops_per_token = flops_per_token(
            cfg.model, data.vocab_size, float(ds.src_lens.mean()), float(ds.tgt_lens.mean())
        )  # at the data's mean lengths, as the start record's (MFU counts real tokens, never padding)
        peak = device_peak_flops(env.device)
        self.peak_flops = None if peak is None else peak * env.world_size  # every device's tokens are counted
        self.graphs_before = compiled_graphs() if cfg.train.compile else 0  # graphs torch.compile built before
        # Not a terminal (CI logs, nohup, a file): carriage-return updates would make one endless line, so
        # no bar there; `train` prints a plain line every train.log_every updates instead.
        self.log_lines = not is_terminal(sys.stderr)
        self.started, self.bleu_seconds = time.monotonic(), 0.0  # validation BLEU's share of this process's time
        self.trained: list[tuple[int, float]] = []  # (update, training NLL) of each train record of this process

    def announce(self, update: int) -> None:
        """The run's shape on stderr (model size, processes, tokens per update, sentences left out); config.yaml."""
        tc, env, data, files = self.cfg.train, self.env, self.data, self.files
        assert files is not None
        parameters, precision = count_parameters(self.stepper.module), self.stepper.precision
        tqdm.write(
            f"model: {parameters:,} parameters, vocabulary {data.vocab_size}; "
            f"{env.world_size} process(es) on {env.device.type}, precision {precision}; "
            f"tokens per update <= max_tokens {tc.max_tokens} x update_freq {tc.update_freq} x {env.world_size} "
            f"= {tc.max_tokens * tc.update_freq * env.world_size:,}",
            file=sys.stderr,
        )
        tqdm.write(
            f"left out as longer than {data.max_len} tokens (min of train.max_tokens {tc.max_tokens} and "
            f"model.max_positions {self.cfg.model.max_positions}): {data.too_long['train']:,} of "
            f"{len(data.train):,} training and {data.too_long['valid']:,} of {len(data.valid):,} "
            "validation sentences",
            file=sys.stderr,
        )
        if isinstance(data.train, CorpusMix):  # each direction's and each synthetic corpus's share of an epoch
            tqdm.write(shares_line(self.cfg, data.train).replace("  each", "each"), file=sys.stderr)
        write_config(self.cfg, files.save_dir)
        lengths = (float(data.train.src_lens.mean()), float(data.train.tgt_lens.mean()))
        files.log(start_record(self.cfg, env, update, parameters, data.vocab_size, lengths, precision))
        if precision == "bf16" and env.device.type == "cpu" and not cpu_has_bf16():
            self.warn("emulated_bf16", update, (
                "train.precision=bf16 on a CPU without bf16 instructions (AVX512-BF16 or AMX): PyTorch emulates bf16 "
                "here, several times slower than fp32; train.precision=auto trains in fp32 on this CPU"
            ))  # fmt: skip

    def show(self, window: Window, bar: Bar, log: bool, p: TrainingProgress, lr: float, budget: Budget) -> None:
        """The progress bar's figures, and at a log line the `train` record and line (rank 0)."""
        tokens = max(float(window.tokens), 1.0)
        seconds = max(time.monotonic() - window.start, 1e-9)
        bar.set_postfix(
            loss=f"{window.loss / tokens:.3f}", ppl=f"{perplexity(window.nll / tokens):.1f}",
            lr=f"{lr:.2e}", tok_s=f"{window.tokens / seconds:,.0f}", left=budget.time_left(p.update),
            refresh=False,
        )  # fmt: skip
        if log:
            self.train(window, seconds, p, lr, budget)

    def train(self, window: Window, seconds: float, p: TrainingProgress, lr: float, budget: Budget) -> None:
        """The `train` record of the window (and, without a bar, its line on stderr)."""
        assert self.files is not None
        tokens, updates = max(window.tokens, 1.0), max(window.updates, 1)
        throughput = throughput_figures(self.flops_per_token, window.tokens / seconds, self.peak_flops)
        record = TrainRecord(
            update=p.update, epoch=p.epoch, loss=window.loss / tokens, nll=window.nll / tokens,
            ppl=perplexity(window.nll / tokens), lr=lr, gnorm=window.gnorm / updates,
            tgt_tokens_per_update=window.tokens / updates, tgt_tokens_per_s=window.tokens / seconds,
            minutes=budget.minutes(), progress=budget.progress(p.update), model_tflops=throughput["model_tflops"],
            mfu=throughput.get("mfu"),
            compiled_graphs=compiled_graphs() - self.graphs_before if self.cfg.train.compile else None,
        )  # fmt: skip
        self.files.log(record)
        self.trained.append((p.update, record.nll))
        if self.log_lines:
            total = f"/{budget.horizon}" if budget.horizon else ""
            mfu = f", MFU {record.mfu:.1%}" if record.mfu is not None else ""
            tqdm.write(
                f"train update {p.update}{total} epoch {p.epoch}: loss {record.loss:.4f} ppl {record.ppl:.2f} "
                f"lr {record.lr:.2e} tgt tok/s {record.tgt_tokens_per_s:,.0f}, model TFLOP/s "
                f"{record.model_tflops:.3g}{mfu} ({record.minutes:.1f} min, {budget.bound(p.update)}, "
                f"{budget.time_left(p.update)} left)",
                file=sys.stderr,
            )

    def valid(
        self,
        p: TrainingProgress,
        loss: float,
        nll: float,
        bleu: dict[str, Any] | None,
        minutes: float,
        by_direction: dict[str, dict[str, float]] | None = None,
    ) -> None:
        """A ``valid`` record in metrics.jsonl and a line on stderr (rank 0); with several directions, each one's
        figures too (``by_direction``: loss, nll, ppl and bleu per direction)."""
        assert self.files is not None
        tc = self.cfg.train
        if bleu is not None and "directions" in bleu:  # ValidBleu's score of each direction
            bleu = dict(bleu)
            by_direction = {name: {**d, "bleu": bleu["directions"][name]} for name, d in (by_direction or {}).items()}
            del bleu["directions"]
        record = ValidRecord(
            update=p.update, epoch=p.epoch, loss=loss, nll=nll, ppl=perplexity(nll), best_loss=p.best_valid_loss,
            minutes=minutes, **(bleu or {}), best_bleu=p.best_valid_bleu if bleu is not None else None,
            directions=by_direction or None,
        )  # fmt: skip
        line = f"loss {loss:.4f} nll {nll:.4f} ppl {perplexity(nll):.2f} (best {p.best_valid_loss:.4f})"
        if bleu is not None:
            self.bleu_seconds += bleu["bleu_seconds"]
            line += (
                f"; bleu {bleu['bleu']:.2f} (best {p.best_valid_bleu:.2f}; {bleu['bleu_sentences']} sentences, "
                f"{bleu['bleu_seconds']:.1f} s; {bleu_share(self.bleu_seconds, time.monotonic() - self.started)})"
            )
        if tc.patience > 0:
            line += f"; {p.stale_validations}/{tc.patience} validations without a new best {tc.best_metric}"
        if by_direction:
            line += "; " + ", ".join(
                f"{name} ppl {d['ppl']:.2f}" + (f" bleu {d['bleu']:.2f}" if "bleu" in d else "")
                for name, d in by_direction.items()
            )
        self.files.log(record)
        tqdm.write(f"valid at update {p.update}: {line}", file=sys.stderr)

    def warn(self, reason: str, update: int, message: str) -> None:
        """A warning on stderr and as a ``warning`` record in metrics.jsonl (rank 0)."""
        assert self.files is not None
        tqdm.write(f"warning: {message}", file=sys.stderr)
        self.files.log(WarningRecord(update=update, reason=reason, message=message))

    def done(self, p: TrainingProgress, stop_reason: str, minutes: float, warnings: list[tuple[str, str]]) -> None:
        """The run's last line, its warnings and its ``end`` record; closes the files (rank 0)."""
        assert self.files is not None
        bleu = f", valid bleu {p.valid_bleu:.2f} (best {p.best_valid_bleu:.2f})" if p.valid_bleu is not None else ""
        tqdm.write(
            f"done at update {p.update}, epoch {p.epoch} ({stop_reason}); valid loss {p.valid_loss:.4f}, "
            f"best {p.best_valid_loss:.4f}{bleu}; checkpoints in {self.files.save_dir}",
            file=sys.stderr,
        )
        if self.cfg.train.compile:
            tqdm.write(self.compile_note(), file=sys.stderr)
        for reason, message in warnings:
            self.warn(reason, p.update, message)
        self.files.log(EndRecord(update=p.update, epoch=p.epoch, minutes=minutes, stop_reason=stop_reason))
        self.files.close()

    def compile_note(self) -> str:
        """How many graphs torch.compile built for this run: the first compilation, then one per recompilation."""
        graphs, multiple = compiled_graphs() - self.graphs_before, self.cfg.train.pad_to_multiple
        shapes = f"lengths padded to multiples of {multiple}" if multiple > 1 else "train.pad_to_multiple off"
        return f"torch.compile: {graphs} graph(s) compiled ({max(graphs - 1, 0)} recompilation(s); {shapes})"


def bleu_share(bleu_seconds: float, elapsed: float) -> str:
    """Validation BLEU's share of the time trained so far, for the valid line: its cost, which grows where the
    budget is short and the model undertrained (outputs that run to the maximum length), and where the share is
    large (`BLEU_SHARE_HINT`), the key that lowers it."""
    share = bleu_seconds / max(elapsed, 1e-9)
    hint = ": fewer train.valid_bleu_sentences cost less (0: none)" if share >= BLEU_SHARE_HINT else ""
    return f"validation BLEU so far {share:.0%} of the time{hint}"


def final_warnings(
    tc: TrainConfig, p: TrainingProgress, schedule: Schedule, progress: float, trained: Sequence[tuple[int, float]] = ()
) -> list[tuple[str, str]]:
    """(reason, message) for each way a run ends badly trained: inside its warmup, or far from converged.

    ``progress`` is the run's (0..1) at its end (`Budget.progress`); ``trained`` the (update, training NLL) of its
    train records (`RunLog.trained`), which judge a run that ended before its second validation.
    """
    found = []
    if schedule.warming_up(p.update, progress):
        found.append((
            "warmup",
            f"training stopped at update {p.update}, inside {warmup_described(tc)}: the learning rate never "
            "reached its peak, so the model is barely trained and translations may be empty; train longer "
            "(train.max_updates / train.max_minutes) or shorten the warmup (train.warmup, or "
            f"train.warmup_fraction with train.lr{', train.min_warmup' if tc.min_warmup > 0 else ''})",
        ))  # fmt: skip
    valid = [(int(u), perplexity(nll)) for u, nll in p.valid_history]
    why = unconverged(valid, tc.validate_every, [(u, perplexity(nll)) for u, nll in trained])
    if why:
        found.append((
            "unconverged",
            f"training stopped at update {p.update} far from converged: {why}; train longer "
            "(train.max_updates / train.max_minutes): running it again with a higher limit resumes it",
        ))  # fmt: skip
    return found


def warmup_described(tc: TrainConfig) -> str:
    """The run's warmup as its keys set it, for the warning of a run that stopped inside it."""
    if tc.warmup_fraction <= 0:
        return f"its warmup of {tc.warmup} updates (train.warmup)"
    if tc.min_warmup <= 0:
        return f"its warmup of the first {tc.warmup_fraction:.0%} of its budget (train.warmup_fraction)"
    return (
        f"its warmup of the first {tc.warmup_fraction:.0%} of its budget, at least {tc.min_warmup} updates "
        "(train.warmup_fraction, train.min_warmup)"
    )
