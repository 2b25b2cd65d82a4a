"""Ensembles: a step is the mean of the models' log-probabilities; the search over it, exactly.

The fake decoders of test_decode_search check that every model's own cache
and encoder output follow the search's reorders and dropped sentences; the
real tiny Transformers check the step against full forward passes.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import B_, A, FakeModel, Table, hyp_tuples, random_table, real_src, reference_beam

from transformer_mt.config import ModelConfig
from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int, d_ff: int = 64) -> Transformer:
    """A random tiny model with peaky distributions (hypotheses differ and end); models may differ in shape."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, d_ff=d_ff, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
    model = Transformer(cfg, vocab_size=24).eval()
    with torch.no_grad():
        model.embed.weight.mul_(6.0)
        model.embed.weight[EOS].mul_(0.5)
    return model


@pytest.mark.parametrize("use_cache", [True, False])
def test_an_ensemble_of_a_model_with_itself_is_the_model(use_cache: bool) -> None:
    model = tiny(0)
    src = real_src([5, 9, 3, 1, 7], seed=5)
    settings = SearchSettings(beam_size=4, max_len_a=1.0, max_len_b=5)
    alone = beam_search(model, src, settings, nbest=4, use_cache=use_cache)
    for members in ([model], [model, model], [model, model, model]):
        together = beam_search(Ensemble(members), src, settings, nbest=4, use_cache=use_cache)
        for a, t in zip(alone, together, strict=True):
            assert hyp_tuples(t) == hyp_tuples(a)
            assert [h.score for h in t] == pytest.approx([h.score for h in a], abs=1e-5)
            assert [h.log_prob for h in t] == pytest.approx([h.log_prob for h in a], abs=1e-5)
    assert len({len(h[0].tokens) for h in alone}) > 1  # sentences ended at different steps and left the batch


def test_a_two_model_step_is_the_mean_of_their_log_probabilities() -> None:
    """Step by step through each model's own cache, against full-prefix forward passes of each model alone."""
    models = [tiny(1), tiny(2, d_ff=48)]  # two shapes: only the vocabulary is shared
    ensemble = Ensemble(models)
    src = real_src([6, 3], seed=6)
    prefix = torch.tensor([[BOS, 7, 9, 11], [BOS, 5, 5, 8]])
    enc = ensemble.encode(src)
    cache = ensemble.init_cache(enc, beams=1, capacity=8)
    with torch.no_grad():
        for t in range(prefix.shape[1]):
            step = ensemble.decode(prefix[:, t : t + 1], enc, cache)[:, -1]  # (B, V)
            each = [torch.log_softmax(m.decode(prefix[:, : t + 1], m.encode(src))[:, -1], dim=-1) for m in models]
            assert torch.allclose(step, (each[0] + each[1]) / 2, atol=1e-5)
            assert not torch.allclose(each[0], each[1], atol=1e-2)  # the models really disagree


def test_the_uncached_step_is_the_mean_too() -> None:
    models = [tiny(3), tiny(4)]
    src = real_src([4, 8], seed=7)
    tgt_in = torch.tensor([[BOS, 6, 7], [BOS, 9, 10]])
    ensemble = Ensemble(models)
    with torch.no_grad():
        out = ensemble.decode(tgt_in, ensemble.encode(src))  # (B, T, V): every position
        each = [torch.log_softmax(m.decode(tgt_in, m.encode(src)), dim=-1) for m in models]
    assert out.shape == (2, 3, 24)
    assert torch.allclose(out, (each[0] + each[1]) / 2, atol=1e-5)


def mean_table(tables: list[Table]) -> Table:
    """exp of the mean of the tables' log-probabilities, as the search ranks them (it renormalizes each row)."""

    def table(s: int, prefix: tuple[int, ...]) -> list[float]:
        rows = [t(s, prefix) for t in tables]
        rows = [[p / sum(row) for p in row] for row in rows]
        return [math.exp(sum(math.log(r[i]) for r in rows) / len(rows)) if all(r[i] for r in rows) else 0.0
                for i in range(len(rows[0]))]  # fmt: skip

    return table


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_search_over_an_ensemble_is_the_search_over_its_mean(k: int) -> None:
    """Six sentences of two fake models: each model's cache is reordered and shrunk with the beams (FakeCache
    refuses a beam that leaves its sentence, FakeModel a cache and encoder output of different sentences)."""
    per_model = [[random_table(200 + 10 * m + i, unk=True, eos_bias=0.2 * (i % 3)) for i in range(6)] for m in range(2)]
    models = [FakeModel(lambda s, prefix, t=tables: t[s - 10](s - 10, prefix)) for tables in per_model]
    src_lens = [1, 4, 2, 5, 3, 1]
    src = torch.full((6, 6), PAD)
    for i, n in enumerate(src_lens):
        src[i, : n + 1] = torch.tensor([i + 10] + [7] * (n - 1) + [EOS])
    out = beam_search(
        Ensemble(models), src, SearchSettings(beam_size=k, len_penalty=0.6, max_len_a=1.0, max_len_b=1), nbest=k
    )
    for i, hyps in enumerate(out):
        expected = reference_beam(mean_table([per_model[0][i], per_model[1][i]]), i, k, 0.6, src_lens[i] + 1)
        assert hyp_tuples(hyps) == [tuple(h.tokens) for h in expected]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in expected], abs=1e-5)
    assert all(m.decode_calls > 0 for m in models)


def test_a_token_one_model_rules_out_is_ruled_out() -> None:
    """A zero-probability token of either model has -inf in the mean: the ensemble never emits it."""
    only_a = FakeModel(lambda s, prefix: [0.0, 0.0, 0.0, 0.5, 0.5, 0.0] if not prefix else [0, 0, 0, 1.0, 0, 0])
    mostly_b = FakeModel(lambda s, prefix: [0.0, 0.0, 0.0, 0.1, 0.1, 0.8] if not prefix else [0, 0, 0, 1.0, 0, 0])
    [hyps] = beam_search(Ensemble([only_a, mostly_b]), torch.tensor([[10, EOS]]), SearchSettings(beam_size=2), nbest=2)
    assert sorted(hyp_tuples(hyps)) == [(), (A,)] and all(B_ not in h.tokens for h in hyps)


def test_an_ensemble_needs_a_model() -> None:
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])
