"""An ensemble of models as one model of the search: the mean of their log-probabilities at every step.

`Ensemble` has the decoding API `transformer_mt.decode.search.beam_search`
runs on (``encode``, ``init_cache``, ``decode``), so one beam search decodes
with all the models at once and the loop never learns that there are
several. Each model keeps its own encoder output and its own decoder cache;
the search reorders them together (`EnsembleEncoderOut.reorder`,
`EnsembleCache.reorder`), so beam r of every model always holds the same
hypothesis.

At every step each model's logits become log-probabilities (log_softmax) and
the ensemble's step returns their mean, (1/M) sum_m log p_m(y | x, y<t)
(OpenNMT-py's default; Marian sums weighted log-probabilities; fairseq
instead averages probabilities, log((1/M) sum_m p_m)). The search takes the
log_softmax of what a step returns, as for one model: for the ensemble that
renormalizes the mean over the vocabulary, so hypotheses are ranked by a
proper distribution, the normalized product of the models' distributions
(each to the power 1/M). For one model, or a model with itself, the step's
output is that model's log-probabilities, and the search is the model's own.

Every model must share one target vocabulary (the same BPE model): that is
checked where the checkpoints are read, `transformer_mt.decode.translate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class EnsembleEncoderOut:
    """One encoder output per model, in model order; rows reordered together."""

    parts: list[Any]

    def reorder(self, index: Tensor) -> EnsembleEncoderOut:
        """Rows ``index`` of every model's encoder output (finished sentences leave, or rows repeat for beams)."""
        return EnsembleEncoderOut([part.reorder(index) for part in self.parts])


@dataclass
class EnsembleCache:
    """One decoder cache per model, in model order; every beam step reorders all of them alike."""

    parts: list[Any]

    def reorder(self, index: Tensor, sentences: Tensor | None = None, beams: int | None = None) -> EnsembleCache:
        """Row r of every cache continues row ``index[r]``, keeping ``sentences``, with ``beams`` rows per
        sentence from now on (see `DecoderCache.reorder`)."""
        for part in self.parts:
            part.reorder(index, sentences=sentences, beams=beams)
        return self


class Ensemble:
    """Several models of one vocabulary decoded as one: a step is the mean of their log-probabilities.

    ``models``: anything with the decoding API (`Transformer`s, each on the
    device the search runs on; any shapes, one vocabulary).
    """

    def __init__(self, models: Sequence[Any]) -> None:
        if not models:
            raise ValueError("an ensemble needs at least one model")
        self.models = list(models)

    def eval(self) -> Ensemble:
        """Every model in eval mode (no dropout), as `Translator` sets a model it decodes with."""
        for model in self.models:
            if isinstance(model, nn.Module):
                model.eval()
        return self

    def encode(self, src: Tensor) -> EnsembleEncoderOut:
        """Each model encodes ``src`` (B, S) itself: the models share no weights, so no encoder output either."""
        return EnsembleEncoderOut([model.encode(src) for model in self.models])

    def init_cache(self, enc: EnsembleEncoderOut, beams: int = 1, capacity: int = 16) -> EnsembleCache:
        """One decoder cache per model, from its own encoder output (cross-attention keys/values once each)."""
        return EnsembleCache(
            [
                model.init_cache(part, beams=beams, capacity=capacity)
                for model, part in zip(self.models, enc.parts, strict=True)
            ]
        )

    def decode(self, tgt_in: Tensor, enc: EnsembleEncoderOut, cache: EnsembleCache | None = None) -> Tensor:
        """The mean over the models of their log-probabilities (B, T, V), float32, natural log.

        ``tgt_in`` (B, T) as for one model: with a cache, only the new
        positions; each model reads and extends its own cache.
        """
        caches = cache.parts if cache is not None else [None] * len(self.models)
        total: Tensor | None = None
        for model, part, part_cache in zip(self.models, enc.parts, caches, strict=True):
            lprobs = torch.log_softmax(model.decode(tgt_in, part, part_cache).float(), dim=-1)  # (B, T, V)
            total = lprobs if total is None else total + lprobs
        assert total is not None
        return total / len(self.models)

    def decode_features(self, tgt_in: Tensor, enc: EnsembleEncoderOut, cache: EnsembleCache | None = None) -> Tensor:
        """`decode`'s mean log-probabilities: the models share no features to project, so the ensemble's
        "features" are its output already, and `logits` passes them on."""
        return self.decode(tgt_in, enc, cache)

    def logits(self, x: Tensor) -> Tensor:
        """``x`` as it is: `decode_features` returned the ensemble's log-probabilities."""
        return x
