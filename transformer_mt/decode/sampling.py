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
from typing import Any, Literal

import torch
from torch import Tensor

from transformer_mt.config import Sampling
from transformer_mt.data.bpe import BOS, EOS
from transformer_mt.decode.search import (
    Hypothesis,
    Prefixes,
    force_eos_at_max_len,
    kept_sentences,
    length_penalty,
    max_output_lengths,
    restrict,
    step_log_probs,
)
from transformer_mt.model.cache import MIN_CAPACITY


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


@torch.no_grad()
def sample_search(
    model: Any,
    src: Tensor,
    sources: Sequence[Sequence[int]],
    sampling: Sampling,
    temperature: float = 1.0,
    seed: int = 1,
    samples: int = 1,
    len_penalty: float = 0.6,
    len_penalty_form: Literal["gnmt", "fairseq"] = "gnmt",
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    max_positions: int | None = None,
    no_repeat_ngram: int = 0,
    prefixes: Sequence[Sequence[int]] | None = None,
    after_step: Callable[[], object] | None = None,
) -> list[list[Hypothesis]]:
    """``samples`` samples of each sentence of ``src`` (B, S); ``sources``: the token ids of its rows (the seeds).

    Returns, per sentence in input order, its samples in their numbers' order.
    ``prefixes``: per sentence, target ids every sample starts with, forced
    as in beam search (`transformer_mt.decode.search.restrict`).
    Each sample is a row of its own (the source is encoded once per sample),
    and a finished sample leaves the batch, its cache rows dropped.
    ``after_step``: called after every step, as in `beam_search`.
    """
    rows = src.repeat_interleave(samples, dim=0)  # row i*samples + j: sample j of sentence i
    max_len = max_output_lengths(rows, max_len_a, max_len_b, max_positions).to(src.device)
    u = uniforms(seed, sources, samples, (max_len + 1).tolist()).to(src.device)
    enc = model.encode(rows)
    cache = model.init_cache(enc, beams=1, capacity=min(int(max_len.max()) + 1, MIN_CAPACITY))
    active = torch.arange(rows.shape[0], device=src.device)  # the row of each live sample
    tokens = torch.full((rows.shape[0], 1), BOS, dtype=torch.long, device=src.device)
    log_probs = torch.zeros(rows.shape[0], dtype=torch.float64, device=src.device)
    results: dict[int, Hypothesis] = {}
    forced = Prefixes.of(prefixes, src.device)
    step = 0
    while active.numel() > 0:
        lprobs = step_log_probs(model.decode(tokens[:, -1:], enc, cache)[:, -1])  # (n, V)
        if no_repeat_ngram > 0 or forced is not None:
            sentence = active.div(samples, rounding_mode="floor")
            lprobs = restrict(lprobs, tokens[:, 1:], no_repeat_ngram, forced, sentence, step)
        lprobs = force_eos_at_max_len(lprobs, max_len[active] == step)
        chosen = draw(lprobs, u[active, step], sampling, temperature)  # (n,)
        log_probs[active] += lprobs.gather(1, chosen[:, None]).squeeze(1).double()
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        done = chosen == EOS
        _collect(results, active[done].tolist(), tokens[done, 1:-1].tolist(), log_probs, len_penalty, len_penalty_form)
        if bool(done.any()):
            keep = kept_sentences(done)
            if keep.numel() > 0:
                cache.reorder(keep, sentences=keep)
            active, tokens = active.index_select(0, keep), tokens.index_select(0, keep)
        step += 1
        if after_step is not None:
            after_step()
    return [[results[i * samples + j] for j in range(samples)] for i in range(src.shape[0])]


def _collect(
    results: dict[int, Hypothesis],
    rows: list[int],
    generated: list[list[int]],
    log_probs: Tensor,
    alpha: float,
    form: Literal["gnmt", "fairseq"],
) -> None:
    """The finished samples of ``rows`` (their tokens without BOS and EOS) as hypotheses, scored as beam search's."""
    for row, tokens in zip(rows, generated, strict=True):
        lp = float(log_probs[row])
        results[row] = Hypothesis(tokens, lp / float(length_penalty(float(len(tokens) + 1), alpha, form)), lp)
