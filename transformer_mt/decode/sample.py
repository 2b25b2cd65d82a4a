"""Sampling: each output token drawn from the model's distribution instead of searched for (a deviation).

``decode.sampling`` (``tmt translate --sample``) chooses the tokens a draw
may take: ``topk:K``, the K most probable tokens of the step; ``topp:P``, the
fewest most probable tokens whose probabilities sum to at least P (the
nucleus of Holtzman et al., 2020). Before that, the log-probabilities are
divided by ``decode.sampling_temperature`` (below 1 sharper, above 1 flatter).
The kept probabilities are renormalized and one token is drawn. PAD and BOS
are never drawn; a sample ends at EOS, or at its maximum length, where EOS is
forced as in beam search (`transformer_mt.decode.search`, rule 5).

Reproducible whatever the batch: every sample has its own random stream, a
`torch.Generator` seeded from ``decode.seed``, the sentence's source token
ids and the sample's number (0 .. nbest - 1), hashed (`sample_seed`). Its
draws are made once, before the first step (one uniform number per output
position), and step t of that sample reads the t-th; nothing random depends
on which other sentences share the batch or the file, or where the line is.
So the same line, seed and model give the same sample anywhere. (Sentence
positions would not: the same line elsewhere in a file would change.) Two
equal lines get equal samples; ``--nbest K`` gives K different streams.

A sample's ``log_prob`` is the sum of the model's own log-probabilities of
its tokens (temperature 1, nothing filtered, EOS included), and ``score``
divides it by the length penalty, as a beam hypothesis's: the two are
comparable. The K samples of a sentence keep their numbers' order, not a
ranking: sample 0 is the one a single draw gives.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from transformer_mt.config import Sampling
from transformer_mt.data.bpe import EOS
from transformer_mt.decode.search import Beams, Choice, Finished, Hypothesis, StepRules, search, step_log_probs
from transformer_mt.decode.settings import SearchSettings


def sample_seed(seed: int, source: Sequence[int], sample: int) -> int:
    """The 64-bit seed of sample ``sample`` of the sentence with token ids ``source``: a hash of all three."""
    data = struct.pack(f"<QQ{len(source)}q", seed, sample, *source)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def uniforms(seed: int, sources: Sequence[Sequence[int]], samples: int, steps: Sequence[int]) -> Tensor:
    """(len(sources) * samples, max(steps)) float64 draws in [0, 1): row i*samples + j is sample j of source i.

    Row r has ``steps[r]`` draws of its own stream (one per position it may
    fill: a number the sentence and the settings fix, never the batch), then
    zeros that no step reads.
    """
    draws = torch.zeros(len(sources) * samples, max(steps), dtype=torch.float64)
    for i, source in enumerate(sources):
        for j in range(samples):
            r = i * samples + j
            generator = torch.Generator().manual_seed(sample_seed(seed, source, j))
            draws[r, : steps[r]] = torch.rand(steps[r], generator=generator, dtype=torch.float64)
    return draws


def draw(lprobs: Tensor, u: Tensor, sampling: Sampling, temperature: float) -> Tensor:
    """(R,) tokens, one per row of ``lprobs`` (R, V), by inverse transform of ``u`` (R,) in [0, 1).

    The tokens are ordered by probability (most probable first), the ones
    outside top-k or top-p get 0, and the first token whose cumulative
    probability exceeds ``u`` times the kept mass is drawn. A row with one
    finite log-probability (a forced token) always draws it.
    """
    scaled, order = (lprobs.double() / temperature).sort(dim=-1, descending=True)
    probs = torch.softmax(scaled, dim=-1)  # (R, V), descending
    if sampling.kind == "topk":
        probs[:, int(sampling.value) :] = 0.0
    else:  # the mass before a token is below p: it belongs to the smallest set reaching p (the first always does)
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= sampling.value, 0.0)
    cumulative = probs.cumsum(dim=-1)
    target = (u * cumulative[:, -1]).unsqueeze(1)  # (R, 1)
    pos = torch.searchsorted(cumulative, target, right=True).clamp_max(probs.shape[1] - 1)
    return order.gather(1, pos).squeeze(1)


@dataclass(frozen=True)
class SampleStep:
    """A step of sampling: one token drawn per row from its (filtered, tempered) distribution, at the row's
    next pre-drawn number of ``u``; a row that draws EOS is finished and leaves. Each sample is a sentence of
    its own (one row, width 1), its score the sum of the model's own log-probabilities, in float64."""

    settings: SearchSettings
    u: Tensor  # (rows, steps) float64: each row's draws (`uniforms`)
    width: int = 1
    score_dtype: torch.dtype = torch.float64

    def __call__(
        self, model: Any, features: Tensor, beams: Beams, finished: Finished, step: int | Tensor,
        rules: StepRules, bos: Tensor | None = None,
    ) -> Choice:  # fmt: skip
        assert self.settings.sampling is not None and isinstance(step, int)
        lprobs = rules(step_log_probs(model.logits(features)), slice(None))  # (n, V)
        chosen = draw(lprobs, self.u[beams.sent, step], self.settings.sampling, self.settings.temperature)  # (n,)
        scores = beams.scores[:, 0] + lprobs.gather(1, chosen[:, None]).squeeze(1).double()
        done = chosen == EOS
        rows, tokens = beams.sent[done].tolist(), beams.tokens[done, 1:].tolist()
        for row, log_prob, generated in zip(rows, scores[done].tolist(), tokens, strict=True):
            penalty = float(self.settings.penalty(float(len(generated) + 1)))
            finished.add(row, Hypothesis(generated, log_prob / penalty, log_prob))
        return Choice(scores[:, None], torch.zeros_like(chosen)[:, None], chosen[:, None], done)


def sample_search(
    model: Any,
    src: Tensor,
    sources: Sequence[Sequence[int]],
    settings: SearchSettings,
    samples: int = 1,
    prefixes: Sequence[Sequence[int]] | None = None,
    after_step: Callable[[], object] | None = None,
) -> list[list[Hypothesis]]:
    """``samples`` samples of each sentence of ``src`` (B, S) with ``settings.sampling``; ``sources``: the token ids
    of its rows (the seeds).

    Returns, per sentence in input order, its samples in their numbers' order.
    ``prefixes``: per sentence, target ids every sample starts with, forced
    as in beam search. Each sample is a row of its own (the source is
    encoded once per sample), and a finished sample leaves the batch.
    ``after_step``: called after every step, as in `search`.
    """
    if settings.sampling is None:
        raise ValueError("sample_search needs settings.sampling (topk:K or topp:P)")
    rows = src.repeat_interleave(samples, dim=0)  # row i*samples + j: sample j of sentence i
    u = uniforms(settings.seed, sources, samples, (settings.max_lengths(rows) + 1).tolist()).to(src.device)
    row_prefixes = None if prefixes is None else [p for p in prefixes for _ in range(samples)]
    found = search(model, rows, settings, SampleStep(settings, u), 1, row_prefixes, after_step=after_step)
    return [[found[i * samples + j][0] for j in range(samples)] for i in range(src.shape[0])]
