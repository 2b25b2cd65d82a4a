"""One search loop for every kind of search: beam search (the paper's decoding, section 6.1), sampling, constraints.

`search` runs a batch step by step over any model with the decoding API of
`transformer_mt.model` (``encode``, ``init_cache``, ``decode_features``,
``logits``; the cache's ``reorder`` follows each new row's parent, keeps the
sentences still active and widens one hypothesis to k beams). Row r of a
step is beam r % w of active sentence r // w. What a step keeps is a `Step`'s
choice: `BeamStep` here (the 2k best extensions, EOS among the first k
finished, exact early stopping), `transformer_mt.decode.sample.SampleStep`
and `transformer_mt.decode.constrained.ConstrainedStep`; the continuous
search of `tmt serve` runs `BeamStep` too. The rules, stated exactly
(length penalty, maximum length, stopping, prefixes, repeated n-grams), are
in docs/decoding.md, "The search, exactly".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.decode.settings import PAPER, SearchSettings
from transformer_mt.model.cache import MIN_CAPACITY

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Hypothesis:
    """One finished translation of a sentence.

    ``tokens`` are target ids without BOS and EOS; ``log_prob`` is the sum of
    the token log-probabilities (natural log, EOS included); ``score`` is
    ``log_prob`` divided by the length penalty, the quantity the beam ranks.
    """

    tokens: list[int]
    score: float
    log_prob: float


def pad_batch(sources: Sequence[Sequence[int]], pad_id: int = PAD) -> Tensor:
    """Source ids (each ending in EOS) as one right-padded LongTensor (B, longest): the input of a search."""
    src = torch.full((len(sources), max(map(len, sources))), pad_id, dtype=torch.long)
    for row, ids in enumerate(sources):
        src[row, : len(ids)] = torch.tensor(ids)
    return src


@dataclass(frozen=True)
class Prefixes:
    """Target tokens forced at the start of each sentence's output: ``tokens`` (B, P) right-padded with PAD,
    ``lengths`` (B,), 0 for a sentence without a prefix."""

    tokens: Tensor
    lengths: Tensor

    @classmethod
    def of(cls, prefixes: Sequence[Sequence[int]] | None, device: torch.device) -> Prefixes | None:
        """The prefixes of a batch (token ids, no BOS or EOS), or None when no sentence has one."""
        if prefixes is None or not any(prefixes):
            return None
        tokens = torch.full((len(prefixes), max(map(len, prefixes))), PAD, dtype=torch.long)
        for row, ids in enumerate(prefixes):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return cls(tokens.to(device), torch.tensor([len(ids) for ids in prefixes], device=device))

    def forced(self, sentence: Tensor, step: int) -> tuple[Tensor, Tensor] | None:
        """(rows, tokens): the rows, of sentences ``sentence`` (R,), whose prefix has a token at ``step``, and it."""
        if step >= self.tokens.shape[1]:
            return None
        rows = (self.lengths.index_select(0, sentence) > step).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        return rows, self.tokens[sentence.index_select(0, rows), step]


def restrict(
    lprobs: Tensor, generated: Tensor, no_repeat_ngram: int, prefixes: Prefixes | None, sentence: Tensor, step: int
) -> Tensor:
    """``lprobs`` (R, V), in place, with a step's hard rules: repeated n-grams banned (`block_repeated_ngrams`),
    then each row inside its prefix (of sentence ``sentence`` (R,)) left with only its prefix token, at the
    model's log-probability (read before the n-gram ban: a prefix is kept even where it repeats itself)."""
    forced = None if prefixes is None else prefixes.forced(sentence, step)
    kept = None if forced is None else lprobs[forced[0], forced[1]]  # a copy
    if no_repeat_ngram > 0:
        lprobs = block_repeated_ngrams(lprobs, generated, no_repeat_ngram)
    if forced is not None and kept is not None:
        rows, tokens = forced
        lprobs.index_fill_(0, rows, NEG_INF)
        lprobs[rows, tokens] = kept
    return lprobs


@dataclass
class Beams:
    """The live part of a search: n active sentences x w beams, row r = sentence r // w, beam r % w.

    w (`width`) is 1 at the first step, when every sentence has one hypothesis (BOS), and k after it.
    """

    sent: Tensor  # (n,) index of each active sentence in the input batch
    max_len: Tensor  # (n,) maximum output length, tokens before EOS
    tokens: Tensor  # (n*w, t+1) BOS and the t tokens generated so far
    scores: Tensor  # (n, w) raw log-probabilities of the live hypotheses, -inf for empty beams
    enc: Any  # encoder output: n rows with a cache (the beams share it), n*w rows without
    cache: Any  # decoder cache of n sentences x w beams (None when decoding without a cache)

    @property
    def width(self) -> int:
        """w: beams (rows) per sentence."""
        return self.scores.shape[1]


@dataclass
class Finished:
    """The best finished hypotheses of every sentence, at most k each, best first."""

    k: int
    hyps: list[list[Hypothesis]] | dict[int, list[Hypothesis]]  # by sentence: its index in the batch, or an id

    def add(self, sentence: int, hyp: Hypothesis) -> None:
        kept = self.hyps[sentence]
        if len(kept) == self.k and hyp.score <= kept[-1].score:
            return
        kept.append(hyp)
        kept.sort(key=lambda h: -h.score)  # stable: earlier (shorter) hypotheses win ties
        del kept[self.k :]

    def kth_score(self, sentence: int) -> float:
        """The k-th best finished score, or -inf while fewer than k are finished (any hypothesis may still enter)."""
        kept = self.hyps[sentence]
        return kept[-1].score if len(kept) == self.k else NEG_INF


class Choice(NamedTuple):
    """What a step keeps, per active sentence: the k live hypotheses' raw scores, the beam each extends and its
    new token, (n, k) each, best first; and ``done`` (n,), the sentences that leave the search now."""

    scores: Tensor
    beam: Tensor
    token: Tensor
    done: Tensor


class Step(Protocol):
    """One kind of search: from the decoder's ``features`` (n*w, D) at a step, set the finished hypotheses
    aside into ``finished`` and choose the live ones. ``step``: the tokens each sentence has generated so far
    (one number, or (n,) in a continuous search), ``bos``: the column of each sentence's BOS in
    ``beams.tokens`` (None: 0). ``rules``: the step's hard rules (`StepRules`)."""

    width: int  # k: rows per sentence after the first step
    score_dtype: torch.dtype  # of the live hypotheses' scores

    def __call__(
        self, model: Any, features: Tensor, beams: Beams, finished: Finished, step: int | Tensor,
        rules: StepRules, bos: Tensor | None = None,
    ) -> Choice: ...  # fmt: skip


@torch.no_grad()
def search(
    model: Any,
    src: Tensor,
    settings: SearchSettings,
    step: Step,
    nbest: int = 1,
    prefixes: Sequence[Sequence[int]] | None = None,
    use_cache: bool = True,
    after_step: Callable[[], object] | None = None,
) -> list[list[Hypothesis]]:
    """Translate a batch, ``src`` (B, S) source ids + EOS right-padded with PAD, choosing by ``step``.

    Returns, for each of the B sentences in input order, its ``nbest`` best
    hypotheses (fewer only if fewer exist), best first. ``prefixes``: per
    sentence, target ids its output must start with ([]: none), each no
    longer than its maximum length. ``use_cache=False`` re-decodes the whole
    prefix every step (slow; for testing the cache). ``after_step``: called
    after every step (a decoder's `transformer_mt.malloc.FreedMemory.check`).
    """
    if not 1 <= nbest <= step.width:
        raise ValueError(f"nbest must be between 1 and beam_size ({step.width}), got {nbest}")
    beams = start(model, src, settings.max_lengths(src), use_cache, step.score_dtype)
    finished = Finished(step.width, [[] for _ in range(src.shape[0])])
    forced = Prefixes.of(prefixes, src.device)
    t = 0
    while beams.sent.numel() > 0:
        rules = StepRules.of(beams, t, settings.no_repeat_ngram, forced)
        features = next_features(model, beams, use_cache)  # (n*w, D), w beams per sentence
        beams = advance(beams, step(model, features, beams, finished, t, rules), step.width)
        t += 1
        if after_step is not None:
            after_step()
    return [hyps[:nbest] for hyps in finished.hyps]


def start(model: Any, src: Tensor, max_len: Tensor, use_cache: bool, dtype: torch.dtype = torch.float32) -> Beams:
    """Encode once and compute the cross-attention state once per sentence, for its beams to share.

    Each sentence starts with one hypothesis, BOS: the first step decodes one
    row per sentence, not k identical ones, and `advance` then widens the
    search to k beams (CTranslate2 does the same). Without a cache the
    decoder reads the encoder output itself, one row per beam.
    """
    B = src.shape[0]
    enc = model.encode(src)
    # BOS + output at most; the buffers start at MIN_CAPACITY positions and double as the longest hypothesis grows,
    # so a batch holds what its sentences reach, not room for every sentence's maximum length (memory; the same output)
    capacity = min(int(max_len.max()) + 1, MIN_CAPACITY)
    cache = model.init_cache(enc, beams=1, capacity=capacity) if use_cache else None
    scores = torch.zeros((B, 1), dtype=dtype, device=src.device)
    tokens = torch.full((B, 1), BOS, dtype=torch.long, device=src.device)
    return Beams(torch.arange(B, device=src.device), max_len.to(src.device), tokens, scores, enc, cache)


def next_features(model: Any, beams: Beams, use_cache: bool) -> Tensor:
    """The decoder's output (n*w, D) at the next position of every live hypothesis, before the projection."""
    if use_cache:
        return model.decode_features(beams.tokens[:, -1:], beams.enc, beams.cache)[:, -1]
    return model.decode_features(beams.tokens, beams.enc)[:, -1]


@dataclass(frozen=True)
class BeamStep:
    """Beam search's step: the 2k best extensions over (beam x vocabulary) by raw log-probability are the
    candidates; an EOS among the first k is finished with its normalized score; the k best others live on; a
    sentence is done when no live hypothesis can still enter its k best (or, ``stopping: k_finished``, once k
    have finished)."""

    settings: SearchSettings
    score_dtype: torch.dtype = torch.float32

    @property
    def width(self) -> int:
        return self.settings.beam_size

    def __call__(
        self, model: Any, features: Tensor, beams: Beams, finished: Finished, step: int | Tensor,
        rules: StepRules, bos: Tensor | None = None,
    ) -> Choice:  # fmt: skip
        k = self.width
        row_lprobs, row_tokens = best_extensions(model, features, 2 * k, rules)
        cand_scores, cand_beam, cand_token = top_candidates(beams.scores, row_lprobs, row_tokens, k)
        collect_finished(finished, beams, cand_scores, cand_beam, cand_token, step, self.settings, bos)
        live_scores, live_beam, live_token = select_live(cand_scores, cand_beam, cand_token, k)
        done = sentences_done(finished, beams, live_scores, step, self.settings)
        return Choice(live_scores, live_beam, live_token, done)


def beam_search(
    model: Any,
    src: Tensor,
    settings: SearchSettings = PAPER,
    nbest: int = 1,
    prefixes: Sequence[Sequence[int]] | None = None,
    use_cache: bool = True,
    after_step: Callable[[], object] | None = None,
) -> list[list[Hypothesis]]:
    """`search` with `BeamStep`: the paper's beam search (docs/decoding.md, "The search, exactly")."""
    return search(model, src, settings, BeamStep(settings), nbest, prefixes, use_cache, after_step)


PROJECTED_ROWS = 128  # rows of a step's logits `best_extensions` computes at a time


@dataclass(frozen=True)
class StepRules:
    """A step's hard rules (`restrict`, `force_eos_at_max_len`) for any slice of its R rows: ``generated``
    (R, t) the tokens so far, ``at_max`` (R,) whether the row's sentence is at its maximum length, ``sentence``
    (R,) its index in the batch (read for ``prefixes`` only)."""

    generated: Tensor
    at_max: Tensor
    sentence: Tensor | None = None
    no_repeat_ngram: int = 0
    prefixes: Prefixes | None = None
    step: int = 0

    @classmethod
    def of(cls, beams: Beams, step: int | Tensor, no_repeat_ngram: int, prefixes: Prefixes | None) -> StepRules:
        """The rules of ``beams`` at ``step`` (one number, or one per sentence (n,)); a prefix is read by sentence."""
        w = beams.width
        at_max = (beams.max_len == step).repeat_interleave(w)
        sentence = None if prefixes is None else beams.sent.repeat_interleave(w)
        # the PAD and BOS before a late sentence's output (a continuous search) never complete an n-gram
        return cls(
            beams.tokens[:, 1:], at_max, sentence, no_repeat_ngram, prefixes, int(step) if prefixes is not None else 0
        )

    def __call__(self, lprobs: Tensor, rows: slice) -> Tensor:
        """``lprobs`` (r, V) of the rows ``rows``, in place."""
        if self.prefixes is not None and self.sentence is not None:
            sentence = self.sentence[rows]
            lprobs = restrict(lprobs, self.generated[rows], self.no_repeat_ngram, self.prefixes, sentence, self.step)
        elif self.no_repeat_ngram > 0:
            lprobs = block_repeated_ngrams(lprobs, self.generated[rows], self.no_repeat_ngram)
        return force_eos_at_max_len(lprobs, self.at_max[rows])


def best_extensions(
    model: Any, features: Tensor, m: int, rules: Callable[[Tensor, slice], Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """The ``m`` best next tokens of each row and their log-probabilities, (R, m) each, best first, from the
    decoder's ``features`` (R, D): the projection, `step_log_probs`, ``rules`` (in place, with the slice of rows)
    and `row_topk`, `PROJECTED_ROWS` rows at a time. ``m`` is capped at the vocabulary size.

    Why in slices: a step's logits (R, V) are decoding's largest tensor, and the search needs none of a row's V
    numbers once its m best are known; held whole, they and the heap holes they left made the resident size
    peak (benchmarks/README.md). A slice computes what the whole would (int8 products are exact; an fp32
    matmul rounds a row as in any batch of as many rows). On a GPU all rows are projected at once: the
    caching allocator leaves no such holes, and each slice would cost kernel launches.
    """
    per_slice = PROJECTED_ROWS if features.device.type == "cpu" else max(features.shape[0], 1)
    values, tokens = [], []
    for start in range(0, features.shape[0], per_slice):
        rows = slice(start, start + per_slice)
        lprobs = step_log_probs(model.logits(features[rows]))  # (r, V)
        if rules is not None:
            lprobs = rules(lprobs, rows)
        best = row_topk(lprobs, min(m, lprobs.shape[1]))
        values.append(best[0])
        tokens.append(best[1])
    if len(values) == 1:
        return values[0], tokens[0]
    return torch.cat(values), torch.cat(tokens)


def step_log_probs(logits: Tensor) -> Tensor:
    """Log-probabilities (R, V) of a step's ``logits`` (R, V), PAD and BOS excluded (-inf): what a search ranks."""
    lprobs = logits.float()  # the step's own logits: overwritten in place, no fresh (n*k, V) buffer per step
    torch.log_softmax(lprobs, dim=-1, out=lprobs)
    lprobs[:, PAD] = NEG_INF
    lprobs[:, BOS] = NEG_INF
    return lprobs


def block_repeated_ngrams(lprobs: Tensor, generated: Tensor, n: int) -> Tensor:
    """``lprobs`` (R, V), in place, with -inf for each token that would repeat an n-gram of its row's
    ``generated`` (R, t).

    The last n - 1 tokens of a row are compared with every (n-1)-gram before
    it; where they match, the token that followed there is banned.
    """
    t = generated.shape[1]
    if t < n:  # no complete n-gram yet
        return lprobs
    grams = generated.unfold(1, n, 1)  # (R, t-n+1, n): the row's n-grams so far
    tail = generated[:, t - n + 1 :]  # (R, n-1): the n-1 tokens a new n-gram would start with
    repeats = (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1)  # (R, t-n+1)
    # amin with 0 keeps a log-probability (<= 0) and with -inf bans it: no (R, V) penalty tensor is built, and a
    # token that closes both a repeated and an unrepeated n-gram stays banned
    ban = torch.where(repeats, NEG_INF, 0.0).to(lprobs.dtype)
    return lprobs.scatter_reduce_(1, grams[:, :, -1], ban, reduce="amin")


def force_eos_at_max_len(lprobs: Tensor, at_max: Tensor) -> Tensor:
    """``lprobs`` (R, V), in place: rows at their maximum length (at_max (R,) bool) may only end, every token
    but EOS gets -inf. Only those rows are written (no (R, V) copies at the steps where some row ends)."""
    rows = at_max.nonzero().squeeze(1)
    if rows.numel() == 0:
        return lprobs
    eos = lprobs[rows, EOS]  # (r,), a copy
    lprobs.index_fill_(0, rows, NEG_INF)
    lprobs[rows, EOS] = eos
    return lprobs


def top_candidates(scores: Tensor, row_lprobs: Tensor, row_tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The 2k best one-token extensions per sentence over (beam x vocab), by raw log-probability.

    ``scores`` (n, w) holds the w beams of each sentence (w = 1 at the first
    step); ``row_lprobs`` and ``row_tokens`` (n*w, m) the m = min(2k, V) best
    tokens of each beam (`best_extensions`). Returns scores, beam indices and
    tokens, each (n, 2k), best first. Empty beams (-inf) only produce -inf
    candidates, which are never kept; so are the -inf candidates that fill
    the 2k places when a vocabulary smaller than 2k leaves fewer. Every
    candidate is among the 2k best tokens of its own beam, so only those are
    read, and the (n, w, V) sums are never formed.
    """
    n, w = scores.shape
    m = row_lprobs.shape[1]
    total = (scores.view(-1, 1) + row_lprobs).view(n, w * m)  # raw log-probabilities, as scores + lprobs
    fill = 2 * k - w * m  # > 0 only for one beam over a vocabulary of fewer than 2k tokens
    if fill > 0:
        total = torch.cat([total, total.new_full((n, fill), NEG_INF)], dim=1)
    cand_scores, flat = total.topk(2 * k, dim=1)  # (n, 2k)
    if fill > 0:
        flat = flat.clamp_max(w * m - 1)  # a filler names a real candidate; its -inf score keeps it out
    return cand_scores, flat // m, row_tokens.view(n, w * m).gather(1, flat)


CHUNK = 64  # columns per chunk of `row_topk`


def row_topk(x: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """``x.topk(m, dim=1)`` of a wide (rows, V) tensor, sorting only a few chunks of each row.

    The m largest values of a row lie in the m chunks (of CHUNK columns) whose
    maxima are largest: a chunk outside those has m chunks above it, each with
    a value above all of its own. So the chunk maxima (one pass over x) pick
    m chunks, and only their m * CHUNK columns are sorted; on a row of 8000
    log-probabilities this halves the time of a full `topk`, a tenth of a
    decoding step. The columns past the last whole chunk are always
    candidates. Narrow rows take `topk` itself. Values are topk's; among
    equal values the order of the indices may differ from it.
    """
    rows, width = x.shape
    chunks = width // CHUNK
    if chunks < 8 * m:
        return x.topk(m, dim=1)
    maxima = x[:, : chunks * CHUNK].unflatten(1, (chunks, CHUNK)).amax(dim=2)  # (rows, chunks)
    best = maxima.topk(m, dim=1).indices  # (rows, m)
    cols = (best[:, :, None] * CHUNK + torch.arange(CHUNK, device=x.device)).flatten(1)  # (rows, m*CHUNK)
    if chunks * CHUNK < width:
        tail = torch.arange(chunks * CHUNK, width, device=x.device).expand(rows, -1)
        cols = torch.cat([cols, tail], dim=1)
    values, pos = x.gather(1, cols).topk(m, dim=1)
    return values, cols.gather(1, pos)


def collect_finished(
    finished: Finished,
    beams: Beams,
    cand_scores: Tensor,
    cand_beam: Tensor,
    cand_token: Tensor,
    step: int | Tensor,
    settings: SearchSettings,
    bos: Tensor | None = None,
) -> None:
    """Set aside the EOS candidates ranked among the first k: they end with ``step + 1`` tokens, EOS included.

    ``step`` and ``bos`` (the column of ``beams.tokens`` holding BOS, 0 when None) may be one per sentence (n,),
    for sentences that joined a running search at different steps (`transformer_mt.decode.continuous`).
    """
    k = finished.k
    is_eos = (cand_token[:, :k] == EOS) & torch.isfinite(cand_scores[:, :k])  # (n, k)
    found = is_eos.nonzero()  # (f, 2): sentence position and rank of every finished candidate
    if found.numel() == 0:
        return
    i, j = found.unbind(1)
    rows = i * beams.width + cand_beam[i, j]  # (f,) the beam row each one extends
    # the candidates' data to Python in one conversion each, not a few tensor reads per hypothesis
    sentences, log_probs = beams.sent[i].tolist(), cand_scores[i, j].tolist()
    steps = [step] * len(sentences) if isinstance(step, int) else step[i].tolist()
    firsts = [1] * len(sentences) if bos is None else (bos[i] + 1).tolist()
    found_tokens = beams.tokens[rows].tolist()
    for sentence, log_prob, t, first, tokens in zip(sentences, log_probs, steps, firsts, found_tokens, strict=True):
        penalty = float(settings.penalty(float(t + 1)))
        finished.add(sentence, Hypothesis(tokens[first:], log_prob / penalty, log_prob))


def select_live(cand_scores: Tensor, cand_beam: Tensor, cand_token: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The k best candidates that do not end in EOS: scores, beams, tokens, each (n, k), best first."""
    not_eos = cand_scores.masked_fill(cand_token == EOS, NEG_INF)
    live_scores, pos = not_eos.topk(k, dim=1)  # (n, k)
    return live_scores, cand_beam.gather(1, pos), cand_token.gather(1, pos)


def sentences_done(
    finished: Finished, beams: Beams, live_scores: Tensor, step: int | Tensor, settings: SearchSettings
) -> Tensor:
    """(n,) bool: the sentences whose result can no longer change, or with ``k_finished`` the sentences with k
    finished hypotheses. ``step`` may be one per sentence (n,).

    The bound is exact: a live hypothesis of raw log-probability s <= 0 after
    t tokens ends with a length L in [t + 1, max_len + 1], so it can reach at
    most s / max(lp(t + 1), lp(max_len + 1)) (lp is monotonic in L).
    """
    k = finished.k
    best_live = live_scores[:, 0].double()  # (n,) raw log-probabilities, -inf when nothing is live
    t = step + 1  # tokens of the live hypotheses after this step
    lp_now = settings.penalty(torch.as_tensor(t + 1, dtype=torch.float64))
    lp_max = settings.penalty(beams.max_len.double() + 1.0)
    bound = best_live / torch.maximum(lp_max, lp_now)  # (n,) best normalized score a live one could reach
    worst = torch.tensor([finished.kth_score(s) for s in beams.sent.tolist()], dtype=torch.float64)
    worst = worst.to(bound.device)
    # Greedy (k = 1) and k_finished: done once k hypotheses have finished. Otherwise compare with the k-th best
    # finished score, which is -inf (anything can still enter) while fewer than k are finished.
    can_improve = torch.isinf(worst) if k == 1 or settings.stopping == "k_finished" else bound >= worst
    return ~can_improve | torch.isinf(best_live) | (beams.max_len <= step)


def advance(beams: Beams, choice: Choice, k: int) -> Beams:
    """Append the chosen tokens, point each cache row at its parent and drop the done sentences.

    After the first step, widen each sentence from its one hypothesis to k beams.
    """
    live_scores, live_beam, live_token, done = choice
    keep = kept_sentences(done)  # (n',) positions of the sentences still active
    shrink = keep.numel() < done.numel()
    w = beams.width
    rows = (keep[:, None] * w + live_beam.index_select(0, keep)).view(-1)  # (n'*k,) parent row of each new row
    tokens = torch.cat([beams.tokens.index_select(0, rows), live_token.index_select(0, keep).view(-1, 1)], dim=1)
    if beams.cache is not None:
        beams.cache.reorder(rows, sentences=keep if shrink else None, beams=k if w < k else None)
    enc = beams.enc
    if (shrink or w < k) and beams.cache is None:  # with a cache the decoder reads the encoder output no more
        enc = enc.reorder((keep * w).repeat_interleave(k))  # the beams of a sentence share one encoder output
    return Beams(
        beams.sent.index_select(0, keep),
        beams.max_len.index_select(0, keep),
        tokens,
        live_scores.index_select(0, keep),
        enc,
        beams.cache,
    )


def kept_sentences(done: Tensor) -> Tensor:
    """(n',) the sentences not ``done`` (n,), in the order that moves the fewest of them.

    Each sentence among the first n' stays where it is; the active sentences
    beyond n' fill the places of the done ones there. Dropping f sentences
    then moves at most f rows of the cache (`DecoderCache.reorder` copies only
    the moved rows) instead of every row behind the first done one. The order
    of sentences in a batch changes nothing else: ``_Beams.sent`` follows them.
    """
    alive = (~done).nonzero().squeeze(1)
    n = alive.numel()
    keep = torch.arange(n, device=done.device)
    keep[done[:n].nonzero().squeeze(1)] = alive[alive >= n]  # as many done places in front as active ones behind
    return keep
