"""Sampling (`tmt translate --sample`): which tokens a draw may take, its distribution, and reproducibility.

The draw is checked against its definition on hand-set probabilities (the
fake decoder of test_decode_search); reproducibility on a real random-weight
model, where a sentence's sample must not depend on the other sentences of
its batch or its file.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import B_, A, FakeModel, fake_src, probs, real_src, tiny_transformer
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config, ConfigError, Sampling, load_config, parse_sampling
from transformer_mt.data.bpe import BOS, EOS, PAD, UNK
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.load import override_config
from transformer_mt.decode.sample import draw, sample_search, sample_seed
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.decode.translate import Translator
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

FIRST = probs(eos=0.5, a=0.3, b=0.15, unk=0.05)  # the first step's distribution of the fake decoder


def first_tokens(sampling: Sampling, temperature: float = 1.0, seeds: int = 300) -> Counter:
    """The first token of one sample under each of ``seeds`` seeds (a model that ends after one token)."""
    model = FakeModel(lambda s, prefix: FIRST if not prefix else probs(eos=1.0))
    counts: Counter = Counter()
    for seed in range(seeds):
        (hyps,) = sample_search(
            model, fake_src([0], 3), [[7]], SearchSettings(sampling=sampling, temperature=temperature, seed=seed)
        )
        counts[hyps[0].tokens[0] if hyps[0].tokens else EOS] += 1
    return counts


def grid_draw(lprobs: list[float], sampling: Sampling, temperature: float = 1.0, n: int = 1000) -> list[float]:
    """The share of each token over ``n`` evenly spaced uniforms: the draw's distribution, to within 1/n."""
    row = torch.tensor([lprobs], dtype=torch.float32).expand(n, -1)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = draw(row.clone(), u, sampling, temperature)
    return (torch.bincount(tokens, minlength=len(lprobs)).double() / n).tolist()


# --- the draw, against its definition --------------------------------------------------------------------------------


def test_topk_draws_only_the_k_most_probable_tokens_in_proportion() -> None:
    lp = [math.log(p) if p > 0 else -math.inf for p in [0.0, 0.05, 0.0, 0.5, 0.3, 0.15]]
    share = grid_draw(lp, Sampling("topk", 2))
    assert share == pytest.approx([0, 0, 0, 0.5 / 0.8, 0.3 / 0.8, 0], abs=1e-3)
    assert grid_draw(lp, Sampling("topk", 1)) == [0, 0, 0, 1.0, 0, 0]  # top-1 is greedy
    assert grid_draw(lp, Sampling("topk", 50)) == pytest.approx([0, 0.05, 0, 0.5, 0.3, 0.15], abs=1e-3)


def test_topp_keeps_the_fewest_tokens_that_reach_p() -> None:
    lp = [math.log(p) if p > 0 else -math.inf for p in [0.0, 0.05, 0.0, 0.5, 0.3, 0.15]]
    assert grid_draw(lp, Sampling("topp", 0.8)) == pytest.approx([0, 0, 0, 0.5 / 0.8, 0.3 / 0.8, 0], abs=1e-3)
    assert grid_draw(lp, Sampling("topp", 0.81)) == pytest.approx(
        [0, 0, 0, 0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], abs=2e-3
    )
    assert grid_draw(lp, Sampling("topp", 0.4)) == [0, 0, 0, 1.0, 0, 0]  # the most probable token alone holds 0.5
    assert grid_draw(lp, Sampling("topp", 1.0)) == pytest.approx([0, 0.05, 0, 0.5, 0.3, 0.15], abs=1e-3)


def test_temperature_raises_probabilities_to_the_power_one_over_t() -> None:
    p = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    for t in (0.5, 2.0):
        expected = p ** (1 / t) / (p ** (1 / t)).sum()
        assert grid_draw(p.log().tolist(), Sampling("topk", 6), temperature=t) == pytest.approx(
            expected.tolist(), abs=2e-3
        )


def test_a_forced_row_always_draws_its_one_token() -> None:
    lp = [-math.inf] * 6
    lp[EOS] = -3.0  # as at the maximum length: only EOS is left
    assert grid_draw(lp, Sampling("topp", 0.9)) == [0, 0, 0, 1.0, 0, 0]


def test_sampling_on_a_decoder_never_draws_outside_topk_and_draws_both() -> None:
    counts = first_tokens(Sampling("topk", 2))
    assert set(counts) == {EOS, A}  # B_ (0.15) and UNK (0.05) are outside the 2 most probable
    assert 0.25 < counts[A] / 300 < 0.5  # 0.3 / 0.8 = 0.375
    assert set(first_tokens(Sampling("topp", 0.9), seeds=200)) == {EOS, A, B_}
    assert UNK not in first_tokens(Sampling("topp", 0.95), seeds=200)  # 0.5 + 0.3 + 0.15 = 0.95 reach it


def test_a_sample_ends_at_the_maximum_length_with_eos_forced() -> None:
    model = FakeModel(lambda s, prefix: probs(eos=0.01, a=0.99))
    (hyps,) = sample_search(
        model, fake_src([0], 4), [[1]], SearchSettings(sampling=Sampling("topk", 1), max_len_a=0.0, max_len_b=5)
    )
    assert hyps[0].tokens == [A] * 5
    assert hyps[0].log_prob == pytest.approx(5 * math.log(0.99) + math.log(0.01), rel=1e-5)  # the model's, EOS forced
    assert hyps[0].score == pytest.approx(hyps[0].log_prob / ((5 + 6) / 6) ** 0.6, rel=1e-6)


def test_pad_and_bos_are_never_drawn() -> None:
    model = FakeModel(lambda s, prefix: [0.4, 0.0, 0.4, 0.1, 0.1, 0.0] if not prefix else probs(eos=1.0))
    for seed in range(50):
        (hyps,) = sample_search(
            model, fake_src([0], 3), [[seed]], SearchSettings(sampling=Sampling("topp", 1.0), seed=seed)
        )
        assert all(t not in (PAD, BOS) for t in hyps[0].tokens)


# --- reproducibility -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    return tiny_transformer(2.0)  # flat enough that samples vary


def ids_of(src: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != PAD] for row in src.tolist()]


def test_the_seed_is_a_hash_of_seed_source_and_sample() -> None:
    assert sample_seed(1, [5, 6, EOS], 0) == sample_seed(1, [5, 6, EOS], 0)
    assert len({sample_seed(1, [5, 6, EOS], 0), sample_seed(2, [5, 6, EOS], 0), sample_seed(1, [5, 7, EOS], 0),
                sample_seed(1, [5, 6, EOS], 1)}) == 4  # fmt: skip


def test_a_sentence_samples_alike_alone_and_in_any_batch(tiny_model: Transformer) -> None:
    src = real_src([3, 9, 5, 12, 7, 4], seed=3)
    sources = ids_of(src)
    s = Sampling("topp", 0.95)
    together = sample_search(tiny_model, src, sources, SearchSettings(sampling=s, seed=4, max_len_b=12), samples=2)
    settings = SearchSettings(sampling=s, seed=4, max_len_b=12)
    alone = [sample_search(tiny_model, src[i : i + 1, : len(x)], [x], settings, samples=2)[0]
             for i, x in enumerate(sources)]  # fmt: skip
    assert [[h.tokens for h in hyps] for hyps in together] == [[h.tokens for h in hyps] for hyps in alone]
    assert [h.log_prob for hyps in together for h in hyps] == pytest.approx(
        [h.log_prob for hyps in alone for h in hyps], rel=1e-4
    )
    reversed_ = sample_search(
        tiny_model, src.flip(0), sources[::-1], SearchSettings(sampling=s, seed=4, max_len_b=12), samples=2
    )[::-1]
    assert [[h.tokens for h in hyps] for hyps in reversed_] == [[h.tokens for h in hyps] for hyps in together]
    other_seed = sample_search(tiny_model, src, sources, SearchSettings(sampling=s, seed=5, max_len_b=12), samples=2)
    assert [[h.tokens for h in hyps] for hyps in other_seed] != [[h.tokens for h in hyps] for hyps in together]
    assert any(hyps[0].tokens != hyps[1].tokens for hyps in together)  # two samples are two draws


# --- through Translator and tmt translate ----------------------------------------------------------------------------


def sampler(ckpt: Path, *overrides: str, ensemble: int = 1) -> Translator:
    t = Translator.from_checkpoints([ckpt] * ensemble, device="cpu", overrides=list(overrides), ensemble=ensemble > 1)
    t.show_progress = False
    return t


LINES = ["the cat sees the dog .", "a small house", "", "the man who sleeps reads a long book today .", "dogs run"]


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_line_samples_alike_in_any_file(toy_ckpt: Path, quantize: str) -> None:
    t = sampler(toy_ckpt, "decode.sampling=topk:20", f"decode.quantize={quantize}", "decode.batch_tokens=12")
    first = t.translate_lines(LINES)
    assert first[2] == ""
    shuffled = [LINES[4], "something else entirely , longer than the rest of it", LINES[0], LINES[3], LINES[1]]
    again = t.translate_lines(shuffled)
    assert [again[2], again[4], again[3], again[0]] == [first[0], first[1], first[3], first[4]]
    assert [t.translate_lines([line])[0] for line in LINES] == first
    reseeded = sampler(toy_ckpt, "decode.sampling=topk:20", "decode.seed=2", f"decode.quantize={quantize}")
    assert reseeded.translate_lines(LINES) != first


def test_nbest_gives_k_samples_and_the_first_is_the_single_draw(toy_ckpt: Path) -> None:
    t = sampler(toy_ckpt, "decode.sampling=topp:0.9", "decode.sampling_temperature=1.5")
    assert t.cfg.decode.beam_size == 1  # --sample without --beam takes beam 1
    results = t.translate_lines_nbest(LINES, nbest=5)
    assert [len(r) for r in results] == [5] * len(LINES)
    assert [r[0].text for r in results] == t.translate_lines(LINES)
    assert len({h.text for h in results[3]}) > 1


def test_an_ensemble_of_a_model_with_itself_samples_as_the_model(toy_ckpt: Path) -> None:
    one = sampler(toy_ckpt, "decode.sampling=topk:10").translate_lines(LINES)
    assert isinstance(sampler(toy_ckpt, ensemble=2).model, Ensemble)
    assert sampler(toy_ckpt, "decode.sampling=topk:10", ensemble=2).translate_lines(LINES) == one


def test_without_sampling_the_seed_and_temperature_change_nothing(toy_ckpt: Path) -> None:
    beam = sampler(toy_ckpt).translate_lines_nbest(LINES, nbest=2)
    same = sampler(toy_ckpt, "decode.seed=9", "decode.sampling_temperature=3", "decode.sampling=none")
    assert same.translate_lines_nbest(LINES, nbest=2) == beam


# --- the settings ----------------------------------------------------------------------------------------------------


def test_parse_sampling() -> None:
    assert parse_sampling("none") is None
    assert parse_sampling("topk:10") == Sampling("topk", 10)
    assert parse_sampling("topp:0.9") == Sampling("topp", 0.9)
    assert parse_sampling("topp:1") == Sampling("topp", 1.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["decode.sampling=topk:0"], r"use topk:K \(K >= 1"),
        (["decode.sampling=topk:2.5"], r"use topk:K"),
        (["decode.sampling=topp:0"], r"topp:P \(0 < P <= 1"),
        (["decode.sampling=topp:1.2"], r"topp:P \(0 < P <= 1"),
        (["decode.sampling=random"], r"use topk:K .* or none"),
        (["decode.sampling=topk:5", "decode.beam_size=4"], r"takes no beam .* pass --beam 1"),
        (["decode.sampling_temperature=0"], r"--temperature .* must be above 0"),
        (["decode.sampling_temperature=-1"], r"--temperature .* must be above 0"),
        (["decode.seed=-1"], r"--seed \(decode.seed\) must be an integer from 0"),
    ],
)
def test_bad_sampling_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_sampling_sets_beam_1_unless_a_beam_is_given(prepared_toy: Config) -> None:
    assert override_config(prepared_toy, ["decode.sampling=topk:3"]).decode.beam_size == 1
    assert override_config(prepared_toy, ["decode.sampling=topk:3", "decode.nbest=6"]).decode.nbest == 6
    with pytest.raises(ConfigError, match="pass --beam 1"):
        override_config(prepared_toy, ["decode.sampling=topk:3", "decode.beam_size=2"])
    cfg = dataclasses.replace(prepared_toy, decode=dataclasses.replace(prepared_toy.decode, beam_size=4))
    assert override_config(cfg, ["decode.beam_size=1", "decode.sampling=topk:3"]).decode.beam_size == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sample", "topk:4", "--beam", "3"], "takes no beam"),
        (["--sample", "topp:2"], "0 < P <= 1"),
        (["--sample", "topk:4", "--temperature", "0"], "must be above 0"),
        (["--sample", "topk:0"], "K >= 1"),
    ],
)
def test_tmt_translate_refuses_bad_sampling_flags_in_one_line(toy_ckpt: Path, tmp_path: Path, flags, message) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a cat\n", encoding="utf-8")
    result = CliRunner().invoke(
        app, ["translate", "-c", str(toy_ckpt), "-i", str(src), "-o", str(tmp_path / "o"), *flags]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_tmt_translate_samples_reproducibly(toy_ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    args = ["translate", "-c", str(toy_ckpt), "-i", str(src), "--sample", "topk:20", "--seed", "3", "--nbest", "3"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    rows = first.stdout.splitlines()
    assert len(rows) == 3 * len(LINES) and rows[0].startswith("0\t")
    assert CliRunner().invoke(app, args).stdout == first.stdout


# --- CTranslate2 -----------------------------------------------------------------------------------------------------


def test_ctranslate2_samples_with_its_seed(toy_ckpt: Path, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    from transformer_mt.decode.translate import load_translator
    from transformer_mt.export import export_ctranslate2

    model_dir = export_ctranslate2([toy_ckpt], tmp_path / "ct2")

    def ct2(*overrides: str) -> Translator:
        t = load_translator([model_dir], "ctranslate2", device="cpu", overrides=list(overrides))
        t.show_progress = False
        return t

    greedy = ct2("decode.beam_size=1").translate_lines(LINES)
    assert ct2("decode.sampling=topk:1").translate_lines(LINES) == greedy  # top-1 sampling is greedy
    sampled = ct2("decode.sampling=topp:1.0", "decode.seed=3")
    results = sampled.translate_lines_nbest(LINES, nbest=4)
    assert [len(r) for r in results] == [4] * len(LINES)
    assert any(len({h.text for h in r}) > 1 for r in results)
    again = ct2("decode.sampling=topp:1.0", "decode.seed=3")  # seeded when it loads
    assert again.translate_lines_nbest(LINES, nbest=4) == results
