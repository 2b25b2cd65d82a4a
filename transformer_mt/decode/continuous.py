"""Beam search that sentences join while it runs (continuous batching), for `tmt serve`.

A server's clients send a sentence and wait for its translation. Searched in
rounds, a batch runs until its longest sentence ends: the sentences that
arrive meanwhile wait for the next round, and the batch thins as its short
sentences finish, so a step decodes ever fewer rows for the same fixed cost.
Here a sentence joins the running search at the next step (`add`) and leaves
it the step it is done (`step` returns it), so the batch stays as full as the
clients keep it.

Every sentence follows `beam_search`'s rules (`transformer_mt.decode.search`,
its module docstring) from its own first step: its positions, its maximum
length, the length penalty and the n-gram block all count from its own BOS.
The decoder cache holds every sentence at the same cache positions; a
sentence's BOS sits at the position where it joined (`DecoderCache.join`),
its queries see nothing before it, its positions count from it, and the
positions no sentence reads any more are dropped once they are half the
cache (`DecoderCache.make_room`). A sentence joins with k beams of which only the
first is live (the others -inf) until its first step fills them, which
gives the candidates `beam_search` gets by widening one hypothesis to k.

So each sentence's hypotheses and scores are `beam_search`'s for it alone
(tests/test_decode_continuous.py; in fp32 a masked entry adds an exact zero).
Forced prefixes, constraints, sampling and ensembles are not searched here:
`tmt serve` gives those requests rounds of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from transformer_mt.data.bpe import BOS, PAD
from transformer_mt.decode.search import NEG_INF, Beams, BeamStep, Finished, Hypothesis, StepRules, advance, pad_batch
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.model.transformer import Transformer


class ContinuousSearch:
    """The running search of one model: `add` sentences at any time, `step` until `active` is 0.

    ``settings``: as `beam_search`'s (sampling aside). ``after_step``: called after every step (a
    `transformer_mt.malloc.FreedMemory.check`). Sentences are named by the
    caller's keys; `step` returns each finished sentence's key and its k best
    hypotheses (fewer only if fewer exist), best first.
    """

    def __init__(
        self, model: Transformer, settings: SearchSettings, after_step: Callable[[], object] | None = None
    ) -> None:
        self.model = model
        self.settings = settings
        self.beam_step = BeamStep(settings)
        self.k = settings.beam_size
        self.after_step = after_step
        self.beams: Beams | None = None  # the active sentences; None when there are none
        self.finished = Finished(self.k, {})
        self.keys: dict[int, Hashable] = {}  # sentence id -> the caller's key
        self.source_tokens: dict[int, int] = {}  # sentence id -> its source length (ids + EOS)
        self._next_id = 0

    @property
    def active(self) -> int:
        """Sentences in the search."""
        return len(self.keys)

    @property
    def load(self) -> int:
        """Source tokens of the sentences in the search (what a server bounds by ``--max-batch-tokens``)."""
        return sum(self.source_tokens.values())

    @torch.no_grad()
    def add(self, sources: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> None:
        """Let ``sources`` (ids ending in EOS, none empty) join the search at its next step, named ``keys``.

        When it raises (out of memory), the search may hold half of the new sentences: `clear` it.
        """
        if len(sources) != len(keys):
            raise ValueError(f"add got {len(sources)} sources and {len(keys)} keys")
        if not sources:
            return
        device = next(self.model.parameters()).device
        src = pad_batch(sources).to(device)
        m, k = len(sources), self.k
        ids = torch.arange(self._next_id, self._next_id + m, device=device)
        cache = self.model.init_cache(self.model.encode(src), beams=k)
        scores = torch.full((m, k), NEG_INF, device=device)
        scores[:, 0] = 0.0  # one live hypothesis (BOS) per sentence; its first step fills the other beams
        max_len = self.settings.max_lengths(src).to(device)
        if self.beams is None:
            cache.starts = torch.zeros(m, dtype=torch.long, device=device)
            tokens = torch.full((m * k, 1), BOS, dtype=torch.long, device=device)
            self.beams = Beams(ids, max_len, tokens, scores, None, cache)
        else:
            b = self.beams
            columns = b.tokens.shape[1]  # the cache length + 1: the new sentences' BOS goes in the last column
            joined = torch.full((m * k, columns), PAD, dtype=torch.long, device=device)
            joined[:, -1] = BOS
            b.cache.join(cache)
            self.beams = Beams(
                torch.cat([b.sent, ids]), torch.cat([b.max_len, max_len]), torch.cat([b.tokens, joined]),
                torch.cat([b.scores, scores]), None, b.cache,
            )  # fmt: skip
        for i, key, source in zip(ids.tolist(), keys, sources, strict=True):  # last: only sentences with rows
            self.keys[i], self.source_tokens[i], self.finished.hyps[i] = key, len(source), []
        self._next_id += m

    @torch.no_grad()
    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """Extend every active sentence by one token; the sentences done now leave, with their hypotheses."""
        b = self.beams
        if b is None:
            return []
        dropped = b.cache.make_room()
        if dropped:
            b.tokens = b.tokens[:, dropped:]
        bos = b.cache.starts  # (n,) the column of each sentence's BOS in ``tokens``, and its cache position
        steps = b.cache.length - bos  # (n,) each sentence's own step
        features = self.model.decode_features(b.tokens[:, -1:], None, b.cache)[:, -1]  # (n*k, D)
        rules = StepRules.of(b, steps, self.settings.no_repeat_ngram, None)
        choice = self.beam_step(self.model, features, b, self.finished, steps, rules, bos)
        ended = b.sent[choice.done].tolist()
        self.beams = advance(b, choice, self.k) if len(ended) < choice.done.numel() else None
        if self.after_step is not None:
            self.after_step()
        return [self._leave(i) for i in ended]

    def _leave(self, sentence: int) -> tuple[Hashable, list[Hypothesis]]:
        del self.source_tokens[sentence]
        return self.keys.pop(sentence), self.finished.hyps.pop(sentence)

    def clear(self) -> list[Hashable]:
        """Drop every sentence (after a failed step); returns their keys."""
        keys = list(self.keys.values())
        self.beams, self.keys, self.source_tokens = None, {}, {}
        self.finished = Finished(self.k, {})
        return keys
