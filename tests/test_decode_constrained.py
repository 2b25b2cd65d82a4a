"""Lexically constrained beam search against its definition: fake decoders with hand-set probabilities, exhaustive
search over every output that holds the constraints, coverage on a real tiny Transformer, `tmt translate
--constraints` and its errors."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
import torch
from click.testing import Result
from helpers import (
    B_,
    A,
    FakeModel,
    Table,
    fake_src,
    hand_table,
    hyp_tuples,
    never_ending,
    random_table,
    tiny_transformer,
)
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.data.bpe import EOS, PAD
from transformer_mt.decode.constrained import (
    ConstraintError,
    ConstraintLengthError,
    ConstraintState,
    constrained_search,
    contains_constraints,
    phrase_table,
    split_constraints,
    word_continuations,
)
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.settings import SearchSettings, length_penalty
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def holds(tokens: tuple[int, ...] | list[int], constraints: list[list[int]]) -> bool:
    """The definition: every phrase occurs in ``tokens`` as contiguous tokens, each at places of its own."""
    spans = [[i for i in range(len(tokens) - len(p) + 1) if list(tokens[i : i + len(p)]) == p] for p in constraints]
    for starts in itertools.product(*spans):
        used = [s + j for s, p in zip(starts, constraints, strict=True) for j in range(len(p))]
        if len(used) == len(set(used)):
            return True
    return False


# --- the constraint state ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraints", "tokens", "met"),
    [
        ([[5, 6]], [5, 6], [True]),
        ([[5, 6]], [5, 7, 6], [False]),  # abandoned: 7 breaks the phrase
        ([[5, 6]], [5, 5, 6], [True]),  # the token that breaks a phrase may start it again
        ([[5, 6], [5, 7]], [5, 7], [False, True]),  # a shared first word: both stay candidates
        ([[5], [5]], [5, 9], [True, False]),  # equal phrases: one occurrence meets one of them
        ([[5], [5]], [5, 9, 5], [True, True]),
        ([[5, 6], [6]], [5, 6], [True, False]),  # 6 is taken by the phrase in progress
        ([[5, 6], [6]], [5, 6, 6], [True, True]),
        ([[8, 9, 8]], [8, 9, 8], [True]),
    ],
)
def test_progress_counts_each_phrase_once(constraints: list[list[int]], tokens: list[int], met: list[bool]) -> None:
    phrases = phrase_table([constraints])
    state = ConstraintState.start(phrases)
    for token in tokens:
        state = state.extend(phrases, torch.tensor([token]))
    assert state.met[0].tolist() == met
    assert contains_constraints(tokens, constraints) == all(met)


def test_progress_bank_counts_the_partial_phrase() -> None:
    phrases = phrase_table([[[5, 6, 7], [9]]])
    state = ConstraintState.start(phrases)
    banks = []
    for token in [9, 5, 6, 4, 5, 6, 7]:
        state = state.extend(phrases, torch.tensor([token]))
        banks.append(int(state.met_tokens(phrases)[0]))
    assert banks == [1, 2, 3, 1, 2, 3, 4]  # the partial "5 6" is lost at 4


# --- exact results on hand-set decoders ---------------------------------------------------------------------------


def test_beam2_hand_computed_constrained_hypothesis() -> None:
    """hand_table, alpha 0, beam 2, constraint "a b". Unconstrained the best is b (.32).

    step 0: a .6 (bank 1: the phrase begun), b .4 (bank 0); EOS is banned -> live a, b
    step 1: ab .06 (bank 2, all met), aa .30 (bank 1: the second a begins the phrase again), ba .04 (bank 1),
            bb .04 (bank 0): round-robin over banks 2, 1 -> live ab, aa
    step 2: ab.EOS .03 is given a place: finished. aa may not end (nothing after aa but EOS): its row dies.
    The best output that holds "a b" is "a b" (.03): the next best, "b a b", has .005.
    """
    model = FakeModel(hand_table)
    [hyps] = constrained_search(
        model, torch.tensor([[EOS]]), [[[A, B_]]], SearchSettings(beam_size=2, len_penalty=0.0, max_len_b=10)
    )
    assert hyp_tuples(hyps) == [(A, B_)]
    assert hyps[0].log_prob == pytest.approx(math.log(0.03), abs=1e-5)


def exhaustive_with(table: Table, s: int, max_len: int, alpha: float, constraints: list[list[int]]) -> list:
    """Every output of up to max_len words (a, b) then EOS that holds the constraints, scored, best first."""
    out = []
    for n in range(max_len + 1):
        for words in itertools.product([A, B_], repeat=n):
            if not holds(words, constraints):
                continue
            lp = sum(
                math.log(table(s, words[:t])[words[t] if t < n else EOS] / sum(table(s, words[:t])))
                for t in range(n + 1)
            )
            out.append((lp / length_penalty(float(n + 1), alpha), words))
    return sorted(out, key=lambda x: -x[0])


CONSTRAINT_SETS = [[[B_, A]], [[B_], [B_]], [[A], [B_]], [[A, B_], [B_]], [[A, A, A]], [[B_, B_], [A]]]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_equals_exhaustive_search_among_outputs_with_the_constraints(alpha: float) -> None:
    """Beam 16 over words {a, b} with max length 3 keeps every prefix (at most 12 candidates a step): its n-best
    list must be every output that holds the constraints, ranked by score, for six sentences in one batch."""
    tables = [random_table(40 + i) for i in range(len(CONSTRAINT_SETS))]
    model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
    src = fake_src(list(range(len(CONSTRAINT_SETS))), src_len=3)
    out = constrained_search(
        model, src, CONSTRAINT_SETS, SearchSettings(beam_size=16, len_penalty=alpha, max_len_a=0, max_len_b=3), nbest=16
    )
    for s, (hyps, constraints) in enumerate(zip(out, CONSTRAINT_SETS, strict=True)):
        expected = exhaustive_with(tables[s], s, 3, alpha, constraints)
        assert expected and hyp_tuples(hyps) == [w for _, w in expected]
        assert [h.score for h in hyps] == pytest.approx([sc for sc, _ in expected], abs=1e-5)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_constraints_are_placed_before_the_maximum_length(k: int) -> None:
    """A model that always prefers a (never EOS) would never place b; the length rule makes room for the phrases
    by the maximum length, 4 words, for every hypothesis."""
    src = fake_src([0, 1], src_len=2)
    sets = [[[B_, B_]], [[B_], [A, B_]]]
    out = constrained_search(
        FakeModel(never_ending), src, sets, SearchSettings(beam_size=k, max_len_a=0, max_len_b=4), nbest=k
    )
    for hyps, constraints in zip(out, sets, strict=True):
        assert len(hyps) == k
        assert all(holds(h.tokens, constraints) and len(h.tokens) == 4 for h in hyps)
        assert hyps[0].tokens.count(B_) == 2  # no more b than the phrases need: b is less likely than a
        assert hyps[0].log_prob == pytest.approx(2 * math.log(0.6) + 2 * math.log(0.4 - 1e-6) + math.log(1e-6))


def test_a_completed_phrase_ends_its_word() -> None:
    """With b a piece that continues a word, a met phrase "a" is never followed by b; without that rule some
    hypotheses are (the check can fail), and the best output that obeys it is the exhaustive best."""
    tables = [random_table(300 + i, eos_bias=-0.04) for i in range(4)]
    model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
    src = fake_src(list(range(4)), src_len=3)
    continues_word = torch.zeros(6, dtype=torch.bool)
    continues_word[B_] = True
    settings = SearchSettings(beam_size=16, len_penalty=0.6, max_len_a=0, max_len_b=3)
    free = constrained_search(model, src, [[[A]]] * 4, settings, nbest=16)
    ended = constrained_search(model, src, [[[A]]] * 4, settings, nbest=16, continues_word=continues_word)

    def met_then_b(tokens: list[int]) -> bool:  # the first a meets the phrase
        return A in tokens and tokens.index(A) + 1 < len(tokens) and tokens[tokens.index(A) + 1] == B_

    assert any(met_then_b(h.tokens) for hyps in free for h in hyps)
    for s, hyps in enumerate(ended):
        expected = [w for _, w in exhaustive_with(tables[s], s, 3, 0.6, [[A]]) if not met_then_b(list(w))]
        assert hyp_tuples(hyps) == expected


def test_word_continuations_are_the_pieces_without_a_word_start(prepared_toy: Config) -> None:
    from transformer_mt.data.bpe import load_bpe

    bpe = load_bpe(Path(prepared_toy.data.dir) / "spm.model")
    marks = word_continuations(bpe)
    pieces = [bpe.id_to_piece(i) for i in range(bpe.get_piece_size())]
    assert marks.shape == (len(pieces),) and 0 < int(marks.sum()) < len(pieces)
    assert not marks[:4].any()  # PAD, UNK, BOS, EOS
    assert all(
        not p.startswith("\u2581") and any(c.isalnum() for c in p) for p, m in zip(pieces, marks, strict=True) if m
    )
    assert all(
        p.startswith("\u2581") or not any(c.isalnum() for c in p)
        for p, m in zip(pieces[4:], marks[4:], strict=True)
        if not m
    )


def test_constraints_longer_than_the_output_are_refused() -> None:
    with pytest.raises(ConstraintLengthError, match="sentence 1: the constraints need 4 tokens, the output may have 3"):
        constrained_search(
            FakeModel(never_ending),
            fake_src([0, 1], 2),
            [[[A]], [[A, B_], [B_, B_]]],
            SearchSettings(max_len_a=0, max_len_b=3),
        )


# --- no constraints, and batching ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_without_constraints_equals_beam_search(k: int) -> None:
    """Eight sentences of different lengths (they leave the batch at different steps), UNK a third word; the
    last four have constraints and must not change the first four."""
    tables = [random_table(100 + i, unk=True, eos_bias=0.3 * (i % 3)) for i in range(8)]
    model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
    src_lens = [1, 4, 2, 6, 3, 1, 5, 2]
    src = torch.full((8, 7), PAD)
    for i, n in enumerate(src_lens):
        src[i, : n + 1] = torch.tensor([i + 10] + [7] * (n - 1) + [EOS])
    plain = beam_search(model, src, SearchSettings(beam_size=k, max_len_a=1.0, max_len_b=1), nbest=k)
    none = constrained_search(model, src, [[]] * 8, SearchSettings(beam_size=k, max_len_a=1.0, max_len_b=1), nbest=k)
    mixed = constrained_search(
        model,
        src,
        [[]] * 4 + [[[B_]], [[A]], [[A, B_]], [[B_], [A]]],
        SearchSettings(beam_size=k, max_len_a=1.0, max_len_b=1),
        nbest=k,
    )
    for i in range(8):
        assert hyp_tuples(none[i]) == hyp_tuples(plain[i])
        assert [h.score for h in none[i]] == pytest.approx([h.score for h in plain[i]], abs=1e-6)
    assert mixed[:4] == none[:4]


def random_constraints(rng: random.Random, words: list[int], most: int) -> list[list[int]]:
    return [[rng.choice(words) for _ in range(rng.randint(1, 2))] for _ in range(rng.randint(0, most))]


@pytest.mark.parametrize("k", [1, 3])
def test_a_sentence_does_not_depend_on_the_others_in_its_batch(k: int) -> None:
    rng = random.Random(k)
    tables = [random_table(200 + i, unk=True) for i in range(6)]
    model = FakeModel(lambda s, prefix: tables[s - 10](s - 10, prefix))
    src = fake_src(list(range(6)), src_len=4)
    constraints = [random_constraints(rng, [A, B_, 1], 2) for _ in range(6)]
    batched = constrained_search(model, src, constraints, SearchSettings(beam_size=k, max_len_b=3), nbest=k)
    for i in range(6):
        alone = constrained_search(
            model, src[i : i + 1], constraints[i : i + 1], SearchSettings(beam_size=k, max_len_b=3), nbest=k
        )
        assert batched[i] == alone[0]
        assert all(holds(h.tokens, constraints[i]) for h in batched[i])


# --- a real tiny Transformer ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    return tiny_transformer(6.0, eos_scale=0.5)  # sharper distributions than at init, so hypotheses differ and end


@pytest.mark.parametrize("no_repeat_ngram", [0, 2])
def test_every_output_holds_its_constraints_on_a_real_model(tiny_model: Transformer, no_repeat_ngram: int) -> None:
    """Random phrases of random tokens, cached batched search: every hypothesis holds every phrase, even those
    n-gram blocking would ban, and a batch equals its sentences one at a time."""
    rng = random.Random(no_repeat_ngram)
    g = torch.Generator().manual_seed(5)
    lengths = [5, 9, 3, 7, 12, 4]
    src = torch.full((len(lengths), max(lengths) + 1), PAD)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, 24, (n,), generator=g)
        src[i, n] = EOS
    constraints = [random_constraints(rng, list(range(4, 24)), 3) for _ in lengths]
    constraints[0] = [[7, 7], [7]]  # a phrase inside another's repetition
    out = constrained_search(
        tiny_model, src, constraints, SearchSettings(beam_size=4, max_len_b=6, no_repeat_ngram=no_repeat_ngram), nbest=4
    )
    for i, (hyps, phrases) in enumerate(zip(out, constraints, strict=True)):
        assert hyps and all(holds(h.tokens, phrases) for h in hyps), (i, phrases, hyp_tuples(hyps))
        alone = constrained_search(
            tiny_model,
            src[i : i + 1, : lengths[i] + 1],
            [phrases],
            SearchSettings(beam_size=4, max_len_b=6, no_repeat_ngram=no_repeat_ngram),
            nbest=4,
        )
        assert hyp_tuples(alone[0]) == hyp_tuples(hyps)
        assert [h.score for h in alone[0]] == pytest.approx([h.score for h in hyps], abs=1e-4)


def test_cached_equals_uncached_on_a_real_model(tiny_model: Transformer) -> None:
    src = torch.tensor([[5, 9, 11, 4, EOS], [8, 6, EOS, PAD, PAD]])
    constraints = [[[9, 10]], [[12], [13, 14]]]
    cached = constrained_search(tiny_model, src, constraints, SearchSettings(beam_size=3, max_len_b=5), nbest=3)
    plain = constrained_search(
        tiny_model, src, constraints, SearchSettings(beam_size=3, max_len_b=5), nbest=3, use_cache=False
    )
    for c, p in zip(cached, plain, strict=True):
        assert hyp_tuples(c) == hyp_tuples(p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_equals_cpu(tiny_model: Transformer) -> None:
    src = torch.tensor([[5, 9, 11, 4, EOS], [8, 6, EOS, PAD, PAD]])
    constraints = [[[9, 10]], [[12], [13, 14]]]
    cpu = constrained_search(tiny_model, src, constraints, SearchSettings(beam_size=3, max_len_b=5), nbest=2)
    gpu_model = Transformer(tiny_model.cfg, vocab_size=24).cuda().eval()
    gpu_model.load_state_dict(tiny_model.state_dict())
    gpu = constrained_search(gpu_model, src.cuda(), constraints, SearchSettings(beam_size=3, max_len_b=5), nbest=2)
    for c, g in zip(cpu, gpu, strict=True):
        assert hyp_tuples(c) == hyp_tuples(g)
        assert [h.score for h in c] == pytest.approx([h.score for h in g], abs=1e-3)


# --- input lines ----------------------------------------------------------------------------------------------------


def test_split_constraints() -> None:
    assert split_constraints("A dog runs.", 0) == ("A dog runs.", [])
    assert split_constraints("A dog runs.\tHund\tläuft schnell", 0) == ("A dog runs.", ["Hund", "läuft schnell"])
    with pytest.raises(ConstraintError, match=r"line 3: constraint 2 is empty .* remove the extra tab"):
        split_constraints("A dog.\tHund\t\tläuft", 2)
    with pytest.raises(ConstraintError, match=r"line 1: constraint 1 is empty"):
        split_constraints("A dog.\t", 0)
    with pytest.raises(ConstraintError, match=r"line 5: constraints but no source text"):
        split_constraints(" \tHund", 4)


# --- tmt translate --constraints -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_lines(prepared_toy: Config) -> tuple[list[str], list[str]]:
    """Sources and references of the toy test set: the references supply phrases the toy vocabulary holds."""
    test = Path(prepared_toy.data.test)
    src = test.with_name(test.name + ".en").read_text(encoding="utf-8").splitlines()
    ref = test.with_name(test.name + ".de").read_text(encoding="utf-8").splitlines()
    return src[:6], ref[:6]


def translate_cli(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(app, ["translate", *args], input=stdin)


def test_cli_every_translation_holds_its_phrases(toy_ckpt: Path, toy_lines, tmp_path: Path) -> None:
    """Lines with phrases hold them (one, two, or a two-word phrase); lines without are translated as without
    --constraints; an empty line stays empty."""
    sources, refs = toy_lines
    words = [ref.split() for ref in refs]
    phrases = [[words[0][1]], [], [words[2][0], words[2][-2]], [" ".join(words[3][1:3])], [], [words[5][2]]]
    lines = ["\t".join([src, *p]) for src, p in zip(sources, phrases, strict=True)]
    lines[4] = ""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    result = translate_cli("-c", str(toy_ckpt), "-i", str(src), "-o", str(out), "--constraints")
    assert result.exit_code == 0, result.output
    got = out.read_text(encoding="utf-8").splitlines()
    assert len(got) == len(lines) and got[4] == ""
    for text, p in zip(got, phrases, strict=True):
        assert all(phrase in text for phrase in p), (text, p)
    plain = translate_cli("-c", str(toy_ckpt), stdin=f"{sources[1]}\n\n")
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.splitlines() == [got[1], ""]
    unconstrained = translate_cli("-c", str(toy_ckpt), stdin="\n".join(sources) + "\n")
    assert unconstrained.stdout.splitlines() != got  # the phrases changed some translations


def test_cli_constraints_with_nbest_and_a_line_at_a_time(toy_ckpt: Path, toy_lines) -> None:
    sources, refs = toy_lines
    phrase = refs[0].split()[1]
    stdin = f"{sources[0]}\t{phrase}\n{sources[1]}\n"
    rows = translate_cli("-c", str(toy_ckpt), "--constraints", "--nbest", "2", "--beam", "3", stdin=stdin)
    assert rows.exit_code == 0, rows.output
    fields = [row.split("\t") for row in rows.stdout.splitlines()]
    assert [f[0] for f in fields] == ["0", "0", "1", "1"]
    assert phrase in fields[0][2] and phrase in fields[1][2]
    streamed = translate_cli("-c", str(toy_ckpt), "--constraints", "--buffer-lines", "1", stdin=stdin)
    whole = translate_cli("-c", str(toy_ckpt), "--constraints", stdin=stdin)
    assert streamed.exit_code == 0 and whole.exit_code == 0, streamed.output + whole.output
    assert streamed.stdout == whole.stdout and phrase in whole.stdout.splitlines()[0]
    ensemble = translate_cli("-c", str(toy_ckpt), "-c", str(toy_ckpt), "--ensemble", "--constraints", stdin=stdin)
    assert ensemble.exit_code == 0, ensemble.output
    assert phrase in ensemble.stdout.splitlines()[0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{src}\t{word}\t\t{word}", "line 2: constraint 2 is empty (two tabs in a row, or a tab at the end"),
        ("{src}\t", "line 2: constraint 1 is empty"),
        ("\t{word}", "line 2: constraints but no source text before the first tab; put the sentence to translate"),
        (
            "{src}\t{word} \u2603",
            "line 2: constraint 1 ('{word} \u2603') holds characters the model's vocabulary lacks",
        ),
        ("{src}" + "\t{word}" * 40, "line 2: the constraints take"),
    ],
)
def test_cli_bad_constraint_lines(toy_ckpt: Path, toy_lines, tmp_path: Path, line: str, message: str) -> None:
    """One line on stderr naming the line and the fix, exit 2, no output file (nor a temporary one) left."""
    sources, refs = toy_lines
    word = refs[0].split()[1]
    src = tmp_path / "in.txt"
    src.write_text(f"{sources[0]}\n{line.format(src=sources[1], word=word)}\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    result = translate_cli("-c", str(toy_ckpt), "-i", str(src), "-o", str(out), "--constraints")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert message.format(word=word) in " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_cli_constraints_need_tmts_own_search(tmp_path: Path) -> None:
    result = translate_cli("--engine", "ctranslate2", "-c", str(tmp_path / "ct2"), "--constraints", stdin="a\tb\n")
    assert result.exit_code == 2, result.output
    assert "CTranslate2 has no lexical constraints" in " ".join(result.output.split())


def test_cli_without_constraints_a_tab_is_part_of_the_source(toy_ckpt: Path, toy_lines) -> None:
    sources, refs = toy_lines
    result = translate_cli("-c", str(toy_ckpt), stdin=f"{sources[0]}\t\t\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == translate_cli("-c", str(toy_ckpt), stdin=f"{sources[0]}\n").stdout


def test_cli_constraints_with_alignments(toy_ckpt: Path, toy_lines) -> None:
    """--alignment with --constraints: each output line (constrained, unconstrained or empty) gets its alignment
    column, in pairs over the line's own source and target words; the translations are those without it."""
    sources, refs = toy_lines
    phrase = refs[0].split()[1]
    stdin = f"{sources[0]}\t{phrase}\n\n{sources[1]}\n"
    aligned = translate_cli("-c", str(toy_ckpt), "--constraints", "--alignment", "hard", stdin=stdin)
    plain = translate_cli("-c", str(toy_ckpt), "--constraints", stdin=stdin)
    assert aligned.exit_code == 0 and plain.exit_code == 0, aligned.output + plain.output
    rows = [row.split("\t") for row in aligned.stdout.splitlines()]
    assert [r[0] for r in rows] == plain.stdout.splitlines() and rows[1] == ["", ""]
    for (text, alignment), source in zip(rows[::2], sources[:2], strict=True):
        pairs = [tuple(map(int, p.split("-"))) for p in alignment.split()]
        assert pairs and all(i < len(source.split()) and j < len(text.split()) for i, j in pairs)


def test_cli_constraints_refuse_sampling(toy_ckpt: Path, toy_lines) -> None:
    sources, refs = toy_lines
    result = translate_cli("-c", str(toy_ckpt), "--constraints", "--sample", "topk:5", stdin=f"{sources[0]}\tx\n")
    assert result.exit_code == 2, result.output
    assert "cannot be combined with --sample" in " ".join(result.output.split())
