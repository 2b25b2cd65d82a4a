"""Validation: loss and NLL on the validation split, validation BLEU, and the rule that calls a run unconverged.

The loss is computed on every rank's shard of the split and summed over all
ranks; BLEU is translated and scored on rank 0 (`ValidBleu`) and broadcast,
so every rank takes the same best-checkpoint and patience decisions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformer_mt.checkpoint import TrainingProgress
from transformer_mt.config import Config
from transformer_mt.data.batching import batch_by_size, ordered_indices, shard_batches
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.clean import read_lines
from transformer_mt.data.dataset import ParallelDataset, collate
from transformer_mt.data.directions import directions, prefix, prefix_key
from transformer_mt.data.mix import CorpusMix
from transformer_mt.data.raw_files import raw_file
from transformer_mt.decode.lines import empty_outputs
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import out_of_memory
from transformer_mt.metrics import corpus_sacrebleu
from transformer_mt.train.build import RunData, max_sentence_len
from transformer_mt.train.distributed import DistEnv, all_reduce_sum
from transformer_mt.train.loss import perplexity
from transformer_mt.train.step import TrainError, forward_loss, oom_message

# Validations a checkpoint remembers, for `unconverged`: enough that one lies train.validate_every updates
# before the last even when train.validate_every_fraction adds up to 10 validations in between.
VALID_HISTORY = 12
UNCONVERGED_PPL = 100.0  # a final validation perplexity above this is far from any usable translation model
UNCONVERGED_DROP = 0.10  # a perplexity still falling by more than this over a validation interval: still learning fast


def unconverged(
    history: list[tuple[int, float]], validate_every: int, trained: Sequence[tuple[int, float]] = ()
) -> str | None:
    """Why a run that ends with these validations is far from converged, or None (the rule of docs/training.md).

    ``history`` holds (update, validation perplexity) pairs, oldest first, the
    last one the final validation. Far from converged: its perplexity is above
    `UNCONVERGED_PPL`, or more than `UNCONVERGED_DROP` below that of the latest
    validation at least ``validate_every`` updates before it (the final
    validation may come a few updates after a periodic one, too close to see
    a trend). A run with no such earlier validation (one that ended before its
    second) is judged by ``trained``, its (update, training perplexity) records:
    `training_trend`.
    """
    if not history:
        return None
    update, ppl = history[-1]
    if ppl > UNCONVERGED_PPL:
        return f"validation perplexity {ppl:.1f} is above {UNCONVERGED_PPL:g}"
    earlier = [(u, x) for u, x in history[:-1] if u <= update - max(validate_every, 1)]
    if not earlier:
        return training_trend(trained, validate_every)
    if ppl < (1.0 - UNCONVERGED_DROP) * earlier[-1][1]:
        before, prev = earlier[-1]
        return (
            f"validation perplexity fell {100 * (1 - ppl / prev):.0f}% in the last {update - before} updates "
            f"({prev:.2f} at update {before}, {ppl:.2f} at {update}), more than {UNCONVERGED_DROP:.0%}: "
            "the model is still learning fast"
        )
    return None


def training_trend(trained: Sequence[tuple[int, float]], validate_every: int) -> str | None:
    """Why a run too short for a validation trend is far from converged, from its training perplexity alone: the
    last record more than `UNCONVERGED_DROP` below the latest one in the first half of the run (each record the
    mean over train.log_every updates, so that one noisy batch decides nothing), or None."""
    if not trained:
        return None
    update, ppl = trained[-1]
    earlier = [(u, x) for u, x in trained[:-1] if u <= update // 2]
    if not earlier or ppl >= (1.0 - UNCONVERGED_DROP) * earlier[-1][1]:
        return None
    before, prev = earlier[-1]
    return (
        f"no validation came train.validate_every={validate_every} updates before the last to compare with, and "
        f"the training perplexity fell {100 * (1 - ppl / prev):.0f}% in the last {update - before} updates "
        f"({prev:.2f} at update {before}, {ppl:.2f} at {update}), more than {UNCONVERGED_DROP:.0%}: "
        "the model is still learning fast"
    )


def record_validation(
    p: TrainingProgress, loss: float, nll: float, bleu: dict[str, Any] | None, best_metric: str
) -> bool:
    """Note a validation in ``p`` (last and best figures, patience count); whether it is a new best ``best_metric``."""
    p.valid_loss, p.valid_update = loss, p.update
    p.valid_history = [*p.valid_history, [p.update, nll]][-VALID_HISTORY:]
    improved = loss < p.best_valid_loss
    p.best_valid_loss = min(p.best_valid_loss, loss)
    if bleu is not None:
        if best_metric == "bleu":
            improved = bleu["bleu"] > p.best_valid_bleu
        p.valid_bleu, p.best_valid_bleu = bleu["bleu"], max(p.best_valid_bleu, bleu["bleu"])
    p.stale_validations = 0 if improved else p.stale_validations + 1
    return improved


@torch.no_grad()
def validate(
    module: nn.Module, ds: ParallelDataset | CorpusMix, cfg: Config, env: DistEnv, precision: str
) -> tuple[float, float]:
    """Label-smoothed loss and NLL per target token (nats) on the validation split, each rank a shard of it.

    Sentences longer than `max_sentence_len` are left out, as in training.
    """
    tc = cfg.train
    indices = ordered_indices(ds.src_lens, ds.tgt_lens, cfg.train.seed)
    batches = batch_by_size(indices, ds.src_lens, ds.tgt_lens, cfg.train.max_tokens, max_sentence_len(cfg))
    batches = shard_batches(batches, env.rank, env.world_size)
    was_training = module.training
    module.eval()
    loss_sum = nll_sum = tokens = 0.0
    for idx in batches:
        if len(idx) == 0:
            continue
        batch = collate(ds, idx).to(env.device)
        with out_of_memory(partial(oom_message, batch, tc.max_tokens, tc.update_freq, " validating"), TrainError):
            loss, nll = forward_loss(module, batch, precision, tc.label_smoothing)
        loss_sum, nll_sum, tokens = loss_sum + float(loss), nll_sum + float(nll), tokens + batch.num_tgt_tokens
    module.train(was_training)
    loss_sum, nll_sum, tokens = all_reduce_sum([loss_sum, nll_sum, tokens], env)
    if tokens == 0:
        raise TrainError(
            f"the validation split in {cfg.data.dir} has no sentence of at most {max_sentence_len(cfg)} tokens "
            "(min of train.max_tokens and model.max_positions); raise them or check the validation files"
        )
    return loss_sum / tokens, nll_sum / tokens


def validate_directions(
    module: nn.Module, data: RunData, cfg: Config, env: DistEnv, precision: str
) -> tuple[float, float, dict[str, dict[str, float]]]:
    """`validate` on the validation split; with data.directions on each direction's, their mean loss and NLL
    (each direction counts the same, whatever its length) and each one's figures by name ({} for one pair)."""
    if not data.valid_directions:
        return *validate(module, data.valid, cfg, env, precision), {}
    each = {name: validate(module, ds, cfg, env, precision) for name, ds in data.valid_directions.items()}
    loss = sum(loss for loss, _ in each.values()) / len(each)
    nll = sum(nll for _, nll in each.values()) / len(each)
    return loss, nll, {name: {"loss": lo, "nll": nl, "ppl": perplexity(nl)} for name, (lo, nl) in each.items()}


# `encoder_spread` below this: one vector whatever the source. Measured on Multi30k: collapsed 1e-8 to 4e-7, a
# model that reads its source 0.01 (near the learning rate's peak) to 0.09 (a bilingual model at its end).
COLLAPSED = 1e-4


@torch.no_grad()
def encoder_spread(
    module: nn.Module, ds: ParallelDataset | CorpusMix, device: torch.device, max_len: int, sentences: int = 16
) -> float:
    """How much the encoder's output varies over the positions of a sentence, relative to its size: the largest
    of the first ``sentences`` validation sentences that validation takes (at most ``max_len`` tokens; each: the
    mean over features of the standard deviation over positions, over the mean norm).

    An encoder that has collapsed gives the same vector at every position of every source (`COLLAPSED`): the
    decoder then learns its targets from nothing but their own prefix (and a target tag), a model that ignores
    the source and whose loss still falls. Too high a learning rate does it (benchmarks/README.md, "Several
    languages"); the validation loss alone does not show it.
    """
    indices = [i for i in range(min(len(ds), 4 * sentences)) if 2 < ds.src_lens[i] <= max_len][:sentences]
    if not indices:
        return float("inf")  # nothing to measure: never a false alarm
    was_training = module.training
    module.eval()
    try:
        src = collate(ds, indices).src.to(device)
        memory = module.encode(src).memory.float()  # (B, S, D)
    finally:
        module.train(was_training)
    spreads = []
    for row, length in zip(memory, src.ne(module.pad_id).sum(1).tolist(), strict=True):
        real = row[:length]  # (L, D): right-padded
        spreads.append(float(real.std(0).mean() / real.norm(dim=-1).mean().clamp_min(1e-12)))
    return max(spreads)


def collapse_warning(module: nn.Module, data: RunData, device: torch.device, update: int, lr: float) -> str | None:
    """The ``collapsed_encoder`` warning when `encoder_spread` finds the encoder collapsed, else None: the run
    goes on, its user decides."""
    spread = encoder_spread(module, data.valid, device, data.max_len)
    if spread >= COLLAPSED:
        return None
    return (
        f"at update {update} the encoder gives the same output at every source position (relative spread "
        f"{spread:.1e}; a model that reads its source: 0.01 or more): this model ignores its source and will "
        f"translate every sentence alike. Too high a learning rate does this: start again with a lower train.lr "
        f"(now {lr:g}; the Multi30k configs: 0.001)"
    )


class ValidBleu:
    """Validation BLEU (train.valid_bleu_sentences): `tmt evaluate`'s figure for the model being trained."""

    def __init__(self, cfg: Config, module: nn.Module, data_dir: Path, env: DistEnv) -> None:
        self.cfg, self.module, self.data_dir, self.env = cfg, module, data_dir, env
        self._cache: dict[str, tuple[Translator, list[str], list[str]]] | None = None  # built at first use (rank 0)

    def __call__(self) -> dict[str, Any]:
        """sacreBLEU of the model on the first train.valid_bleu_sentences validation pairs; a collective.

        Rank 0 translates (`Translator`, the model in eval mode, beam
        train.valid_bleu_beam, the rest of the decode section) and scores
        (`corpus_sacrebleu`, as `tmt evaluate` does); the other ranks wait and
        receive the score, so every rank takes the same best/patience decisions.
        """
        score = empty = seconds = 0.0
        sentences = 0
        by_direction: dict[str, float] = {}
        error: Exception | None = None
        if self.env.is_main:
            start, was_training = time.monotonic(), self.module.training
            try:
                self.module.eval()  # no dropout (and no random draw): the model as `tmt translate` runs it
                for name, (translator, sources, refs) in self._inputs().items():
                    hyps = translator.translate_lines(sources)
                    by_direction[name] = corpus_sacrebleu(hyps, refs)["score"]
                    empty, sentences = empty + empty_outputs(sources, hyps)[0], sentences + len(sources)
                score, seconds = sum(by_direction.values()) / len(by_direction), time.monotonic() - start
            except Exception as err:  # tell the waiting ranks before raising, whatever went wrong
                error = err
            finally:
                self.module.train(was_training)
        score, empty, failed = all_reduce_sum([score, float(empty), 1.0 if error else 0.0], self.env)
        if error is not None:
            raise error
        if failed:
            raise TrainError("rank 0 could not compute the validation BLEU (its message says why)")
        several = {"directions": by_direction} if len(by_direction) > 1 else {}
        return {"bleu": score, "bleu_sentences": sentences, "empty_hypotheses": int(empty), "bleu_seconds": seconds,
                **several}  # fmt: skip

    def _inputs(self) -> dict[str, tuple[Translator, list[str], list[str]]]:
        """(translator, sources, references) of validation BLEU per direction, built at its first use (rank 0).

        The sentences are the first train.valid_bleu_sentences lines (-1: all)
        of the raw ``data.valid`` files (rank 0 has just checked them in
        `prepare_on_rank0`), exactly what `tmt evaluate --src --ref` would read.
        """
        if self._cache is not None:
            return self._cache
        d, tc = self.cfg.data, self.cfg.train
        limit = None if tc.valid_bleu_sentences < 0 else tc.valid_bleu_sentences
        bpe = load_bpe(self.data_dir / "spm.model")
        decode = dataclasses.replace(self.cfg.decode, beam_size=tc.valid_bleu_beam, nbest=1)
        translator = Translator(self.module, bpe, dataclasses.replace(self.cfg, decode=decode), self.env.device)
        translator.show_progress = False
        self._cache = {}
        for way in directions(d):
            src, ref = raw_file(prefix(d, way, "valid"), way.src), raw_file(prefix(d, way, "valid"), way.tgt)
            try:
                sources, refs = list(islice(read_lines(src), limit)), list(islice(read_lines(ref), limit))
            except OSError as err:
                raise TrainError(
                    f"validation BLEU cannot read {err.filename} ({err.strerror}): see {prefix_key(d, way, 'valid')}"
                ) from None
            self._cache[way.name] = (translator.toward(way.src, way.tgt), sources, refs)
        return self._cache
