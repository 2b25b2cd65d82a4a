"""`tmt init`: a complete, commented config for one's own parallel text, chosen from what the corpus holds.

A newcomer with their own corpus should not have to know which shipped
config to copy, which keys tie it to a checkout, or how many updates their
data needs. `init` counts the corpus (pairs, words, distinct words, length
ratios), checks that the files exist and that the two sides align, and
writes every key of every section, each with its documentation, the keys it
chose with the reason and the counts behind it. Nothing is inherited
(``base:`` is not used), so the file means the same wherever it goes.

The choices are a starting point drawn from this project's own evidence,
not a search: the model and the budget-fitting schedule of ``tmt:multi30k.yaml``
(the recipe that won the Multi30k race, benchmarks/README.md) for small
corpora, the paper's base or big model and schedule when the budget is the
paper's; the rules are spelled out in ``choose`` and in the file written.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer_mt import config as config_module
from transformer_mt.config import Config, ConfigError, apply_override, load_config, validate
from transformer_mt.data.clean import filter_reason, normalize, read_lines
from transformer_mt.data.raw_files import raw_file
from transformer_mt.files import atomic_write_text
from transformer_mt.progress import progress

Preset = Literal["small", "base", "big"]
PRESETS: dict[str, str] = {"small": "tmt:multi30k.yaml", "base": "tmt:base.yaml", "big": "tmt:big.yaml"}
PAPER_UPDATES = {"base": 100_000, "big": 300_000}  # the paper's budgets (section 5.2)
SMALL_PAIRS = 100_000  # below this many pairs the small model; at and above it the base model
TYPE_SAMPLE_LINES = 200_000  # distinct words are counted on the first lines of each side only (memory)
PIECES_PER_WORD = 1.3  # BPE pieces per whitespace word at these vocabulary sizes (en/de: 1.2-1.5)
PADDING = 1.1  # padded tokens per real token in length-bucketed batches (tmt data-stats measures it)
RATIOS = (1.5, 2.0, 3.0)  # data.max_ratio: the smallest that drops at most 1% of the pairs
VALID_BLEU_SENTENCES = {"small": 200, "base": 500, "big": 500}
VALID_BLEU_WHY = (
    "each validation also reports greedy sacreBLEU on these; it costs time: seconds to tens of seconds a validation "
    "(most while the model is undertrained and its outputs run long), up to a sixth of a short budget; each valid "
    "line prints its share; 0 turns it off"
)
_SECTION_OF = {type(getattr(Config(), f.name)).__name__: f.name for f in dataclasses.fields(Config)}


class InitError(ConfigError):
    """A corpus `tmt init` cannot write a config for; the message names the file and the fix."""


@dataclass(frozen=True)
class Side:
    """One file of a split: its lines, whitespace words and the words seen in its first lines."""

    path: Path
    lines: int
    words: int
    types: frozenset[str] = field(repr=False)


@dataclass(frozen=True)
class Corpus:
    """What `init` counted: the three splits and, for training, how many pairs each length ratio keeps.

    One pair: ``train`` is its (source, target) files. Several directions
    over multi-way parallel files (``directions``): one file per language,
    in `languages` order, each counted once.
    """

    prefixes: dict[str, str]  # split -> prefix as the user gave it ("" for no test set)
    src_lang: str
    tgt_lang: str
    train: tuple[Side, ...]
    valid_pairs: int
    test_pairs: int
    dropped_by_ratio: dict[float, int]  # max_ratio -> training pairs it would drop (after max_len)
    directions: tuple[str, ...] = ()  # data.directions; () for one pair

    @property
    def languages(self) -> list[str]:
        if not self.directions:
            return [self.src_lang, self.tgt_lang]
        return list(dict.fromkeys(lang for d in self.directions for lang in d.split("-")))

    @property
    def ways(self) -> list[tuple[Side, Side]]:
        """Each direction's (source, target) training files."""
        if not self.directions:
            return [(self.train[0], self.train[1])]
        side = dict(zip(self.languages, self.train, strict=True))
        return [(side[src], side[tgt]) for src, tgt in (d.split("-") for d in self.directions)]

    @property
    def pairs(self) -> int:
        """Training pairs over every direction."""
        return sum(src.lines for src, _ in self.ways)

    @property
    def words(self) -> int:
        """Words of each language's training text, counted once: what the joint BPE is learned from."""
        return sum(side.words for side in self.train)

    @property
    def epoch_words(self) -> int:
        """Words of the longer side of each direction: what an epoch's batches hold, padding aside."""
        return sum(max(src.words, tgt.words) for src, tgt in self.ways)

    @property
    def types(self) -> int:
        return len(frozenset().union(*(side.types for side in self.train)))

    @property
    def described(self) -> str:
        """``en -> de``, or the directions."""
        return f"{self.src_lang} -> {self.tgt_lang}" if not self.directions else ", ".join(self.directions)


def _side_files(prefix: str, src: str, tgt: str, key: str) -> tuple[Path, Path]:
    """``prefix.src`` and ``prefix.tgt``, both present, or an error that says how files are named."""
    files = raw_file(prefix, src), raw_file(prefix, tgt)
    for path in files:
        if not path.is_file():
            given = Path(prefix)
            hint = (
                f"; give the prefix without the language: --{key} {given.with_suffix('')}"
                if given.suffix.lstrip(".") in (src, tgt)
                else f"; files are named PREFIX.{src} and PREFIX.{tgt}"
            )
            raise InitError(f"--{key} {prefix}: {path} not found{hint}")
    return files


def _count(path: Path, sample_types: bool, show: bool) -> Side:
    """Lines and words of one file (read as tmt prepare reads it), and its distinct words in the first lines."""
    lines = words = 0
    types: set[str] = set()
    for line in progress(read_lines(path), desc=f"count {path.name}", unit=" lines", disable=not show, leave=False):
        tokens = normalize(line).split()
        lines, words = lines + 1, words + len(tokens)
        if sample_types and lines <= TYPE_SAMPLE_LINES:
            types.update(tokens)
    return Side(path, lines, words, frozenset(types))


def _aligned(key: str, a: Side, b: Side) -> int:
    if a.lines != b.lines:
        raise InitError(
            f"--{key}: {a.path} has {a.lines} lines and {b.path} {b.lines}; line N of one must be the translation "
            "of line N of the other: fix or trim the longer file"
        )
    if a.lines == 0:
        raise InitError(f"--{key}: {a.path} and {b.path} are empty; give files with one sentence per line")
    return a.lines


def _ratio_drops(src: Path, tgt: Path, max_len: int) -> dict[float, int]:
    """Training pairs each candidate ``data.max_ratio`` would drop, by the filter `tmt prepare` applies."""
    dropped = dict.fromkeys(RATIOS, 0)
    for s, t in zip(read_lines(src), read_lines(tgt), strict=True):
        s, t = normalize(s), normalize(t)
        for ratio in RATIOS:
            dropped[ratio] += filter_reason(s, t, max_len, ratio) is not None
    return dropped


def count_corpus(
    train: str, valid: str, test: str, src: str, tgt: str, show: bool = True, directions: tuple[str, ...] = ()
) -> Corpus:
    """Count and check the corpus: every file present, every language of each split the same number of lines.

    ``directions`` (``en-de``, ...): several directions over multi-way
    parallel files, one per language; ``src`` and ``tgt`` are then not read.
    """
    if directions:
        return _count_directions(train, valid, test, directions, show)
    if src == tgt:
        raise InitError(f"--src and --tgt are both {src!r}; give the two languages' file suffixes, e.g. en and de")
    files = {key: _side_files(prefix, src, tgt, key) for key, prefix in (("train", train), ("valid", valid))}
    if test:
        files["test"] = _side_files(test, src, tgt, "test")
    sides = {key: (_count(a, key == "train", show), _count(b, key == "train", show)) for key, (a, b) in files.items()}
    pairs = {key: _aligned(key, *pair) for key, pair in sides.items()}
    return Corpus(
        prefixes={"train": train, "valid": valid, "test": test},
        src_lang=src,
        tgt_lang=tgt,
        train=sides["train"],
        valid_pairs=pairs["valid"],
        test_pairs=pairs.get("test", 0),
        dropped_by_ratio=_ratio_drops(*files["train"], Config().data.max_len),
    )


def _count_directions(train: str, valid: str, test: str, directions: tuple[str, ...], show: bool) -> Corpus:
    """`count_corpus` of multi-way parallel files: each language's file of each split counted once, all of a
    split the same length; a length ratio's drops summed over the directions (each pair's files read once)."""
    ways = [_direction(text) for text in directions]
    langs = list(dict.fromkeys(lang for way in ways for lang in way))
    prefixes = {"train": train, "valid": valid, "test": test}
    sides: dict[str, list[Side]] = {}
    for key, prefix in prefixes.items():
        if prefix:
            files = [_language_file(prefix, lang, key, langs) for lang in langs]
            sides[key] = [_count(path, key == "train", show) for path in files]
            for side in sides[key][1:]:
                _aligned(key, sides[key][0], side)
    drops = dict.fromkeys(RATIOS, 0)
    for pair in dict.fromkeys(frozenset(way) for way in ways):
        a, b = sorted(pair)
        once = _ratio_drops(raw_file(train, a), raw_file(train, b), Config().data.max_len)
        for ratio in RATIOS:
            drops[ratio] += once[ratio] * sum(frozenset(way) == pair for way in ways)
    return Corpus(
        prefixes, ways[0][0], ways[0][1], tuple(sides["train"]), sides["valid"][0].lines,
        sides["test"][0].lines if test else 0, drops, tuple(directions),
    )  # fmt: skip


def _language_file(prefix: str, lang: str, key: str, langs: list[str]) -> Path:
    """``prefix.lang``, present, or an InitError that says how multi-way parallel files are named."""
    path = raw_file(prefix, lang)
    if not path.is_file():
        names = ", ".join(f"PREFIX.{x}" for x in langs)
        raise InitError(f"--{key} {prefix}: {path} not found; --directions reads one file per language: {names}")
    return path


def init_directions(src: str, tgt: str, directions: str) -> tuple[str, ...]:
    """--directions (``en-de,de-en``) as a tuple, () for the pair --src/--tgt; an InitError unless exactly one of
    the two ways is given."""
    ways = tuple(d.strip() for d in directions.split(",") if d.strip())
    if bool(ways) == bool(src or tgt) or not (ways or (src and tgt)):
        raise InitError("give the pair with --src and --tgt (e.g. --src en --tgt de), or --directions en-de,de-en")
    return ways


def _direction(text: str) -> tuple[str, str]:
    """``en-de`` as (source, target), or an InitError saying how directions are written."""
    src, sep, tgt = text.partition("-")
    if not (sep and src and tgt) or src == tgt:
        raise InitError(f"--directions: {text!r} is not a direction; write source-target pairs, e.g. en-de,de-en")
    return src, tgt


def vocab_size(corpus: Corpus) -> tuple[int, str]:
    """A joint BPE vocabulary for the corpus: small data wants few pieces, each seen often enough to learn.

    8000 for up to 2M words (both sides; Multi30k's 0.75M: 8000 is its tuned
    config's), 16000 up to 20M, 32000 up to 100M, the paper's 37000 above;
    never more than half the distinct words (a vocabulary of whole words
    learns nothing about unseen ones), and at least 1000.
    """
    steps = ((2_000_000, 8000), (20_000_000, 16000), (100_000_000, 32000))
    size = next((v for limit, v in steps if corpus.words <= limit), 37_000)
    cap = max(1000, corpus.types // 2 // 1000 * 1000)
    why = f"{corpus.words:,} words in all"
    if cap < size:
        size, why = cap, f"{why}, but only {corpus.types:,} distinct ones in the first lines: half of them"
    return size, why


def _preset(corpus: Corpus, preset: Preset | None) -> tuple[Preset, str]:
    if preset is not None:
        return preset, "asked for with --preset"
    if corpus.pairs < SMALL_PAIRS:
        return "small", f"{corpus.pairs:,} pairs < {SMALL_PAIRS:,}: a base model would overfit them"
    return "base", f"{corpus.pairs:,} pairs >= {SMALL_PAIRS:,}"


def _epochs(pairs: int) -> int:
    """Passes over the data: the paper's 100k updates are about 20 epochs of WMT14; smaller data needs more."""
    return 50 if pairs < SMALL_PAIRS else 30 if pairs < 1_000_000 else 20


@dataclass
class Choices:
    """The config `init` chose and why, key by key (``section.key`` -> reason)."""

    config: Config
    reasons: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, why: str) -> None:
        self.config = apply_override(self.config, f"{key}={_scalar(value)}")
        self.reasons[key] = why


def choose(corpus: Corpus, preset: Preset | None, minutes: float, name: str) -> Choices:
    """Every key that depends on the corpus or the budget; the rest is the preset's shipped config."""
    kind, why_preset = _preset(corpus, preset)
    c = Choices(load_config(PRESETS[kind]))
    c.reasons["model.d_model"] = f"the {kind} model ({PRESETS[kind]}): {why_preset}"
    _data(c, corpus, name)
    size, why = vocab_size(corpus)
    c.set("bpe.vocab_size", size, why)
    _budget(c, corpus, kind, minutes)
    c.set("train.save_dir", f"runs/{name}", "checkpoints, metrics.jsonl and config.yaml of the run")
    valid_bleu = min(corpus.valid_pairs, VALID_BLEU_SENTENCES[kind])
    c.set("train.valid_bleu_sentences", valid_bleu, VALID_BLEU_WHY)
    validate(c.config)
    return c


def _data(c: Choices, corpus: Corpus, name: str) -> None:
    p, side = corpus.prefixes, corpus.train
    if corpus.directions:
        words = " / ".join(f"{s.words:,}" for s in side)
        why = f"{side[0].lines:,} lines in each of {', '.join(corpus.languages)} ({words} words)"
        c.set("data.train", p["train"], f"{why}: {corpus.pairs:,} pairs over {len(corpus.directions)} directions")
    else:
        c.set("data.train", p["train"], f"{corpus.pairs:,} pairs, {side[0].words:,} / {side[1].words:,} words")
    c.set("data.valid", p["valid"], f"{corpus.valid_pairs:,} pairs")
    c.set("data.test", p["test"], f"{corpus.test_pairs:,} pairs" if p["test"] else "no test set (--test)")
    if corpus.directions:
        c.set("data.directions", list(corpus.directions), "--directions: each source starts with its target's tag")
    else:
        c.set("data.src_lang", corpus.src_lang, "the source files' suffix")
        c.set("data.tgt_lang", corpus.tgt_lang, "the target files' suffix")
    c.set("data.dir", f"prepared/{name}", "where tmt prepare (run by tmt train) writes")
    c.set("data.synth", False, "your own text, not the toy corpus")
    ratio = next((r for r in RATIOS if corpus.dropped_by_ratio[r] <= corpus.pairs / 100), RATIOS[-1])
    drops = ", ".join(f"{r}: {n:,}" for r, n in corpus.dropped_by_ratio.items())
    c.set("data.max_ratio", ratio, f"the smallest that drops at most 1% of the pairs (dropped by each: {drops})")


def _budget(c: Choices, corpus: Corpus, kind: Preset, minutes: float) -> None:
    """An update budget of some epochs (or ``minutes``), with the schedule that fits it."""
    t = c.config.train
    tokens = PIECES_PER_WORD * PADDING * corpus.epoch_words
    per_epoch = max(1, math.ceil(tokens / (t.max_tokens * t.update_freq)))
    if minutes > 0:
        c.set("train.max_minutes", minutes, "--minutes; the schedule below fits whatever that budget reaches")
        c.set("train.max_updates", 0, "the clock is the budget")
        _fitted_schedule(c, kind, "a time budget")
        return
    epochs = _epochs(corpus.pairs)
    updates = math.ceil(epochs * per_epoch / 100) * 100
    why = f"{epochs} epochs of about {per_epoch:,} updates ({tokens:,.0f} padded tokens per epoch, estimated)"
    if kind in PAPER_UPDATES and updates >= PAPER_UPDATES[kind]:
        c.set("train.max_updates", PAPER_UPDATES[kind], f"the paper's budget ({why} would be more)")
        return  # the paper's schedule, as shipped
    c.set("train.max_updates", max(updates, 1000), why + ("" if updates >= 1000 else "; at least 1000"))
    c.set("train.max_minutes", 0, "the update count is the budget")
    c.set("train.validate_every", max(50, c.config.train.max_updates // 20), "about 20 validations in the run")
    _fitted_schedule(c, kind, f"{c.config.train.max_updates:,} updates, fewer than the paper's")


def _fitted_schedule(c: Choices, kind: Preset, budget: str) -> None:
    """The budget-fitting schedule of tmt:multi30k.yaml: warm up over 10%, hold, decay linearly over the last 30%."""
    why = f"deviation: {budget}; the schedule fits any budget (tmt:multi30k.yaml's, the Multi30k race's winner)"
    if kind != "small":
        m = c.config.model
        peak = m.d_model**-0.5 * 4000**-0.5
        c.set("train.lr", round(peak, 6), f"deviation: the paper's peak for d_model {m.d_model} (warmup 4000)")
        c.set("train.schedule", "linear", why)
        c.set("train.warmup_fraction", 0.1, why)
        c.set("train.decay_fraction", 0.3, why)
        c.set("train.min_warmup", 80, why)
        c.set("train.snapshot_span", 0.1, "deviation: the checkpoints to average spread over the last 10%")
    c.reasons.setdefault("train.schedule", why)


def _scalar(value: Any) -> str:
    """``value`` as YAML that PyYAML reads back as the same type (it reads ``1e-09`` as a string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, float):
        text = repr(value)
        return text.replace("e", ".0e") if "e" in text and "." not in text else text
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z0-9_./:+-]*", value) and value and yaml.safe_load(value) == value
        return value if plain else json.dumps(value)
    return str(value)


def field_docs() -> dict[str, str]:
    """Each config key's documentation: the comment beside its field in transformer_mt/config.py, or above it."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    docs: dict[str, str] = {}
    for node in ast.parse(source).body:
        section = _SECTION_OF.get(node.name) if isinstance(node, ast.ClassDef) else None
        if section is None:
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                docs[f"{section}.{item.target.id}"] = _comment(lines, item.lineno - 1, item.end_lineno or item.lineno)
    return docs


def _comment(lines: list[str], first: int, end: int) -> str:
    """The ``  # ...`` comment on a field's lines, else the comment lines right above it, joined."""
    inline = [line.split("  # ", 1)[1].strip() for line in lines[first:end] if "  # " in line]
    if inline:
        return inline[0]
    above = []
    while first > 0 and lines[first - 1].strip().startswith("#"):
        first -= 1
        above.insert(0, lines[first].strip().lstrip("#").strip())
    return " ".join(above)


def render(choices: Choices, corpus: Corpus, command: str) -> str:
    """The whole config as commented YAML: a header, then every key with its documentation or the reason chosen."""
    docs, cfg = field_docs(), choices.config
    out = [
        f"# Written by `{command}`.",
        f"# {corpus.pairs:,} training pairs ({corpus.described}), {corpus.words:,} words; "
        f"{corpus.valid_pairs:,} validation and {corpus.test_pairs:,} test pairs.",
        "# Complete: every key of tmt, nothing inherited (no base:). Keys marked 'chose' were picked by tmt init",
        "# from the counts above; the rest are the preset's shipped settings. Deviations from the paper say so.",
        f"# Paths are relative to the directory tmt runs in: run it from {Path.cwd()}, where init ran.",
        "# Next: tmt train THIS_FILE  (prepares the data first), then tmt evaluate test -c RUN_DIR",
    ]
    for section, values in cfg.to_dict().items():
        out.append(f"{section}:")
        for key, value in values.items():
            dotted = f"{section}.{key}"
            note = f"chose: {choices.reasons[dotted]}" if dotted in choices.reasons else docs.get(dotted, "")
            out.append(f"  {key}: {_scalar(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(out) + "\n"


def write_config(
    train: str,
    valid: str,
    test: str,
    src: str,
    tgt: str,
    output: Path,
    preset: Preset | None = None,
    minutes: float = 0.0,
    command: str = "tmt init",
    show: bool = True,
    directions: tuple[str, ...] = (),
) -> Choices:
    """Count the corpus, choose, and write ``output`` whole or not at all."""
    corpus = count_corpus(train, valid, test, src, tgt, show=show, directions=directions)
    choices = choose(corpus, preset, minutes, output.stem)
    atomic_write_text(output, render(choices, corpus, command).replace("THIS_FILE", str(output)))
    return choices


def summary(choices: Choices, output: Path) -> str:
    """What `tmt init` prints: the main choices, then the next commands."""
    cfg, reasons = choices.config, choices.reasons
    t, m = cfg.train, cfg.model
    budget = f"{t.max_minutes:g} minutes" if t.max_minutes else f"{t.max_updates:,} updates"
    why = reasons.get("train.max_minutes" if t.max_minutes else "train.max_updates", "the preset's")
    split = "test" if cfg.data.test else "valid"
    return (
        f"wrote {output}: d_model {m.d_model}, {m.encoder_layers}+{m.decoder_layers} layers, "
        f"BPE vocabulary {cfg.bpe.vocab_size}, {budget} ({why})\n"
        f"next: tmt train {output}\n      tmt evaluate {split} -c {t.save_dir}"
    )
