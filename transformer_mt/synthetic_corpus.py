"""A parallel corpus made of a model's translations: back-translation and sequence-level distillation.

Both pair each line of a text with a model's translation of it. Back-
translation (Sennrich et al. 2016) translates monolingual text of the target
language with a reverse model, so that the real text is the target side and
the translation the source; distillation (Kim & Rush 2016) translates the
training sources with a teacher, so that the translation is the target.
Either way the corpus is two files, ``PREFIX.SRC`` (the input, line for line)
and ``PREFIX.TGT`` (its translations), in the model's languages: a prefix
any config's ``data.train`` or ``data.corpora`` entry can read.

Hours of decoding must survive a kill: the input is translated
``window_lines`` at a time, each window's translations written atomically
under ``PREFIX.parts/`` beside the plan they were made with (`Plan`: the
input's checksum, the models and the decoding settings). A second call with
the same plan translates only the windows not yet written; its corpus equals
an uninterrupted run's, since a line's translation, a sample's included,
depends on the line alone (`transformer_mt.decode.sample`). The two files
appear only when every window is done, and the parts are removed then.

What would make a silently wrong corpus is refused before any decoding,
naming the file and line: an empty line (a pair with an empty side, which
training drops and the line count would hide), a byte that is not UTF-8,
an input whose file name names another language than the model's source,
and text the model's vocabulary does not cover (a model of another language
or script: most pieces would be unknown).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from transformer_mt.data.clean import normalize, read_lines
from transformer_mt.data.directions import Direction
from transformer_mt.decode.lines import EmptyCount, empty_warning, translated_windows, windows
from transformer_mt.decode.translate import Translator, load_translator
from transformer_mt.errors import UserError
from transformer_mt.files import atomic_write_lines, atomic_write_text
from transformer_mt.progress import progress

UNKNOWN_LIMIT = 0.02  # the most of the first window's pieces that may be <unk> before the vocabulary is refused
PLAN_FILE = "plan.json"


class CorpusError(UserError):
    """Input that would make a wrong corpus, or a restart with another plan; the message says what to do."""


@dataclass(frozen=True)
class Plan:
    """What a corpus is made from: a restart must find the same, or its windows would mix two corpora."""

    input: str
    input_sha256: str
    lines: int
    checkpoints: list[str]  # each as "name size sha256-prefix": a model replaced under the same name is told apart
    overrides: list[str]
    direction: str
    window_lines: int


def make_corpus(
    checkpoints: Sequence[str | Path],
    input: str | Path,
    prefix: str | Path,
    overrides: Sequence[str] = (),
    languages: tuple[str | None, str | None] = (None, None),
    window_lines: int = 10_000,
    ensemble: bool = False,
    device: str | None = None,
    force: bool = False,
) -> tuple[Path, Path]:
    """Translate ``input`` into the corpus ``prefix``.SRC / ``prefix``.TGT, resuming at the first window that
    ``prefix``.parts/ lacks; the two paths written. ``force``: start over (another plan, or an existing corpus)."""
    if window_lines < 1:
        raise CorpusError(f"--window-lines must be at least 1, got {window_lines}")
    lines = checked_lines(input)
    translator = load_translator(checkpoints, "pytorch", ensemble, device, overrides, languages)
    way = translator.direction
    assert way is not None  # load_translator chose one, or said which to choose
    check_settings(translator)
    check_language(input, way)
    check_vocabulary(translator, input, lines[:window_lines])
    prefix = Path(prefix)
    src, tgt = (prefix.parent / f"{prefix.name}.{lang}" for lang in (way.src, way.tgt))
    if not force and (src.exists() or tgt.exists()):
        raise CorpusError(f"{src if src.exists() else tgt} exists already; pass --force to make the corpus anew")
    parts = prefix.parent / f"{prefix.name}.parts"
    plan = Plan(
        str(input), _sha256(Path(input)), len(lines), [_identity(Path(p)) for p in checkpoints], list(overrides),
        way.name, window_lines,
    )  # fmt: skip
    start(parts, plan, force)
    translate_windows(translator, lines, parts, window_lines, way.tgt)
    atomic_write_lines(src, lines)
    atomic_write_lines(tgt, _joined(parts, len(lines), window_lines, way.tgt))
    shutil.rmtree(parts)
    return src, tgt


def checked_lines(input: str | Path) -> list[str]:
    """Every line of ``input``; an empty one (or one that normalizes to nothing) is a CorpusError naming it."""
    lines = list(read_lines(input))  # a bad byte is an InputError naming the line
    for number, line in enumerate(lines, 1):
        if not normalize(line):
            raise CorpusError(
                f"{input}, line {number}: an empty line; a corpus pairs sentences, one per line: remove the empty "
                f"lines first (grep -v '^[[:space:]]*$' {input} > cleaned)"
            )
    if not lines:
        raise CorpusError(f"{input}: no lines to translate")
    return lines


def check_settings(translator: Translator) -> None:
    """One plain translation per line: n-best rows or alignments after a tab are no corpus."""
    d = translator.cfg.decode
    if d.nbest != 1 or d.alignment != "none":
        raise CorpusError(
            f"a corpus takes one plain translation per line: drop decode.nbest={d.nbest} / decode.alignment="
            f"{d.alignment} from --set"
        )


def check_language(input: str | Path, way: Direction) -> None:
    """Refuse an input named for the model's target language (``mono.en`` given to an en->de model for back-
    translation): the model would be the forward one, not the reverse one the corpus needs."""
    suffix = Path(input).suffix.lstrip(".")
    if suffix == way.tgt:
        raise CorpusError(
            f"{input}: the file is named for {suffix!r}, but the model translates {way.name} (from {way.src!r}); "
            f"give text in {way.src!r}, or a model from {suffix!r} (for back-translation: a model of the reverse "
            "direction)"
        )


def check_vocabulary(translator: Translator, input: str | Path, lines: Sequence[str]) -> None:
    """Refuse text whose pieces the model mostly does not know: a model of another language or script, whose
    translations would be noise."""
    pieces = unknown = 0
    for line in lines:
        ids = translator.bpe.encode(normalize(line), out_type=int)
        pieces, unknown = pieces + len(ids), unknown + sum(1 for i in ids if i == translator.bpe.unk_id())
    if pieces and unknown > UNKNOWN_LIMIT * pieces:
        raise CorpusError(
            f"{input}: {unknown} of the first {len(lines)} lines' {pieces} pieces ({unknown / pieces:.0%}) are not "
            "in the model's vocabulary; the model was trained on another language or script than this text: give "
            "a model whose source language is the text's"
        )


def start(parts: Path, plan: Plan, force: bool) -> None:
    """``parts`` ready for ``plan``: made, kept as it is (the same plan: resume), or refused (another plan)."""
    found = parts / PLAN_FILE
    if force and parts.exists():
        shutil.rmtree(parts)
    if found.exists():
        before = json.loads(found.read_text(encoding="utf-8"))
        changed = [key for key, value in asdict(plan).items() if before.get(key) != value]
        if changed:
            raise CorpusError(
                f"{parts} holds the windows of a corpus made with another {', '.join(changed)}; run again with "
                "the same input, models and settings to resume it, or pass --force to start over"
            )
        return
    parts.mkdir(parents=True, exist_ok=True)
    atomic_write_text(found, json.dumps(asdict(plan), indent=1) + "\n")


def translate_windows(translator: Translator, lines: list[str], parts: Path, size: int, tgt: str) -> None:
    """Translate each window of ``lines`` that ``parts`` lacks and write it there, atomically, as it is done."""
    todo = [i for i in range(0, len(lines), size) if not _window(parts, i // size, tgt).exists()]
    if len(todo) < -(-len(lines) // size):
        print(f"resuming: {len(lines) - sum(len(lines[i : i + size]) for i in todo)} of {len(lines)} lines were "
              f"translated already ({parts})", file=sys.stderr, flush=True)  # fmt: skip
    counts = EmptyCount()
    total = sum(len(lines[i : i + size]) for i in todo)
    with progress(total=total, unit="sent", desc="translate", disable=not translator.show_progress) as bar:
        translator.progress = bar
        for i in todo:
            chunk: Iterator = windows(iter(lines[i : i + size]), None, None)
            for _, out in translated_windows(translator, chunk, counts):
                atomic_write_lines(_window(parts, i // size, tgt), out)
    warning = empty_warning(counts.given, counts.empty)
    if warning:
        print(warning, file=sys.stderr)


def _window(parts: Path, index: int, tgt: str) -> Path:
    return parts / f"{index:06d}.{tgt}"


def _joined(parts: Path, lines: int, size: int, tgt: str) -> Iterator[str]:
    for index in range(-(-lines // size)):
        yield from _window(parts, index, tgt).read_text(encoding="utf-8").split("\n")[:-1]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(path: Path) -> str:
    """A checkpoint as the plan records it: its name, size and the checksum of its first MiB (quick, and enough
    to tell a retrained model saved under the same name)."""
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return f"{path.name} {path.stat().st_size} {head}"
