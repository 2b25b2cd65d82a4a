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
from typing import Literal

import torch

from transformer_mt.data.bpe import BOS, PAD
from transformer_mt.decode.search import (
    NEG_INF,
    Hypothesis,
    StepRules,
    _advance,
    _Beams,
    _collect_finished,
    _Finished,
    _select_live,
    _sentences_done,
    _top_candidates,
    best_extensions,
    max_output_lengths,
    pad_batch,
)
from transformer_mt.model.transformer import Transformer


class ContinuousSearch:
    """The running search of one model: `add` sentences at any time, `step` until `active` is 0.

    Settings as `beam_search`'s. ``after_step``: called after every step (a
    `transformer_mt.malloc.FreedMemory.check`). Sentences are named by the
    caller's keys; `step` returns each finished sentence's key and its k best
    hypotheses (fewer only if fewer exist), best first.
    """

    def __init__(
        self,
        model: Transformer,
        beam_size: int = 4,
        len_penalty: float = 0.6,
        len_penalty_form: Literal["gnmt", "fairseq"] = "gnmt",
        max_len_a: float = 1.0,
        max_len_b: int = 50,
        max_positions: int | None = None,
        no_repeat_ngram: int = 0,
        stopping: Literal["exact", "k_finished"] = "exact",
        after_step: Callable[[], object] | None = None,
    ) -> None:
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}")
        self.model = model
        self.k = beam_size
        self.len_penalty, self.len_penalty_form = len_penalty, len_penalty_form
        self.max_len = (max_len_a, max_len_b, max_positions)
        self.no_repeat_ngram = no_repeat_ngram
        self.stopping = stopping
        self.after_step = after_step
        self.beams: _Beams | None = None  # the active sentences; None when there are none
        self.finished = _Finished(beam_size, {})
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
        max_len = max_output_lengths(src, *self.max_len).to(device)
        if self.beams is None:
            cache.starts = torch.zeros(m, dtype=torch.long, device=device)
            tokens = torch.full((m * k, 1), BOS, dtype=torch.long, device=device)
            self.beams = _Beams(ids, max_len, tokens, scores, None, cache)
        else:
            b = self.beams
            columns = b.tokens.shape[1]  # the cache length + 1: the new sentences' BOS goes in the last column
            joined = torch.full((m * k, columns), PAD, dtype=torch.long, device=device)
            joined[:, -1] = BOS
            b.cache.join(cache)
            self.beams = _Beams(
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
        # the PAD and BOS before a late sentence's output never complete an n-gram
        rules = StepRules(b.tokens[:, 1:], (b.max_len == steps).repeat_interleave(self.k), None, self.no_repeat_ngram)
        row_lprobs, row_tokens = best_extensions(self.model, features, 2 * self.k, rules)
        cand_scores, cand_beam, cand_token = _top_candidates(b.scores, row_lprobs, row_tokens, self.k)
        alpha, form = self.len_penalty, self.len_penalty_form
        _collect_finished(self.finished, b, cand_scores, cand_beam, cand_token, steps, alpha, form, bos)
        live_scores, live_beam, live_token = _select_live(cand_scores, cand_beam, cand_token, self.k)
        done = _sentences_done(self.finished, b, live_scores, steps, alpha, form, self.stopping)
        ended = b.sent[done].tolist()
        self.beams = (
            _advance(b, live_scores, live_beam, live_token, done, self.k) if len(ended) < done.numel() else None
        )
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
        self.finished = _Finished(self.k, {})
        return keys
