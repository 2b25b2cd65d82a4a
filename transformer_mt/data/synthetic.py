"""The embedded toy corpus: a small English -> German-like translation task from a grammar.

Small enough for a 2-layer model to learn on a CPU in minutes, yet not
word-by-word: the German side has gendered articles and adjective endings
that agree in case (nominative subject, accusative object, dative after
"mit"/"von" and for indirect objects), capitalized nouns, compound nouns
("the house door" -> "die Haustür"), verb-second order after a fronted
adverb ("Heute sieht der Mann ..."), the perfect's verb bracket ("hat ...
gesehen") and verb-final subordinate clauses ("..., weil der alte Mann das
rote Auto sieht"). Each English sentence has exactly one translation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.data.raw_files import raw_file
from transformer_mt.files import atomic_path, atomic_write_text
from transformer_mt.progress import progress

CASES = ("nom", "acc", "dat")
_DEF = {"m": ("der", "den", "dem"), "f": ("die", "die", "der"), "n": ("das", "das", "dem"), "pl": ("die", "die", "den")}
_INDEF = {"m": ("ein", "einen", "einem"), "f": ("eine", "eine", "einer"), "n": ("ein", "ein", "einem")}
# Adjective endings: weak after the definite article, mixed after the indefinite one, strong with a bare number.
_WEAK = {"m": ("e", "en", "en"), "f": ("e", "e", "en"), "n": ("e", "e", "en"), "pl": ("en", "en", "en")}
_MIXED = {"m": ("er", "en", "en"), "f": ("e", "e", "en"), "n": ("es", "es", "en")}
_STRONG_PL = ("e", "e", "en")


@dataclass(frozen=True)
class Noun:
    en: str
    en_pl: str
    de: str
    de_pl: str
    gender: str  # m, f or n
    animate: bool = False

    def de_form(self, plural: bool, case: str) -> str:
        """German noun form; plural datives take -n unless the plural already ends in -n or -s."""
        if not plural:
            return self.de
        if case == "dat" and not self.de_pl.endswith(("n", "s")):
            return self.de_pl + "n"
        return self.de_pl


@dataclass(frozen=True)
class Verb:
    en_sg: str  # he ...
    en_pl: str  # they ...
    en_part: str  # has ...
    de_sg: str
    de_pl: str
    de_part: str


NOUNS = [
    Noun("man", "men", "Mann", "Männer", "m", True),
    Noun("woman", "women", "Frau", "Frauen", "f", True),
    Noun("child", "children", "Kind", "Kinder", "n", True),
    Noun("dog", "dogs", "Hund", "Hunde", "m", True),
    Noun("cat", "cats", "Katze", "Katzen", "f", True),
    Noun("teacher", "teachers", "Lehrer", "Lehrer", "m", True),
    Noun("girl", "girls", "Mädchen", "Mädchen", "n", True),
    Noun("doctor", "doctors", "Arzt", "Ärzte", "m", True),
    Noun("friend", "friends", "Freund", "Freunde", "m", True),
    Noun("mother", "mothers", "Mutter", "Mütter", "f", True),
    Noun("father", "fathers", "Vater", "Väter", "m", True),
    Noun("bird", "birds", "Vogel", "Vögel", "m", True),
    Noun("horse", "horses", "Pferd", "Pferde", "n", True),
    Noun("car", "cars", "Auto", "Autos", "n"),
    Noun("house", "houses", "Haus", "Häuser", "n"),
    Noun("book", "books", "Buch", "Bücher", "n"),
    Noun("table", "tables", "Tisch", "Tische", "m"),
    Noun("door", "doors", "Tür", "Türen", "f"),
    Noun("key", "keys", "Schlüssel", "Schlüssel", "m"),
    Noun("garden", "gardens", "Garten", "Gärten", "m"),
    Noun("apple", "apples", "Apfel", "Äpfel", "m"),
    Noun("letter", "letters", "Brief", "Briefe", "m"),
    Noun("picture", "pictures", "Bild", "Bilder", "n"),
    Noun("flower", "flowers", "Blume", "Blumen", "f"),
    Noun("bottle", "bottles", "Flasche", "Flaschen", "f"),
    Noun("window", "windows", "Fenster", "Fenster", "n"),
    Noun("chair", "chairs", "Stuhl", "Stühle", "m"),
    Noun("ball", "balls", "Ball", "Bälle", "m"),
    Noun("bicycle", "bicycles", "Fahrrad", "Fahrräder", "n"),
    Noun("tree", "trees", "Baum", "Bäume", "m"),
]
# Compound modifiers: English noun -> German stem that joins the head noun ("school" + "book" -> "Schulbuch").
COMPOUND_STEMS = {"house": "Haus", "car": "Auto", "school": "Schul", "garden": "Garten", "kitchen": "Küchen"}
COMPOUND_HEADS = ["door", "key", "book", "table", "window", "chair", "picture"]

TRANSITIVE = [
    Verb("sees", "see", "seen", "sieht", "sehen", "gesehen"),
    Verb("buys", "buy", "bought", "kauft", "kaufen", "gekauft"),
    Verb("finds", "find", "found", "findet", "finden", "gefunden"),
    Verb("paints", "paint", "painted", "malt", "malen", "gemalt"),
    Verb("sells", "sell", "sold", "verkauft", "verkaufen", "verkauft"),
    Verb("washes", "wash", "washed", "wäscht", "waschen", "gewaschen"),
    Verb("carries", "carry", "carried", "trägt", "tragen", "getragen"),
    Verb("loves", "love", "loved", "liebt", "lieben", "geliebt"),
    Verb("needs", "need", "needed", "braucht", "brauchen", "gebraucht"),
    Verb("holds", "hold", "held", "hält", "halten", "gehalten"),
]
DITRANSITIVE = [
    Verb("gives", "give", "given", "gibt", "geben", "gegeben"),
    Verb("shows", "show", "shown", "zeigt", "zeigen", "gezeigt"),
    Verb("sends", "send", "sent", "schickt", "schicken", "geschickt"),
    Verb("brings", "bring", "brought", "bringt", "bringen", "gebracht"),
]
SAY_VERBS = [
    Verb("says", "say", "said", "sagt", "sagen", "gesagt"),
    Verb("knows", "know", "known", "weiß", "wissen", "gewusst"),
]
ADJECTIVES = {
    "red": "rot",
    "old": "alt",
    "small": "klein",
    "big": "groß",
    "new": "neu",
    "young": "jung",
    "beautiful": "schön",
    "green": "grün",
    "blue": "blau",
    "black": "schwarz",
    "white": "weiß",
    "cold": "kalt",
}
NUMBERS = {"two": "zwei", "three": "drei", "four": "vier", "five": "fünf", "six": "sechs", "ten": "zehn"}
CONJUNCTIONS = {"because": "weil", "when": "wenn", "although": "obwohl", "while": "während"}
ADVERBS = {"today": "heute", "now": "jetzt", "often": "oft", "in the evening": "am Abend"}
PREPOSITIONS = {"with": ("mit", "dat"), "from": ("von", "dat"), "for": ("für", "acc")}

_ANIMATE = [n for n in NOUNS if n.animate]
_NOUN_BY_EN = {n.en: n for n in NOUNS}


@dataclass(frozen=True)
class Phrase:
    """One constituent in both languages; ``plural`` decides verb agreement."""

    en: list[str]
    de: list[str]
    plural: bool = False


def _compound(rng: random.Random) -> Noun:
    stem_en = rng.choice(sorted(COMPOUND_STEMS))
    head = _NOUN_BY_EN[rng.choice(COMPOUND_HEADS)]
    stem = COMPOUND_STEMS[stem_en]
    return Noun(
        f"{stem_en} {head.en}",
        f"{stem_en} {head.en_pl}",
        stem + head.de.lower(),
        stem + head.de_pl.lower(),
        head.gender,
    )


def _pick_noun(rng: random.Random, animate: bool) -> Noun:
    """A subject or indirect object is animate; other nouns are any noun or, sometimes, a compound."""
    if animate:
        return rng.choice(_ANIMATE)
    return _compound(rng) if rng.random() < 0.15 else rng.choice(NOUNS)


def noun_phrase(rng: random.Random, case: str, animate: bool) -> Phrase:
    """A determiner, an optional adjective and a noun, inflected for ``case`` on the German side."""
    noun = _pick_noun(rng, animate)
    adj = rng.choice(sorted(ADJECTIVES)) if rng.random() < 0.4 else None
    c = CASES.index(case)
    kind = rng.choices(["def", "indef", "num", "defpl"], weights=[5, 3, 1, 1])[0]
    plural = kind in ("num", "defpl")
    de_noun = noun.de_form(plural, case)
    en_noun = noun.en_pl if plural else noun.en
    if kind == "def":
        en_det, de_det, ending = ["the"], [_DEF[noun.gender][c]], _WEAK[noun.gender][c]
    elif kind == "defpl":
        en_det, de_det, ending = ["the"], [_DEF["pl"][c]], _WEAK["pl"][c]
    elif kind == "indef":
        first = adj or en_noun
        en_det, de_det, ending = (
            ["an" if first[0] in "aeiou" else "a"],
            [_INDEF[noun.gender][c]],
            _MIXED[noun.gender][c],
        )
    else:
        number = rng.choice(sorted(NUMBERS))
        en_det, de_det, ending = [number], [NUMBERS[number]], _STRONG_PL[c]
    en_adj = [adj] if adj else []
    de_adj = [ADJECTIVES[adj] + ending] if adj else []
    return Phrase(en_det + en_adj + en_noun.split(), de_det + de_adj + [de_noun], plural)


def clause(rng: random.Random) -> tuple[Phrase, list[str], list[str], list[str]]:
    """A clause as (subject, English predicate, German middle field, German verbs).

    The German verbs come last in a subordinate clause and split around the
    middle field in a main clause (finite verb second, participle last).
    """
    subj = noun_phrase(rng, "nom", animate=True)
    ditransitive = rng.random() < 0.25
    verb = rng.choice(DITRANSITIVE if ditransitive else TRANSITIVE)
    objects: list[Phrase] = []
    if ditransitive:
        objects.append(noun_phrase(rng, "dat", animate=True))
    objects.append(noun_phrase(rng, "acc", animate=False))
    if rng.random() < 0.3:
        prep = rng.choice(sorted(PREPOSITIONS))
        de_prep, case = PREPOSITIONS[prep]
        np_ = noun_phrase(rng, case, animate=rng.random() < 0.5)
        objects.append(Phrase([prep] + np_.en, [de_prep] + np_.de))
    perfect = rng.random() < 0.3
    if perfect:
        en_verb = ["have" if subj.plural else "has", verb.en_part]
        de_verbs = [verb.de_part, "haben" if subj.plural else "hat"]
    else:
        en_verb = [verb.en_pl if subj.plural else verb.en_sg]
        de_verbs = [verb.de_pl if subj.plural else verb.de_sg]
    en_pred = en_verb + [w for p in objects for w in p.en]
    middle = [w for p in objects for w in p.de]
    return subj, en_pred, middle, de_verbs


def main_clause(
    subj: Phrase, en_pred: list[str], middle: list[str], de_verbs: list[str], adverb: str | None
) -> tuple[list[str], list[str]]:
    """English SVO; German verb-second with the participle (if any) at the end."""
    finite, rest = de_verbs[-1], de_verbs[:-1]
    if adverb is None:
        return subj.en + en_pred, subj.de + [finite] + middle + rest
    return adverb.split() + subj.en + en_pred, ADVERBS[adverb].split() + [finite] + subj.de + middle + rest


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One English sentence and its German translation, capitalized and punctuated."""
    subj, en_pred, middle, de_verbs = clause(rng)
    adverb = rng.choice(sorted(ADVERBS)) if rng.random() < 0.2 else None
    shape = rng.random()
    if shape < 0.15:  # "The man says that the dog has found the ball."
        say = rng.choice(SAY_VERBS)
        speaker = noun_phrase(rng, "nom", animate=True)
        en = speaker.en + [say.en_pl if speaker.plural else say.en_sg, "that"] + subj.en + en_pred
        de = speaker.de + [(say.de_pl if speaker.plural else say.de_sg) + ",", "dass"] + subj.de + middle + de_verbs
        return _finish(en), _finish(de)
    en, de = main_clause(subj, en_pred, middle, de_verbs, adverb)
    if shape < 0.55:  # "..., because the old man sees the red car."
        conj = rng.choice(sorted(CONJUNCTIONS))
        sub, sub_pred, sub_middle, sub_verbs = clause(rng)
        en = en[:-1] + [en[-1] + ",", conj] + sub.en + sub_pred
        de = de[:-1] + [de[-1] + ",", CONJUNCTIONS[conj]] + sub.de + sub_middle + sub_verbs
    return _finish(en), _finish(de)


def _finish(words: list[str]) -> str:
    text = " ".join(words) + "."
    return text[0].upper() + text[1:]


def generate(n: int, rng: random.Random, exclude: set[str], desc: str) -> list[tuple[str, str]]:
    """``n`` distinct pairs whose English side is not in ``exclude`` (which grows by them)."""
    pairs = []
    with progress(total=n, desc=desc, unit="pairs", disable=n < 10_000, leave=False) as bar:
        while len(pairs) < n:
            en, de = sentence_pair(rng)
            if en in exclude:
                continue
            exclude.add(en)
            pairs.append((en, de))
            bar.update()
    return pairs


def write_corpus(
    out: str | Path, pairs: int, valid: int, test: int, seed: int, src_lang: str = "en", tgt_lang: str = "de"
) -> dict[str, int]:
    """Write ``out/{train,valid,test}.{src_lang,tgt_lang}`` and return the pair count of each split.

    The same seed gives byte-identical files. Valid and test sentences are
    drawn first and never repeat, in either split or in training; training
    pairs may repeat among themselves (as in real corpora), so memory stays
    bounded by the size of valid + test.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    held_out: set[str] = set()
    counts = {}
    for split, n in (("valid", valid), ("test", test)):
        _write_split(out, split, src_lang, tgt_lang, generate(n, rng, held_out, split))
        counts[split] = n
    counts["train"] = _write_train(out, src_lang, tgt_lang, pairs, rng, held_out)
    return {"train": counts["train"], "valid": counts["valid"], "test": counts["test"]}


def _write_split(out: Path, split: str, src_lang: str, tgt_lang: str, pairs: list[tuple[str, str]]) -> None:
    for side, lang in enumerate((src_lang, tgt_lang)):
        atomic_write_text(raw_file(out / split, lang), "".join(p[side] + "\n" for p in pairs))


def _write_train(out: Path, src_lang: str, tgt_lang: str, n: int, rng: random.Random, held_out: set[str]) -> int:
    """Stream ``n`` training pairs into both files; neither is renamed into place unless both are complete."""
    with (
        atomic_path(raw_file(out / "train", src_lang)) as tmp_src,
        atomic_path(raw_file(out / "train", tgt_lang)) as tmp_tgt,
        open(tmp_src, "w", encoding="utf-8", newline="\n") as fs,
        open(tmp_tgt, "w", encoding="utf-8", newline="\n") as ft,
    ):
        written = 0
        with progress(total=n, desc="train", unit="pairs", disable=n < 10_000, leave=False) as bar:
            while written < n:
                en, de = sentence_pair(rng)
                if en in held_out:
                    continue
                fs.write(en + "\n")
                ft.write(de + "\n")
                written += 1
                bar.update()
    return written
