"""Lexically constrained beam search: every output contains given target phrases (``tmt translate --constraints``).

The algorithm is dynamic beam allocation (Post & Vilar, 2018, "Fast
Lexically Constrained Decoding with Dynamic Beam Allocation"), vectorized
over the sentences of a batch as Hu et al. (2019) did. Each sentence has a
set of constraints, phrases of target token ids, to appear in its output in
any order, each as contiguous tokens, each met by an occurrence of its own.
The search is `transformer_mt.decode.search.beam_search` (its docstring
states the rules kept here: the cache, the first step, length penalty,
maximum length, exact early stopping, sentences leaving the batch) with
these changes, per sentence and step, beam size k:

1. Constraint state. Each hypothesis records which constraints it has met,
   and the phrase in progress: how many of its first tokens end the output
   (``prog``) and which unmet constraints begin with them (``cand``, more than
   one when phrases share a first word). A token that continues one of them
   advances; a phrase of ``prog + 1`` tokens is then met (the first such, so
   two equal phrases need two occurrences). Any other token abandons the
   partial phrase (it counts for nothing) and may start an unmet constraint.
   Matching is greedy, left to right: a phrase that overlaps itself (x x y
   after x x x y) may be missed by the count; the search then places it again,
   so an output it finishes always holds what the count says.
2. Candidates, the union of (a) the 2k best extensions over (beam x
   vocabulary), as in the ordinary search, (b) every hypothesis extended by
   each token that advances one of its unmet constraints, and (c) every
   hypothesis extended by its own best token; a (hypothesis, token) pair
   named twice counts once.
3. Banks. A candidate's bank is the number of constraint tokens it has met
   (``prog`` included), 0 to T (T: the sentence's constraint tokens). The
   beam is filled round-robin over the banks, highest first: the best
   candidate of each non-empty bank, then the second best of each, and so
   on, until k are chosen; a bank without candidates leaves its places to
   the others. So hypotheses that have met more constraints always hold
   places, however unlikely their words.
4. EOS is allowed only once every constraint is met. EOS candidates take part
   in the allocation of step 3 (all in bank T); those chosen are finished,
   as the EOS candidates among the first k are in the ordinary search. The
   live hypotheses are the allocation of k places among the candidates that
   do not end in EOS.
5. Length. T must fit in the maximum output length (`constrained_search`
   raises otherwise). A hypothesis that could no longer place its missing
   constraint tokens before the maximum length if it spent the next token
   elsewhere (abandoning its partial phrase included) may only take a token
   that advances a constraint, or begins one where that leaves room: every
   hypothesis at the maximum length has met all of them.
6. ``no_repeat_ngram`` never bans a token that advances a constraint: the
   constraint wins over the deviation.
7. With ``continues_word`` (`word_continuations`: the subword pieces that
   carry on the word before them), a completed phrase ends its word: the
   token after it may not continue it ("Boden gebracht" is not met by
   "Boden gebrachtenen"). A phrase begins a word by itself, its first piece
   being word-initial.

With no constraints there is one bank, (b) is empty and (c) ranks below the
2k candidates of (a) unless it is one of them, so a sentence without
constraints gets the ordinary search's hypotheses (equal scores may be
ordered differently). `tmt translate` sends such lines to `beam_search`
itself all the same, which costs less per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sentencepiece as spm
import torch
from torch import Tensor

from transformer_mt.data.bpe import EOS, UNK
from transformer_mt.data.clean import normalize
from transformer_mt.decode.search import (
    NEG_INF,
    Beams,
    Choice,
    Finished,
    Hypothesis,
    StepRules,
    block_repeated_ngrams,
    collect_finished,
    force_eos_at_max_len,
    kept_sentences,
    row_topk,
    search,
    sentences_done,
    step_log_probs,
)
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.errors import UserError

Constraints = Sequence[Sequence[int]]
"""The phrases (target token ids, each non-empty) one sentence's output must contain."""


class ConstraintLengthError(ValueError):
    """A sentence's constraints hold more tokens than its maximum output length."""

    def __init__(self, sentence: int, needed: int, max_len: int) -> None:
        super().__init__(f"sentence {sentence}: the constraints need {needed} tokens, the output may have {max_len}")
        self.sentence, self.needed, self.max_len = sentence, needed, max_len


@dataclass(frozen=True)
class _Phrases:
    """The constraints of the active sentences: ``tokens`` (n, C, L), -1 past a phrase's end; ``lengths`` (n, C), 0
    for the places of sentences with fewer than C constraints."""

    tokens: Tensor
    lengths: Tensor

    @property
    def total(self) -> Tensor:
        """(n,) constraint tokens of each sentence: T, the number of the highest bank."""
        return self.lengths.sum(dim=1)

    def select(self, index: Tensor) -> _Phrases:
        """The rows ``index`` (sentences, or sentences repeated per beam or per candidate)."""
        return _Phrases(self.tokens.index_select(0, index), self.lengths.index_select(0, index))


def phrase_table(constraints: Sequence[Constraints], device: torch.device | str = "cpu") -> _Phrases:
    """The constraint lists of a batch, one per sentence, as padded tensors."""
    c = max((len(phrases) for phrases in constraints), default=0)
    width = max((len(p) for phrases in constraints for p in phrases), default=0)
    tokens = torch.full((len(constraints), c, max(width, 1)), -1, dtype=torch.long)
    lengths = torch.zeros((len(constraints), c), dtype=torch.long)
    for i, phrases in enumerate(constraints):
        for j, phrase in enumerate(phrases):
            if not phrase:
                raise ValueError(f"sentence {i}: constraint {j + 1} is empty")
            tokens[i, j, : len(phrase)] = torch.tensor(list(phrase))
            lengths[i, j] = len(phrase)
    return _Phrases(tokens.to(device), lengths.to(device))


@dataclass(frozen=True)
class ConstraintState:
    """The constraint state of R hypotheses (module docstring, rule 1)."""

    met: Tensor  # (R, C) bool: constraints in the output already; the empty places of a short list count as met
    cand: Tensor  # (R, C) bool: the unmet constraints whose first ``prog`` tokens end the output
    prog: Tensor  # (R,) long: tokens of the phrase in progress (0: none)
    ended: Tensor  # (R,) bool: the last token completed a phrase

    @classmethod
    def start(cls, phrases: _Phrases) -> ConstraintState:
        """Nothing generated yet: nothing met, no phrase in progress."""
        met = phrases.lengths == 0
        none = torch.zeros(met.shape[0], dtype=torch.long, device=met.device)
        return cls(met, torch.zeros_like(met), none, none.bool())

    def select(self, index: Tensor) -> ConstraintState:
        return ConstraintState(*(x.index_select(0, index) for x in (self.met, self.cand, self.prog, self.ended)))

    def met_tokens(self, phrases: _Phrases) -> Tensor:
        """(R,) constraint tokens met, the partial phrase included: the hypothesis' bank."""
        return (phrases.lengths * self.met).sum(dim=1) + self.prog

    def next_tokens(self, phrases: _Phrases) -> Tensor:
        """(R, C) the token that would advance each constraint (-1: none): the phrase in progress continues, or,
        with none in progress, an unmet phrase begins."""
        pos = self.prog[:, None].expand_as(phrases.lengths)
        tokens = phrases.tokens.gather(2, pos.clamp(max=phrases.tokens.shape[2] - 1)[..., None]).squeeze(2)
        open_ = torch.where(self.prog[:, None] > 0, self.cand, ~self.met) & (pos < phrases.lengths)
        return tokens.masked_fill(~open_, -1)

    def extend(self, phrases: _Phrases, tokens: Tensor) -> ConstraintState:
        """The state after appending ``tokens`` (R,), one per hypothesis; ``phrases`` has one row per hypothesis."""
        advances = self.next_tokens(phrases) == tokens[:, None]  # (R, C)
        go_on = (self.prog > 0) & advances.any(dim=1)  # the phrase in progress continues
        starts = ~self.met & (phrases.tokens[:, :, 0] == tokens[:, None])  # else: a phrase begins (or none)
        cand = torch.where(go_on[:, None], advances, starts)
        prog = torch.where(go_on, self.prog + 1, starts.any(dim=1).long())
        complete = cand & (phrases.lengths == prog[:, None])
        first = complete & (complete.long().cumsum(dim=1) == 1)  # of equal phrases, one is met per occurrence
        ended = complete.any(dim=1)
        return ConstraintState(self.met | first, cand & ~ended[:, None], prog.masked_fill(ended, 0), ended)


def contains_constraints(tokens: Sequence[int], constraints: Constraints) -> bool:
    """Whether ``tokens`` hold every phrase of ``constraints`` as counted by the search (rule 1)."""
    if not constraints:
        return True
    phrases = phrase_table([constraints])
    state = ConstraintState.start(phrases)
    for token in tokens:
        state = state.extend(phrases, torch.tensor([token]))
    return bool(state.met.all())


class ConstrainedStep:
    """A step of the constrained search (rules 1-7): the candidates (`_expand`) and the banks' places for the
    finished and the live ones (`_choose`). It holds the constraint state of the live hypotheses and the phrases
    of the active sentences, kept in step with the search's rows."""

    score_dtype = torch.float32

    def __init__(self, settings: SearchSettings, phrases: _Phrases, continues_word: Tensor | None = None) -> None:
        self.settings, self.phrases, self.continues_word = settings, phrases, continues_word
        self.state = ConstraintState.start(phrases)
        self.width = settings.beam_size

    def __call__(
        self, model: Any, features: Tensor, beams: Beams, finished: Finished, step: int | Tensor,
        rules: StepRules, bos: Tensor | None = None,
    ) -> Choice:  # fmt: skip
        assert isinstance(step, int), "a constrained search runs in rounds, every sentence at the same step"
        cands, after, bank = self._expand(step_log_probs(model.logits(features)), beams, rules, step)
        return self._choose(finished, beams, cands, after, bank, step)

    def _expand(
        self, lprobs: Tensor, beams: Beams, rules: StepRules, step: int
    ) -> tuple[_Candidates, ConstraintState, Tensor]:
        """One step's candidates (rules 2, 4-7) with the constraint state each would have and its bank (n, M).

        Split from `_choose` so that what a step proposes and what it keeps
        can be read apart: here nothing is decided, every candidate is scored.
        """
        w, k = beams.width, self.width
        device = beams.sent.device
        rows = torch.arange(beams.sent.numel(), device=device).repeat_interleave(w)  # sentence of each row
        row_phrases = self.phrases.select(rows)
        nxt = self.state.next_tokens(row_phrases)  # (n*w, C)
        lprobs = _restrict(lprobs, beams, rules, self.state, row_phrases, nxt, step, self.settings.no_repeat_ngram,
                           self.continues_word)  # fmt: skip
        cands = _candidates(beams.scores, lprobs, nxt, k)
        sentence = torch.arange(beams.sent.numel(), device=device)[:, None].expand_as(cands.beam).flatten()
        cand_phrases = self.phrases.select(sentence)  # (n*M) rows: one per candidate
        after = self.state.select(sentence * w + cands.beam.flatten()).extend(cand_phrases, cands.token.flatten())
        bank = after.met_tokens(cand_phrases).view_as(cands.score)
        return cands, after, bank

    def _choose(
        self, finished: Finished, beams: Beams, cands: _Candidates, after: ConstraintState, bank: Tensor, step: int
    ) -> Choice:
        """Rules 3-4: the banks' places for the EOS candidates (finished, into ``finished``) and for the live
        ones; the constraint state and phrases move on with the sentences that are not done."""
        k, total = self.width, self.phrases.total
        chosen = _allocate(cands.score, bank, total, k)  # the EOS candidates given a place are finished (rule 4)
        collect_finished(finished, beams, *cands.take(chosen), step, self.settings)
        not_eos = cands.score.masked_fill(cands.token == EOS, NEG_INF)
        live = _allocate(not_eos, bank, total, k)
        _, live_beam, live_token = cands.take(live)
        live_scores = not_eos.gather(1, live)
        done = sentences_done(finished, beams, live_scores, step, self.settings)
        keep = kept_sentences(done)
        self.state = after.select((keep[:, None] * cands.score.shape[1] + live.index_select(0, keep)).flatten())
        self.phrases = self.phrases.select(keep)
        return Choice(live_scores, live_beam, live_token, done)


def constrained_search(
    model: Any,
    src: Tensor,
    constraints: Sequence[Constraints],
    settings: SearchSettings,
    nbest: int = 1,
    continues_word: Tensor | None = None,
    use_cache: bool = True,
    after_step: Callable[[], object] | None = None,
) -> list[list[Hypothesis]]:
    """`search` whose every hypothesis of sentence i contains the phrases ``constraints[i]`` (module docstring).

    ``continues_word`` (V,) bool: the tokens that continue the word before
    them (`word_continuations`); given, none may follow a completed phrase
    (rule 7). ``after_step``: called after every step, as in `search`.

    Raises `ConstraintLengthError` (the first sentence at fault) when a
    sentence's constraint tokens exceed its maximum output length.
    """
    if not 1 <= nbest <= settings.beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size ({settings.beam_size}), got {nbest}")
    if len(constraints) != src.shape[0]:
        raise ValueError(f"{src.shape[0]} sentences but {len(constraints)} constraint lists")
    phrases = phrase_table(constraints, src.device)
    _check_room(phrases, settings.max_lengths(src))
    step = ConstrainedStep(settings, phrases, continues_word)
    return search(model, src, settings, step, nbest, use_cache=use_cache, after_step=after_step)


def _check_room(phrases: _Phrases, max_len: Tensor) -> None:
    """Rule 5's precondition: a sentence whose constraint tokens exceed its maximum output length has no
    output at all, so the search refuses it up front (the first sentence at fault) rather than end empty."""
    too_long = (phrases.total > max_len.to(phrases.total.device)).nonzero().flatten().tolist()
    if too_long:
        i = too_long[0]
        raise ConstraintLengthError(i, int(phrases.total[i]), int(max_len[i]))


def _restrict(
    lprobs: Tensor, beams: Beams, rules: StepRules, state: ConstraintState, phrases: _Phrases, nxt: Tensor, step: int,
    no_repeat_ngram: int, continues_word: Tensor | None,
) -> Tensor:  # fmt: skip
    """``lprobs`` (n*w, V), in place, with the constraint rules 4-6: EOS only when all constraints are met; where
    the length left demands it, only tokens that advance a constraint (or begin one, if that leaves room); those
    tokens exempt from n-gram blocking; EOS forced at the maximum length."""
    begins = torch.where(state.met, -1, phrases.tokens[:, :, 0])  # (n*w, C) first tokens of the unmet phrases
    tokens = torch.cat([nxt, begins], dim=1)
    index = tokens.clamp(min=0)
    before = lprobs.gather(1, index)  # their log-probabilities before n-gram blocking
    if no_repeat_ngram > 0:
        lprobs = block_repeated_ngrams(lprobs, rules.generated, no_repeat_ngram)
    row_max = beams.max_len.repeat_interleave(beams.width)
    needed = phrases.total - state.met_tokens(phrases)  # (n*w,) constraint tokens still to place, the partial's too
    lprobs[:, EOS].masked_fill_(needed > 0, NEG_INF)
    # places left after this step for the tokens still needed, if this token advances nothing: the partial
    # phrase is lost (+ prog), or, if the token begins a phrase, lost but for that token (+ prog - 1)
    spare = row_max - step - 1 - needed - state.prog
    must_advance = (spare < 0) & (needed > 0)
    lprobs.index_fill_(0, must_advance.nonzero().squeeze(1), NEG_INF)  # those rows only, not a pass over all
    if continues_word is not None:  # rule 7: a completed phrase ends its word
        ended = state.ended.nonzero().squeeze(1)
        lprobs[ended] = lprobs[ended].masked_fill(continues_word, NEG_INF)
    allowed = torch.cat([nxt >= 0, (begins >= 0) & (spare >= -1)[:, None]], dim=1)
    # amax: a token listed twice (an advancing one that also begins a phrase) gets its value whatever the order
    lprobs.scatter_reduce_(1, index, before.masked_fill(~allowed, NEG_INF), reduce="amax")
    return force_eos_at_max_len(lprobs, rules.at_max)


@dataclass(frozen=True)
class _Candidates:
    """One step's candidates of each of n sentences, M each: raw log-probability, beam extended, token."""

    score: Tensor  # (n, M), -inf: none (or a repeat of an earlier candidate)
    beam: Tensor  # (n, M)
    token: Tensor  # (n, M)

    def take(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Scores, beams and tokens of the candidates at ``index`` (n, j)."""
        return self.score.gather(1, index), self.beam.gather(1, index), self.token.gather(1, index)


def _candidates(scores: Tensor, lprobs: Tensor, nxt: Tensor, k: int) -> _Candidates:
    """Rule 2: (a) the 2k best extensions, (b) each hypothesis extended by each token that advances a constraint,
    (c) each hypothesis extended by its best token; a (beam, token) pair that comes again gets -inf."""
    n, w = scores.shape
    c = nxt.shape[1]
    # (a) as `top_candidates` finds them, whose per-beam best tokens are (c)
    m = min(2 * k, lprobs.shape[1])
    row_lprobs, row_tokens = row_topk(lprobs, m)  # (n*w, m)
    top_scores, flat = (scores.view(-1, 1) + row_lprobs).view(n, w * m).topk(min(2 * k, w * m), dim=1)
    top_beam, top_token = flat // m, row_tokens.view(n, w * m).gather(1, flat)
    adv = scores.view(-1, 1) + lprobs.gather(1, nxt.clamp(min=0))  # (b) (n*w, C)
    adv = adv.masked_fill(nxt < 0, NEG_INF).view(n, w * c)
    adv_beam = torch.arange(w, device=scores.device).repeat_interleave(c).expand(n, -1)
    beam_ids = torch.arange(w, device=scores.device).expand(n, -1)
    fill = max(k - top_scores.shape[1] - w * c - w, 0)  # -inf places: at least k candidates (a tiny vocabulary)
    score = torch.cat(
        [top_scores, adv, scores + row_lprobs[:, 0].view(n, w), scores.new_full((n, fill), NEG_INF)], dim=1
    )
    beam = torch.cat([top_beam, adv_beam, beam_ids, beam_ids.new_zeros((n, fill))], dim=1)
    token = torch.cat(
        [top_token, nxt.clamp(min=0).view(n, w * c), row_tokens[:, 0].view(n, w), top_token.new_zeros((n, fill))],
        dim=1,
    )
    return _Candidates(_drop_repeats(score, beam * lprobs.shape[1] + token), beam, token)


def _drop_repeats(score: Tensor, key: Tensor) -> Tensor:
    """``score`` (n, M) with -inf for every candidate whose ``key`` (n, M) an earlier one of its row has."""
    sorted_key, order = key.sort(dim=1, stable=True)
    repeat = torch.zeros_like(key, dtype=torch.bool)
    repeat[:, 1:] = sorted_key[:, 1:] == sorted_key[:, :-1]
    return score.masked_fill(repeat.scatter(1, order, repeat), NEG_INF)


def _allocate(score: Tensor, bank: Tensor, total: Tensor, k: int) -> Tensor:
    """Rule 3: the positions (n, k) of the k candidates the banks give places to, best score first.

    Candidates are ranked by score within their bank; places go in order of
    (rank, bank from the highest down): round-robin over the banks. -inf
    candidates come last. With one bank this is the k best by score.
    """
    order = score.argsort(dim=1, descending=True, stable=True)  # (n, M)
    s, b = score.gather(1, order), bank.gather(1, order).clamp(min=0)
    banks = int(total.max()) + 1 if total.numel() else 1
    onehot = torch.nn.functional.one_hot(b.clamp(max=banks - 1), banks)  # (n, M, banks)
    rank = (onehot.cumsum(dim=1) * onehot).sum(dim=2) - 1  # place of each candidate within its bank
    key = rank * banks + (total[:, None] - b)
    key = key.masked_fill(torch.isinf(s), torch.iinfo(torch.long).max)
    picked = order.gather(1, key.argsort(dim=1, stable=True)[:, :k])  # (n, k)
    best_first = score.gather(1, picked).argsort(dim=1, descending=True, stable=True)
    return picked.gather(1, best_first)


# -- text: `tmt translate --constraints` input lines


class ConstraintError(UserError):
    """A ``--constraints`` input line that cannot be searched; the message names the line and the fix."""


def split_constraints(line: str, index: int) -> tuple[str, list[str]]:
    """The source and the constraint phrases of input line ``index`` (0-based): fairseq's format,
    ``source<TAB>phrase<TAB>phrase...``; a line without a tab has no constraints."""
    source, *phrases = line.split("\t")
    where = f"--constraints: line {index + 1}"
    if phrases and not normalize(source):
        raise ConstraintError(
            f"{where}: constraints but no source text before the first tab; put the sentence to translate first"
        )
    for j, phrase in enumerate(phrases):
        if not normalize(phrase):
            raise ConstraintError(
                f"{where}: constraint {j + 1} is empty (two tabs in a row, or a tab at the end of the line); each "
                "tab starts a phrase the translation must contain: remove the extra tab"
            )
    return source, phrases


def encode_constraints(bpe: spm.SentencePieceProcessor, phrases: Sequence[str], where: str) -> list[list[int]]:
    """Each phrase as the model's tokens, normalized and encoded as the source is (`Translator.encode`); ``where``
    names the line in errors (``--constraints: line 3``, or a request's ``constraints[2]``).

    sentencepiece marks a word that follows a space with a leading ``▁``
    and segments each space-separated word on its own, so a phrase encoded
    alone is the token sequence the same words have after a space in a
    sentence. A phrase glued to the word before it (a suffix, or
    punctuation such as the '.' of "Hund.") is encoded as if a space came
    before it, and is then placed after a space in the output.
    """
    encoded = []
    for j, phrase in enumerate(phrases):
        ids = bpe.encode(normalize(phrase), out_type=int)
        if UNK in ids:
            raise ConstraintError(
                f"{where}: constraint {j + 1} ({phrase!r}) holds characters the model's "
                "vocabulary lacks (they encode to <unk>); remove them or use another phrase"
            )
        encoded.append(ids)
    return encoded


def word_continuations(bpe: spm.SentencePieceProcessor) -> Tensor:
    """(V,) bool: the pieces that continue the word before them (no leading ``▁``, a letter or digit in them).

    Punctuation pieces (",", ".") may follow a word without a space, so they
    do not count; neither do the control pieces.
    """
    marks = [
        not (bpe.is_control(i) or bpe.is_unknown(i) or piece.startswith("\u2581")) and any(c.isalnum() for c in piece)
        for i, piece in enumerate(bpe.id_to_piece(i) for i in range(bpe.get_piece_size()))
    ]
    return torch.tensor(marks, dtype=torch.bool)


def check_lengths(
    where: str, phrases: Sequence[Sequence[int]], source: Sequence[int], settings: SearchSettings
) -> None:
    """The constraints of a line (``where`` names it) fit in its longest output (``source``: its ids and EOS)."""
    needed = sum(map(len, phrases))
    max_len = int(settings.max_lengths(torch.tensor([list(source)]))[0])
    if needed > max_len:
        raise ConstraintError(
            f"{where}: the constraints take {needed} tokens, more than the {max_len} this "
            f"line's translation may have (decode.max_len_a x source tokens + decode.max_len_b, within "
            "model.max_positions); shorten them, or raise the limit with --set decode.max_len_b=..."
        )
