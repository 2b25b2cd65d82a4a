"""The toy corpus: deterministic, held-out splits, and German word order that needs reordering."""

from __future__ import annotations

import random

import pytest

from transformer_mt.data.synthetic import (
    CONJUNCTIONS,
    DITRANSITIVE,
    NOUNS,
    TRANSITIVE,
    noun_phrase,
    sentence_pair,
    write_corpus,
)

GERMAN_VERBS = {v.de_sg for v in TRANSITIVE + DITRANSITIVE} | {v.de_pl for v in TRANSITIVE + DITRANSITIVE}
PERFECT = {"hat", "haben"}


def _read(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_same_seed_same_bytes_other_seed_other_corpus(tmp_path):
    counts = write_corpus(tmp_path / "a", pairs=300, valid=20, test=20, seed=5)
    write_corpus(tmp_path / "b", pairs=300, valid=20, test=20, seed=5)
    write_corpus(tmp_path / "c", pairs=300, valid=20, test=20, seed=6)
    assert counts == {"train": 300, "valid": 20, "test": 20}
    for name in ("train.en", "train.de", "valid.en", "valid.de", "test.en", "test.de"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "train.de").read_bytes() != (tmp_path / "c" / "train.de").read_bytes()
    assert len(_read(tmp_path / "a" / "train.en")) == len(_read(tmp_path / "a" / "train.de")) == 300


def test_valid_and_test_do_not_repeat_training_or_each_other(tmp_path):
    write_corpus(tmp_path, pairs=3000, valid=200, test=200, seed=1)
    train, valid, test = (set(_read(tmp_path / f"{s}.en")) for s in ("train", "valid", "test"))
    assert len(valid) == 200 and len(test) == 200
    assert not valid & train and not test & train and not valid & test


def test_one_translation_per_source_sentence(tmp_path):
    write_corpus(tmp_path, pairs=5000, valid=0, test=0, seed=2)
    mapping: dict[str, str] = {}
    for en, de in zip(_read(tmp_path / "train.en"), _read(tmp_path / "train.de"), strict=True):
        assert mapping.setdefault(en, de) == de


def test_lengths_are_modest():
    rng = random.Random(0)
    lengths = [len(sentence_pair(rng)[0].split()) for _ in range(2000)]
    assert min(lengths) >= 4 and max(lengths) <= 30
    assert sum(5 <= n <= 25 for n in lengths) / len(lengths) > 0.95


def test_subordinate_clause_puts_the_verb_last():
    """'..., because the old man sees the red car' -> '..., weil der alte Mann das rote Auto sieht'."""
    rng = random.Random(3)
    found = 0
    for _ in range(500):
        en, de = sentence_pair(rng)
        for conj_en, conj_de in CONJUNCTIONS.items():
            if f", {conj_en} " in en:
                sub = de.rstrip(".").split(f", {conj_de} ", 1)[1].split()
                assert sub[-1] in GERMAN_VERBS | PERFECT, de
                assert not set(sub[:-2]) & (GERMAN_VERBS | PERFECT), de
                sub_en = en.rstrip(".").split(f", {conj_en} ", 1)[1].split()
                assert sub_en[-1] not in {v.en_sg for v in TRANSITIVE + DITRANSITIVE}
                found += 1
    assert found > 50


def test_case_agreement_of_articles_and_adjectives():
    rng = random.Random(0)
    forms = {
        (case, tuple(noun_phrase(rng, case, animate=True).de)) for case in ("nom", "acc", "dat") for _ in range(400)
    }
    masc = {n.de for n in NOUNS if n.gender == "m"}
    for case, words in forms:
        if words[0] in ("der", "den", "dem") and words[-1] in masc:
            assert words[0] == {"nom": "der", "acc": "den", "dat": "dem"}[case]
            if len(words) == 3:
                assert words[1].endswith({"nom": "e", "acc": "en", "dat": "en"}[case])
        if words[0] in ("ein", "einen", "einem") and words[-1] in masc and len(words) == 3:
            assert words[1].endswith({"nom": "er", "acc": "en", "dat": "en"}[case])


@pytest.mark.parametrize("seed", [1, 2])
def test_compounds_and_capitalization(seed):
    rng = random.Random(seed)
    pairs = [sentence_pair(rng) for _ in range(3000)]
    compounds = [(en, de) for en, de in pairs if "house door" in en]
    assert compounds and all("Haustür" in de for _, de in compounds)
    for en, de in pairs:
        assert en[0].isupper() and de[0].isupper() and en.endswith(".") and de.endswith(".")
        for word in de.rstrip(".").replace(",", "").split()[1:]:
            if word.lower() in {n.de.lower() for n in NOUNS}:
                assert word[0].isupper(), de
