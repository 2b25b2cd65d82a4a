"""The continuous search: sentences that join while it runs get `beam_search`'s hypotheses for them alone.

A real tiny Transformer (sharp enough that hypotheses differ and end at
different steps); sentences join at chosen steps, with sources longer and
shorter than those already in the search, so that every per-sentence count
(positions, maximum length, length penalty, n-gram history) and the cache's
join, reorder and compaction are exercised against the search of each
sentence alone.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_transformer

from transformer_mt.data.bpe import EOS
from transformer_mt.decode.continuous import ContinuousSearch
from transformer_mt.decode.search import Hypothesis, beam_search, pad_batch
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_transformer(6.0, eos_scale=0.5)


def sources(count: int, seed: int, longest: int = 14) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=g).tolist()
    return [torch.randint(4, 24, (n,), generator=g).tolist() + [EOS] for n in lengths]


def run(search: ContinuousSearch, arrivals: dict[int, list[int]], srcs: list[list[int]]) -> dict[int, list[Hypothesis]]:
    """Step the search; before step s, the sentences ``arrivals[s]`` join. Returns each sentence's hypotheses."""
    out: dict[int, list[Hypothesis]] = {}
    step = 0
    while step <= max(arrivals) or search.active:
        joining = arrivals.get(step, [])
        search.add([srcs[i] for i in joining], joining)
        for key, hyps in search.step():
            assert key not in out
            out[key] = hyps
        step += 1
    return out


def assert_alone(
    model: Transformer, out: dict[int, list[Hypothesis]], srcs: list[list[int]], tolerance: float = 1e-4, **settings
) -> None:
    for i, src in enumerate(srcs):
        alone = beam_search(model, pad_batch([src]), SearchSettings(**settings), nbest=settings["beam_size"])[0]
        assert [h.tokens for h in out[i]] == [h.tokens for h in alone], f"sentence {i}"
        assert [h.score for h in out[i]] == pytest.approx([h.score for h in alone], abs=tolerance)


SETTINGS = [
    dict(beam_size=4),
    dict(beam_size=1),
    dict(beam_size=3, no_repeat_ngram=2, len_penalty=1.0, len_penalty_form="fairseq"),
    dict(beam_size=4, stopping="k_finished", max_len_a=0.5, max_len_b=3),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["beam4", "greedy", "ngram-fairseq", "k_finished-short"])
@pytest.mark.slow
def test_sentences_joining_a_running_search_get_their_search_alone(model: Transformer, settings: dict) -> None:
    srcs = sources(12, seed=1)
    arrivals = {0: [0, 1], 1: [2], 3: [3, 4, 5], 4: [6], 9: [7], 10: [8, 9], 17: [10], 30: [11]}
    search = ContinuousSearch(model, SearchSettings(max_positions=64, **settings))
    out = run(search, arrivals, srcs)
    assert sorted(out) == list(range(len(srcs))) and search.active == 0 and search.beams is None
    assert_alone(model, out, srcs, max_positions=64, **settings)
    assert len({len(hyps[0].tokens) for hyps in out.values()}) > 1  # they ended at different steps


def test_an_int8_model_searches_continuously_as_alone(model: Transformer) -> None:
    """`tmt serve --quantize int8`: the quantized layers take the running search's rows like any batch's. The
    same hypotheses; scores only to 0.05, as int8 scores move that much between two batches of `beam_search`
    itself (a last-bit difference in attention that crosses a quantization step: 0.016 here, alone against
    the eight sentences in one batch)."""
    import copy

    from transformer_mt.model.quantize import quantize_int8

    quantized = quantize_int8(copy.deepcopy(model))
    srcs = sources(8, seed=6)
    out = run(
        ContinuousSearch(quantized, SearchSettings(beam_size=4, max_positions=64)),
        {0: [0, 1, 2], 2: [3], 5: [4, 5, 6, 7]},
        srcs,
    )
    assert_alone(quantized, out, srcs, tolerance=0.05, beam_size=4, max_positions=64)


def test_a_search_that_sentences_keep_joining_keeps_its_buffers_short(model: Transformer) -> None:
    """Two hundred sentences, two joining every other step: the search never empties, and its self-attention
    buffers stay near its longest sentence's length (the positions before every sentence's start are
    dropped when they fill) instead of the hundreds of steps it runs."""
    srcs = sources(200, seed=2)
    arrivals = {2 * i: [2 * i, 2 * i + 1] for i in range(100)}
    search = ContinuousSearch(model, SearchSettings(beam_size=2, max_len_a=0.0, max_len_b=12, max_positions=64))
    longest, steps, out = 0, 0, {}
    for step in range(400):
        joining = arrivals.get(step, [])
        search.add([srcs[i] for i in joining], joining)
        out.update(search.step())
        if search.beams is not None:
            longest = max(longest, search.beams.cache.layers[0].self_k.shape[2])
        steps += 1
        if step > 200 and not search.active:
            break
    assert steps > 200 and sorted(out) == list(range(200))
    assert longest <= 64  # BOS + 12 tokens per sentence; without compaction ~200 positions
    picked = range(0, 200, 17)
    checked = {j: out[i] for j, i in enumerate(picked)}
    assert_alone(model, checked, [srcs[i] for i in picked], beam_size=2, max_len_a=0.0, max_len_b=12)


def test_add_checks_its_keys(model: Transformer) -> None:
    search = ContinuousSearch(model, SearchSettings())
    with pytest.raises(ValueError, match="2 sources and 1 keys"):
        search.add(sources(2, seed=3), ["a"])
    search.add([], [])
    assert search.active == 0 and search.step() == []


def test_sentences_join_in_the_rows_that_others_left(model: Transformer) -> None:
    """A join writes into the buffer rows that finished sentences let go (no new buffer), zeroes the positions
    before its start, and widens the cross-attention state for a longer source, masking the others' padding."""
    short, long = sources(6, seed=5, longest=6), [list(range(4, 20)) + [EOS]]
    search = ContinuousSearch(model, SearchSettings(beam_size=2, max_len_a=1.0, max_len_b=8, max_positions=64))
    search.add(short, range(6))
    while search.active == 6:
        search.step()
    assert search.beams is not None, "some sentences are still in the search"
    cache = search.beams.cache
    left = 6 - search.active
    before = cache.layers[0].self_k.data_ptr()
    search.add(short[:left], range(6, 6 + left))
    assert cache.layers[0].self_k.data_ptr() == before  # the same memory
    assert not cache.layers[0].self_k[-left:, :, : cache.length].any()  # zeros before the new sentences' start
    width = cache.layers[0].cross_k.shape[2]
    search.add(long, [99])
    assert cache.layers[0].cross_k.shape[2] == len(long[0]) > width
    assert torch.isinf(cache.cross_mask[:-1, 0, 0, width:]).all() and not cache.cross_mask[-1].any()
    out = run(search, {0: []}, [])
    assert search.active == 0 and 99 in out


def test_positions_per_row_are_the_rows_of_the_table() -> None:
    from transformer_mt.model.positions import PositionError, take

    table = torch.arange(20.0).view(10, 2)
    assert torch.equal(take(table, 3, torch.tensor([0, 5])), torch.stack([table[0:3], table[5:8]]))
    assert torch.equal(take(table, 2, 4), table[4:6])
    with pytest.raises(PositionError, match="needs 11 positions"):
        take(table, 3, torch.tensor([0, 8]))
