"""Beam search: exact hypotheses and scores on fake decoders with hand-set probabilities, and a real tiny Transformer.

The fake decoder's next-token distribution is a function of (sentence, prefix)
only. It reads the sentence from the cache's per-sentence state (as the real
cache holds cross-attention keys/values once per sentence) and the prefix
from its per-row state, so a wrong cache reorder or a wrong sentence dropped
when one finishes changes the probabilities and fails the tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    B_,
    A,
    FakeModel,
    Table,
    exhaustive,
    fake_src,
    hand_table,
    hyp_tuples,
    never_ending,
    probs,
    random_table,
    real_src,
    reference_beam,
    tiny_transformer,
)

from transformer_mt.data.bpe import BOS, EOS, PAD, UNK
from transformer_mt.decode import search
from transformer_mt.decode.search import (
    Prefixes,
    StepRules,
    beam_search,
    best_extensions,
    block_repeated_ngrams,
    kept_sentences,
    row_topk,
    step_log_probs,
)
from transformer_mt.decode.settings import SearchSettings, length_penalty, max_output_lengths
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


# --- length penalty and maximum length: the formulas ---------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 7, 30])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 1.7])
def test_length_penalty_formulas(length: int, alpha: float) -> None:
    assert length_penalty(float(length), alpha, "gnmt") == pytest.approx(((5 + length) / 6) ** alpha)
    assert length_penalty(float(length), alpha, "fairseq") == pytest.approx(length**alpha)
    t = length_penalty(torch.tensor([float(length)]), alpha, "gnmt")
    assert float(t[0]) == pytest.approx(((5 + length) / 6) ** alpha)


def test_length_penalty_gnmt_values() -> None:
    assert length_penalty(1.0, 0.6, "gnmt") == 1.0  # (5 + 1) / 6 = 1
    assert length_penalty(7.0, 1.0, "gnmt") == 2.0
    with pytest.raises(ValueError, match="unknown length penalty form"):
        length_penalty(3.0, 0.6, "average")  # type: ignore[arg-type]


def test_max_output_lengths_formula_and_cap() -> None:
    src = torch.tensor([[5, 6, 7, EOS], [5, EOS, PAD, PAD], [EOS, PAD, PAD, PAD]])  # src_len 3, 1, 0
    assert max_output_lengths(src, 1.0, 50).tolist() == [53, 51, 50]
    assert max_output_lengths(src, 1.5, 2).tolist() == [6, 3, 2]  # floor(1.5 * 1 + 2) = 3
    assert max_output_lengths(src, 1.0, 50, max_positions=52).tolist() == [51, 51, 50]  # BOS + 51 = 52 positions


# --- exact hypotheses on a hand-set decoder ---------------------------------------------------------------------------


def test_beam2_hand_computed_hypotheses_and_scores() -> None:
    """Worked by hand, beam 2, alpha 0 (scores are log-probabilities).

    step 0: candidates a .6, b .4 -> live a, b
    step 1: b.EOS .32, aa .30, a.EOS .24, ab .06 -> b.EOS finished (ranked 1st); live aa, ab
            (a.EOS ranks 3rd, outside the beam: dropped)
    step 2: aa.EOS .30, ab.EOS .03, aba .015, abb .015 -> both EOS finished; kept: b (.32), aa (.30)
            best live .015 cannot reach .30: done after 3 decoder steps although max length is 10.
    """
    model = FakeModel(hand_table)
    [hyps] = beam_search(
        model, torch.tensor([[EOS]]), SearchSettings(beam_size=2, len_penalty=0.0, max_len_a=0, max_len_b=10), nbest=2
    )
    assert hyp_tuples(hyps) == [(B_,), (A, A)]
    assert hyps[0].log_prob == pytest.approx(math.log(0.32), abs=1e-5)
    assert hyps[1].log_prob == pytest.approx(math.log(0.30), abs=1e-5)
    assert hyps[0].score == pytest.approx(math.log(0.32), abs=1e-5)
    assert model.decode_calls == 3


def test_beam2_gnmt_penalty_reorders_hypotheses() -> None:
    """alpha 1: b.EOS -> log .32 / ((5+2)/6) = -0.976; aa.EOS -> log .30 / ((5+3)/6) = -0.903: aa now wins."""
    [hyps] = beam_search(
        FakeModel(hand_table),
        torch.tensor([[EOS]]),
        SearchSettings(beam_size=2, len_penalty=1.0, max_len_a=0, max_len_b=3),
        nbest=2,
    )
    assert hyp_tuples(hyps) == [(A, A), (B_,)]
    assert hyps[0].score == pytest.approx(math.log(0.30) / (8 / 6), abs=1e-5)
    assert hyps[1].score == pytest.approx(math.log(0.32) / (7 / 6), abs=1e-5)
    assert hyps[0].log_prob == pytest.approx(math.log(0.30), abs=1e-5)
    fair = beam_search(
        FakeModel(hand_table),
        torch.tensor([[EOS]]),
        SearchSettings(beam_size=2, len_penalty=1.0, len_penalty_form="fairseq", max_len_a=0, max_len_b=3),
        nbest=2,
    )[0]
    assert hyp_tuples(fair) == [(A, A), (B_,)]  # log .30 / 3 = -0.401 beats log .32 / 2 = -0.570
    assert fair[0].score == pytest.approx(math.log(0.30) / 3, abs=1e-5)


def test_beam1_is_greedy_on_hand_table() -> None:
    """Greedy: a (.6), then a (.5), then EOS (1.0); beam 2 found b instead (higher probability, alpha 0)."""
    [hyps] = beam_search(
        FakeModel(hand_table), torch.tensor([[EOS]]), SearchSettings(beam_size=1, len_penalty=0.0, max_len_b=10)
    )
    assert hyp_tuples(hyps) == [(A, A)]
    assert hyps[0].log_prob == pytest.approx(math.log(0.30), abs=1e-5)


# --- early stopping ---------------------------------------------------------------------------------------------------


def late_winner_table(s: int, prefix: tuple[int, ...]) -> list[float]:
    """EOS .5 / a .5 at the start and after a; after aa EOS is certain."""
    if prefix == (A, A):
        return probs(eos=1.0)
    return probs(eos=0.5, a=0.5)


def test_early_stop_waits_while_a_live_hypothesis_can_still_win() -> None:
    """gnmt alpha 1, beam 2. After step 1 two are finished: '' (log .5 / 1 = -0.693) and 'a'
    (log .25 / (7/6) = -1.188), but live 'aa' (log .25) could still reach log .25 / lp(11) = -0.52:
    the search goes on and 'aa' (log .25 / (8/6) = -1.040) replaces 'a'. Stopping at k finished would miss it.
    """
    model = FakeModel(late_winner_table)
    [hyps] = beam_search(
        model, torch.tensor([[EOS]]), SearchSettings(beam_size=2, len_penalty=1.0, max_len_a=0, max_len_b=10), nbest=2
    )
    assert hyp_tuples(hyps) == [(), (A, A)]
    assert hyps[1].score == pytest.approx(math.log(0.25) / (8 / 6), abs=1e-5)
    assert model.decode_calls == 3  # then nothing live is left


def test_k_finished_stopping_ends_at_k_finished_hypotheses() -> None:
    """decode.stopping k_finished (fairseq's and CTranslate2's rule): the same table stops after step 1 with the
    two finished there, and the late winner 'aa' is never found."""
    model = FakeModel(late_winner_table)
    [hyps] = beam_search(
        model,
        torch.tensor([[EOS]]),
        SearchSettings(beam_size=2, len_penalty=1.0, max_len_a=0, max_len_b=10, stopping="k_finished"),
        nbest=2,
    )
    assert hyp_tuples(hyps) == [(), (A,)]
    assert hyps[1].score == pytest.approx(math.log(0.25) / (7 / 6), abs=1e-5)
    assert model.decode_calls == 2


def test_early_stop_bound_uses_max_length_penalty() -> None:
    """With alpha 0 the bound is the live log-probability itself: the search stops at the first step where
    the best live hypothesis falls below the worst of k finished ones, long before the maximum length."""

    def table(s: int, prefix: tuple[int, ...]) -> list[float]:
        return probs(eos=0.7, a=0.2, b=0.1)

    model = FakeModel(table)
    [hyps] = beam_search(
        model, torch.tensor([[EOS]]), SearchSettings(beam_size=2, len_penalty=0.0, max_len_a=0, max_len_b=40), nbest=2
    )
    # step 0: EOS .7 finished, live a .2, b .1; step 1: a.EOS .14 finished (2 now, worst .14); live aa .04 < .14: done.
    assert hyp_tuples(hyps) == [(), (A,)]
    assert model.decode_calls == 2


# --- maximum length ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beam", [1, 3])
def test_max_length_forces_eos(beam: int) -> None:
    src = fake_src([0, 1, 2], src_len=3)
    src[2, 2:] = torch.tensor([EOS, PAD])  # third sentence: src_len 2
    model = FakeModel(never_ending)
    out = beam_search(
        model, src, SearchSettings(beam_size=beam, len_penalty=0.6, max_len_a=1.0, max_len_b=2), nbest=beam
    )
    for hyps, expected in zip(out, [5, 5, 4], strict=True):
        assert len(hyps) == beam
        assert all(len(h.tokens) == expected for h in hyps)
        assert all(EOS not in h.tokens for h in hyps)
    best = out[0][0]
    assert best.tokens == [A] * 5
    assert best.log_prob == pytest.approx(5 * math.log(0.6) + math.log(1e-6), rel=1e-5)
    assert best.score == pytest.approx(best.log_prob / ((5 + 6) / 6) ** 0.6, rel=1e-5)


def test_max_positions_caps_length() -> None:
    [hyps] = beam_search(
        FakeModel(never_ending), fake_src([0], 3), SearchSettings(beam_size=2, max_len_b=50, max_positions=8)
    )
    assert len(hyps[0].tokens) == 7  # BOS + 7 tokens = 8 decoder positions


# --- against exhaustive search and against a plain reference beam ----------------------------------------------------


@pytest.mark.parametrize("form,alpha", [("gnmt", 0.6), ("gnmt", 0.0), ("fairseq", 1.0), ("gnmt", 2.0)])
def test_wide_beam_equals_exhaustive_search(form: str, alpha: float) -> None:
    """Beam 12 over words {a, b} with max length 3 keeps every prefix (at most 12 candidates per step), so its
    12-best list must be the exhaustive 12 best of all 15 hypotheses, early stopping included."""
    tables = [random_table(seed) for seed in range(3)]
    model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
    src = fake_src([0, 1, 2], src_len=3)
    out = beam_search(
        model,
        src,
        SearchSettings(beam_size=12, len_penalty=alpha, len_penalty_form=form, max_len_a=0, max_len_b=3),
        nbest=12,
    )
    for s, hyps in enumerate(out):
        expected = exhaustive(tables[s], s, 3, alpha, form)[:12]
        assert hyp_tuples(hyps) == [w for _, w in expected]
        assert [h.score for h in hyps] == pytest.approx([sc for sc, _ in expected], abs=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_batched_beam_matches_reference_beam(k: int) -> None:
    """Eight sentences of different lengths in one batch (they finish at different steps and leave the batch)
    against the plain one-sentence reference, with UNK as a third word so the beam has to prune."""
    tables = [random_table(100 + i, unk=True, eos_bias=0.3 * (i % 3)) for i in range(8)]
    model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
    src_lens = [1, 4, 2, 6, 3, 1, 5, 2]
    src = torch.full((8, 7), PAD)
    for i, n in enumerate(src_lens):
        src[i, : n + 1] = torch.tensor([i + 10] + [7] * (n - 1) + [EOS])
    out = beam_search(model, src, SearchSettings(beam_size=k, len_penalty=0.6, max_len_a=1.0, max_len_b=1), nbest=k)
    for i, hyps in enumerate(out):
        expected = reference_beam(tables[i], i, k, 0.6, src_lens[i] + 1)
        assert hyp_tuples(hyps) == [tuple(h.tokens) for h in expected]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in expected], abs=1e-5)
        assert [h.log_prob for h in hyps] == pytest.approx([h.log_prob for h in expected], abs=1e-5)


def test_cached_equals_uncached_on_fake() -> None:
    tables = [random_table(7 + i, unk=True) for i in range(4)]
    src = fake_src([0, 1, 2, 3], src_len=4)
    runs = []
    for use_cache in (True, False):
        model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
        runs.append(beam_search(model, src, SearchSettings(beam_size=3, max_len_b=2), nbest=3, use_cache=use_cache))
    assert runs[0] == runs[1]


def test_nbest_is_prefix_of_wider_nbest_and_validates() -> None:
    src = fake_src([0, 1], src_len=2)
    table = random_table(3, unk=True)
    one = beam_search(FakeModel(table), src, SearchSettings(beam_size=4, max_len_b=3), nbest=1)
    four = beam_search(FakeModel(table), src, SearchSettings(beam_size=4, max_len_b=3), nbest=4)
    assert [h[0] for h in one] == [h[0] for h in four]
    assert all(len(h) == 4 for h in four)
    assert all(h[i].score >= h[i + 1].score for h in four for i in range(3))
    with pytest.raises(ValueError, match="nbest"):
        beam_search(FakeModel(table), src, SearchSettings(beam_size=2), nbest=3)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(FakeModel(table), src, SearchSettings(beam_size=0))


# --- a real tiny Transformer -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    return tiny_transformer(6.0, eos_scale=0.5)  # sharper distributions than at init, so hypotheses differ and end


def test_real_cached_equals_uncached(tiny_model: Transformer) -> None:
    src = real_src([5, 9, 3, 7])
    cached = beam_search(tiny_model, src, SearchSettings(beam_size=4, max_len_a=1.0, max_len_b=6), nbest=4)
    plain = beam_search(
        tiny_model, src, SearchSettings(beam_size=4, max_len_a=1.0, max_len_b=6), nbest=4, use_cache=False
    )
    for c, p in zip(cached, plain, strict=True):
        assert hyp_tuples(c) == hyp_tuples(p)
        assert [h.score for h in c] == pytest.approx([h.score for h in p], abs=1e-4)


def test_the_cache_grows_past_its_first_capacity_exactly(tiny_model: Transformer) -> None:
    """The cache starts at MIN_CAPACITY positions and doubles: hypotheses longer than that decode as uncached."""
    from transformer_mt.model.cache import MIN_CAPACITY

    src = real_src([5, 9, 3, 7], seed=2)
    cached = beam_search(tiny_model, src, SearchSettings(beam_size=3, max_len_a=0.0, max_len_b=40), nbest=3)
    plain = beam_search(
        tiny_model, src, SearchSettings(beam_size=3, max_len_a=0.0, max_len_b=40), nbest=3, use_cache=False
    )
    assert max(len(h.tokens) for hyps in cached for h in hyps) > 2 * MIN_CAPACITY  # grown twice
    for c, p in zip(cached, plain, strict=True):
        assert hyp_tuples(c) == hyp_tuples(p)
        assert [h.score for h in c] == pytest.approx([h.score for h in p], abs=1e-4)


def test_real_batched_equals_one_at_a_time(tiny_model: Transformer) -> None:
    lengths = [5, 9, 3, 1, 12]
    src = real_src(lengths, seed=1)
    batched = beam_search(tiny_model, src, SearchSettings(beam_size=4, max_len_b=5), nbest=2)
    for i, n in enumerate(lengths):
        alone = beam_search(tiny_model, src[i : i + 1, : n + 1], SearchSettings(beam_size=4, max_len_b=5), nbest=2)[0]
        assert hyp_tuples(batched[i]) == hyp_tuples(alone)
        assert [h.score for h in batched[i]] == pytest.approx([h.score for h in alone], abs=1e-4)
    assert len({len(h[0].tokens) for h in batched}) > 1  # sentences did end at different steps


def model_table(model: Transformer, src: torch.Tensor) -> Table:
    """Next-token probabilities of one unpadded sentence after a prefix, by a full forward pass of the prefix."""
    enc = model.encode(src)

    def table(s: int, prefix: tuple[int, ...]) -> list[float]:
        with torch.no_grad():
            logits = model.decode(torch.tensor([[BOS, *prefix]]), enc)[0, -1]
        return torch.softmax(logits.double(), dim=-1).tolist()

    return table


@pytest.mark.parametrize("k", [1, 4])
def test_real_batched_cached_beam_equals_plain_reference(tiny_model: Transformer, k: int) -> None:
    """The batched search over the beam-grouped cache (shared cross-attention state, reorders by ancestry) against
    the plain one-sentence reference beam on full forward passes: same hypotheses, a padded batch of five."""
    lengths = [5, 9, 3, 1, 12]
    src = real_src(lengths, seed=4)
    out = beam_search(
        tiny_model, src, SearchSettings(beam_size=k, len_penalty=0.6, max_len_a=1.0, max_len_b=4), nbest=k
    )
    for i, n in enumerate(lengths):
        expected = reference_beam(model_table(tiny_model, src[i : i + 1, : n + 1]), i, k, 0.6, n + 4)
        assert hyp_tuples(out[i]) == [tuple(h.tokens) for h in expected]
        assert [h.score for h in out[i]] == pytest.approx([h.score for h in expected], abs=1e-4)
    assert len({len(h[0].tokens) for h in out}) > 1  # sentences ended at different steps and left the batch


def greedy_loop(model: Transformer, src: torch.Tensor, max_len: int) -> list[int]:
    """Argmax of the full-prefix decoder each step (PAD/BOS never), stop at EOS or force it at max_len."""
    enc = model.encode(src)
    tokens = [BOS]
    with torch.no_grad():
        for _ in range(max_len):
            logits = model.decode(torch.tensor([tokens]), enc)[0, -1]
            logits[[PAD, BOS]] = float("-inf")
            tok = int(logits.argmax())
            if tok == EOS:
                break
            tokens.append(tok)
    return tokens[1:]


def test_real_beam1_equals_greedy_loop(tiny_model: Transformer) -> None:
    lengths = [5, 9, 3, 2]
    src = real_src(lengths, seed=2)
    out = beam_search(tiny_model, src, SearchSettings(beam_size=1, max_len_a=1.0, max_len_b=3))
    for i, n in enumerate(lengths):
        assert out[i][0].tokens == greedy_loop(tiny_model, src[i : i + 1, : n + 1], n + 3)


@pytest.mark.parametrize(
    ("generated", "n", "banned"),
    [
        ([5, 6, 5], 2, {6}),  # "5 6" seen, the row ends in 5: 6 would repeat it
        ([7, 7], 2, {7}),  # "7 7" would come again
        ([1, 2, 1, 3, 1], 2, {2, 3}),  # 1 was followed by 2 and by 3; 1 itself closes no repeated bigram
        ([4, 9, 2, 9, 4], 2, {9}),  # 9 closes the repeated "4 9" and the unrepeated "2 9": banned all the same
        ([1, 2, 3, 1, 2], 3, {3}),
        ([1, 2, 3, 1, 4], 3, set()),
        ([1, 2], 3, set()),  # no complete trigram yet
        ([3, 8], 1, {3, 8}),  # unigrams: no token twice
    ],
)
def test_blocked_tokens_are_those_that_would_repeat_an_ngram(generated: list[int], n: int, banned: set[int]) -> None:
    lprobs = torch.log_softmax(torch.randn(2, 12), dim=-1)
    rows = torch.tensor([generated, generated[::-1]])
    out = block_repeated_ngrams(lprobs.clone(), rows, n)  # in place: compare with the untouched original
    assert {int(i) for i in torch.nonzero(out[0] == float("-inf")).flatten()} == banned
    assert torch.equal(out[0][out[0] > float("-inf")], lprobs[0][out[0] > float("-inf")])  # the rest unchanged


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_hypothesis_repeats_an_ngram_when_blocked(tiny_model: Transformer, n: int) -> None:
    """The tiny random model loops; with decode.no_repeat_ngram = n no hypothesis holds an n-gram twice."""
    src = real_src([5, 9, 3, 7, 12], seed=2)
    plain = beam_search(tiny_model, src, SearchSettings(beam_size=4, max_len_a=2.0, max_len_b=10), nbest=4)
    assert any(len(set(_ngrams(h.tokens, n))) < len(_ngrams(h.tokens, n)) for hyps in plain for h in hyps)
    blocked = beam_search(
        tiny_model, src, SearchSettings(beam_size=4, max_len_a=2.0, max_len_b=10, no_repeat_ngram=n), nbest=4
    )
    for hyps in blocked:
        assert hyps and all(len(set(_ngrams(h.tokens, n))) == len(_ngrams(h.tokens, n)) for h in hyps)
    assert beam_search(tiny_model, src, SearchSettings(beam_size=4, max_len_b=10, no_repeat_ngram=0)) == beam_search(
        tiny_model, src, SearchSettings(beam_size=4, max_len_b=10)
    )  # 0 is off


def test_unk_is_a_possible_token() -> None:
    """Only PAD and BOS are excluded from generation; UNK is an ordinary token."""

    def table(s: int, prefix: tuple[int, ...]) -> list[float]:
        return probs(unk=0.9, eos=0.1) if not prefix else probs(eos=1.0)

    [hyps] = beam_search(FakeModel(table), torch.tensor([[EOS]]), SearchSettings(beam_size=1))
    assert hyps[0].tokens == [UNK]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_equals_cpu(tiny_model: Transformer) -> None:
    src = real_src([5, 9, 3, 7], seed=3)
    cpu = beam_search(tiny_model, src, SearchSettings(beam_size=4, max_len_b=6), nbest=2)
    gpu_model = Transformer(tiny_model.cfg, vocab_size=24).cuda().eval()
    gpu_model.load_state_dict(tiny_model.state_dict())
    gpu = beam_search(gpu_model, src.cuda(), SearchSettings(beam_size=4, max_len_b=6), nbest=2)
    for c, g in zip(cpu, gpu, strict=True):
        assert hyp_tuples(c) == hyp_tuples(g)
        assert [h.score for h in c] == pytest.approx([h.score for h in g], abs=1e-3)


@pytest.mark.parametrize("width", [8000, 8003, 600])
def test_row_topk_equals_topk(width: int) -> None:
    """Chunk maxima pick the chunks to sort; the result is topk's, for whole chunks, a tail and narrow rows."""
    g = torch.Generator().manual_seed(width)
    x = torch.log_softmax(3 * torch.randn(50, width, generator=g), dim=1)
    x[:, 5] = 0.5  # one column above every other value (the first chunk)
    x[7, width - 1] = 1.0  # the best value of a row in the tail past the last whole chunk
    for m in (1, 2, 8):
        values, indices = row_topk(x, m)
        expected = x.topk(m, dim=1)
        assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_row_topk_of_rows_that_may_only_end() -> None:
    """A row with -inf everywhere but EOS (the maximum length) gives EOS first, then -inf."""
    x = torch.full((3, 8000), float("-inf"))
    x[:, EOS] = -0.7
    values, indices = row_topk(x, 8)
    assert indices[:, 0].tolist() == [EOS] * 3 and values[:, 0].tolist() == pytest.approx([-0.7] * 3)
    assert torch.isinf(values[:, 1:]).all()


@torch.no_grad()
def test_best_extensions_in_slices_equal_the_whole_step(tiny_model: Transformer, monkeypatch) -> None:
    """Projected 4 rows at a time, with a prefix, the n-gram block and rows at their maximum length, a step's
    best tokens equal those of the whole (R, V) log-probabilities with the same rules."""
    g = torch.Generator().manual_seed(5)
    features = torch.randn(11, tiny_model.cfg.d_model, generator=g)
    generated = torch.randint(4, 24, (11, 6), generator=g)
    generated[3, 4:] = generated[3, :2]  # row 3 ends in a repeated bigram's start: its next token is banned
    at_max = torch.zeros(11, dtype=torch.bool)
    at_max[[2, 9]] = True
    prefixes = Prefixes.of([[], [7, 8, 9, 10, 11, 12, 13]], torch.device("cpu"))
    sentence = torch.tensor([0] * 5 + [1] * 6)
    rules = StepRules(generated, at_max, sentence, 3, prefixes, step=6)
    whole = rules(step_log_probs(tiny_model.logits(features)), slice(None))
    expected = row_topk(whole, 8)
    monkeypatch.setattr(search, "PROJECTED_ROWS", 4)
    values, tokens = best_extensions(tiny_model, features, 8, rules)
    assert torch.equal(tokens, expected[1])
    assert torch.equal(values.isinf(), expected[0].isinf())  # fp32 products of 3 rows may round otherwise
    assert torch.allclose(values.nan_to_num(neginf=0), expected[0].nan_to_num(neginf=0), atol=1e-5)
    assert tokens[2, 0] == EOS and tokens[7, 0] == 13 and torch.isinf(values[7, 1:]).all()  # at max; a prefix
    assert best_extensions(tiny_model, features, 100)[0].shape == (11, 24)  # m capped at the vocabulary


def test_beam_search_is_the_same_projected_in_slices(tiny_model: Transformer, monkeypatch) -> None:
    """Translations and scores do not depend on how many rows of logits a step projects at a time."""
    src = real_src([5, 9, 3, 7, 12, 2, 8], seed=6)
    settings, prefixes = SearchSettings(beam_size=4, max_len_b=8, no_repeat_ngram=2), [[], [5], [], [], [6, 7], [], []]
    whole = beam_search(tiny_model, src, settings, nbest=4, prefixes=prefixes)
    monkeypatch.setattr(search, "PROJECTED_ROWS", 3)
    sliced = beam_search(tiny_model, src, settings, nbest=4, prefixes=prefixes)
    for a, b in zip(sliced, whole, strict=True):
        assert hyp_tuples(a) == hyp_tuples(b)
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_kept_sentences_move_only_into_the_places_of_done_ones() -> None:
    """The active sentences behind the first n' fill the done places in front; the others stay where they are."""
    done = torch.tensor([True, False, False, True, False, False, True, False])
    keep = kept_sentences(done)
    assert keep.tolist() == [5, 1, 2, 7, 4]
    assert sorted(keep.tolist()) == (~done).nonzero().squeeze(1).tolist()
    assert kept_sentences(torch.tensor([False, False])).tolist() == [0, 1]
    assert kept_sentences(torch.tensor([True, True])).tolist() == []
