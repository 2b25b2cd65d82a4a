"""Lines in, lines out: `tmt translate`'s input read as it arrives, in windows, and its output written whole.

A file or a pipe is read ``--window-lines`` lines at a time, each window
batched by length and translated by a `transformer_mt.decode.translate.
Translator`, and written before the next is read (`translate_file`), so
memory holds one window whatever the input's length; ``-o FILE`` is written
to a temporary file renamed at the end. The prefix file is read beside the
input, line for line. Translations that come out empty are counted, and a
warning names the likely cause.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformer_mt.data.clean import normalize, read_lines
from transformer_mt.decode.constrained import split_constraints
from transformer_mt.decode.translate import TranslateError, Translation, Translator, check_mode, load_translator
from transformer_mt.files import atomic_write_lines
from transformer_mt.progress import progress


def input_lines(input: str | Path | None) -> Iterator[str]:
    """Lines of ``input`` (stdin when None) as they arrive, by `transformer_mt.data.clean.read_lines`.

    UTF-8, split on '\\n' only. A line is yielded as soon as it is complete, so
    a terminal or a pipe that stays open is read line by line; a bad byte or
    an unreadable file is a UserError naming the input (and the line).
    """
    if input is None and sys.stdin is None:
        raise TranslateError("standard input is closed; pass -i FILE, or pipe or type the text in")
    name = "<stdin>" if input is None else str(input)
    lines = read_lines(name, sys.stdin.buffer if input is None else None)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except OSError as err:
            raise TranslateError(f"{name}: cannot read the input ({err.strerror})") from None
        yield line


Window = tuple[list[str], list[str] | None]
"""Input lines, and the prefix of each (None without --prefix-file)."""


def windows(
    lines: Iterator[str], prefixes: Iterator[str] | None, size: int | None, names: tuple[str, str] = ("", "")
) -> Iterator[Window]:
    """``lines`` ``size`` at a time (all at once for None), each with as many ``prefixes`` read beside them.

    Neither is read past the window: a line is asked for only when the
    window before it is done. When one runs out before the other, a
    TranslateError gives both line counts (``names``: the input's and the
    prefix file's), counting the rest of the longer one.
    """
    done = 0
    while group := list(itertools.islice(lines, size)):
        paired = None if prefixes is None else list(itertools.islice(prefixes, len(group)))
        if paired is not None and len(paired) < len(group):
            raise _count_mismatch(names, done + len(group) + sum(1 for _ in lines), done + len(paired))
        yield group, paired
        done += len(group)
    if prefixes is not None and next(prefixes, None) is not None:
        raise _count_mismatch(names, done, done + 1 + sum(1 for _ in prefixes))


def _count_mismatch(names: tuple[str, str], lines: int, prefixes: int) -> TranslateError:
    return TranslateError(
        f"--prefix-file {names[1]}: {prefixes} lines, but the input {names[0]} has {lines}; give one prefix per input "
        "line (an empty line for none)"
    )


def read_input_lines(input: str | Path | None) -> list[str]:
    """Every line of ``input`` (stdin when None), read to the end: see `input_lines`."""
    return list(input_lines(input))


EMPTY_OUTPUT_LIMIT = 0.05  # warn when more than this fraction of non-empty input lines translate to nothing


def empty_outputs(sources: Sequence[str], outputs: Sequence[str]) -> tuple[int, str | None]:
    """How many non-empty ``sources`` got an empty translation, and a warning when more than 5% of them did.

    A line is empty when it normalizes to nothing (what `Translator` leaves
    untranslated). A trained model almost never answers a real sentence with
    nothing; a model stopped early, inside its learning-rate warmup, often
    does. `tmt translate` and `tmt evaluate` print the warning on stderr.
    """
    given, empty = count_empty(sources, outputs)
    return empty, empty_warning(given, empty)


def count_empty(sources: Sequence[str], outputs: Sequence[str]) -> tuple[int, int]:
    """(non-empty sources, those of them translated to nothing): the counts `empty_warning` judges."""
    given = [i for i, line in enumerate(sources) if normalize(line)]
    return len(given), sum(1 for i in given if not outputs[i].strip())


def empty_warning(given: int, empty: int) -> str | None:
    """The warning of `empty_outputs` for ``empty`` of ``given`` non-empty lines, or None within the limit."""
    if not given or empty <= EMPTY_OUTPUT_LIMIT * given:
        return None
    return (
        f"warning: {empty} of {given} non-empty input lines ({100 * empty / given:.1f}%) got an empty "
        f"translation (more than {EMPTY_OUTPUT_LIMIT:.0%}); the likely cause is an undertrained checkpoint, such as "
        "a run stopped inside its learning-rate warmup (`tmt train` warns when it stops there): train longer "
        "(train.max_updates / train.max_minutes) or shorten the warmup (train.warmup), then translate again"
    )


def format_nbest(results: Sequence[Sequence[Translation]], start: int = 0) -> list[str]:
    """``index<TAB>score<TAB>text`` lines: 0-based input line index (the first is ``start``), normalized score;
    ``<TAB>alignment`` after the text with ``decode.alignment``."""
    return [f"{start + i}\t{t.score:.4f}\t{t.line()}" for i, hyps in enumerate(results) for t in hyps]


def write_stdout(lines: Sequence[str]) -> None:
    """``lines`` on stdout, each ended by '\\n', as UTF-8 whatever the locale says, flushed."""
    text = "".join(line + "\n" for line in lines)
    stdout = getattr(sys.stdout, "buffer", None)
    if stdout is not None:
        sys.stdout.flush()
        stdout.write(text.encode("utf-8"))
        stdout.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


WINDOW_LINES = 10_000  # lines read, translated and written at a time by translate_file (benchmarks/README.md)


@dataclass
class EmptyCount:
    """Non-empty source lines and those of them translated to nothing, summed over windows (`empty_warning`)."""

    given: int = 0
    empty: int = 0

    def add(self, sources: Sequence[str], outputs: Sequence[str]) -> None:
        given, empty = count_empty(sources, outputs)
        self.given, self.empty = self.given + given, self.empty + empty


def translated_windows(
    translator: Translator, chunks: Iterable[Window], counts: EmptyCount, prefix_origin: str = "prefix",
    constraints: bool = False,
) -> Iterator[tuple[int, list[str]]]:  # fmt: skip
    """Per window of input lines (and prefixes), in order: its line count and its output lines, the best
    translations or ``--nbest`` rows numbered from the input's first line. ``counts`` sums the empty ones.
    ``constraints``: each line is ``source<TAB>phrase<TAB>...`` (`Translator.translate_constrained`)."""
    k = translator.cfg.decode.nbest
    done = 0
    for group, prefixes in chunks:
        if constraints:
            check_mode(translator.mode(k, constraints=True, prefixes=prefixes is not None))
            results = translator.translate_constrained(group, k, start=done)
        else:
            results = translator.translate_lines_nbest(group, k, done, prefixes, prefix_origin)
        best = [hyps[0].text for hyps in results]
        counts.add(group, best)
        yield len(group), [hyps[0].line() for hyps in results] if k == 1 else format_nbest(results, start=done)
        done += len(group)
        del results, best  # the next window is read and translated without this one's results held


def count_lines(path: Path) -> int:
    """Lines of a regular file as `input_lines` splits it (at b"\n"; a last line may lack it), bytes unread."""
    lines, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


def check_line_counts(input: str | Path | None, prefix_file: str | Path) -> None:
    """Refuse a --prefix-file of another line count than the input before anything is translated, when both
    are regular files (a pipe is counted as it is read, by `windows`)."""
    if input is None or not Path(input).is_file() or not Path(prefix_file).is_file():
        return
    try:
        given, prefixes = count_lines(Path(input)), count_lines(Path(prefix_file))
    except OSError:
        return  # reading reports it, naming the file
    if given != prefixes:
        raise _count_mismatch((str(input), str(prefix_file)), given, prefixes)


def translate_file(
    checkpoints: Sequence[str | Path],
    input: str | Path | None = None,
    output: str | Path | None = None,
    device: str | None = None,
    overrides: Sequence[str] = (),
    engine: str = "pytorch",
    ensemble: bool = False,
    prefix_file: str | Path | None = None,
    window_lines: int = WINDOW_LINES,
    constraints: bool = False,
    languages: tuple[str | None, str | None] = (None, None),
    pivot: str | None = None,
) -> None:
    """Translate ``input`` (stdin when None) to ``output`` (stdout when None), ``window_lines`` lines at a time.

    Each window is read, batched by length, translated and written before
    the next is read, so memory holds one window whatever the input's
    length, and stdout shows the first translations before the input ends.
    The output equals a whole-file run's for any window (a line's
    translation does not depend on its batch). The first window is read
    before the model loads, so bad input at the start fails fast; ``output``
    is written to a temporary file renamed at the end (`atomic_write_lines`),
    so a failure later leaves no file that looks complete. ``prefix_file``:
    one target prefix per input line, read beside it. ``constraints``: each
    line is ``source<TAB>phrase<TAB>...`` (`Translator.translate_constrained`). ``languages``, ``pivot``: as
    `load_translator`'s. `tmt translate --help`; `transformer_mt.decode.stream` translates as lines arrive."""
    if window_lines < 1:
        raise TranslateError(f"--window-lines must be at least 1, got {window_lines}")
    names = ("<stdin>" if input is None else str(input), str(prefix_file))
    if prefix_file is not None:
        check_line_counts(input, prefix_file)
    prefix_lines = None if prefix_file is None else input_lines(prefix_file)
    chunks = windows(input_lines(input), prefix_lines, window_lines, names)
    first = next(chunks, None)  # read before the model loads
    for i, line in enumerate(first[0] if constraints and first else []):
        split_constraints(line, i)  # the first window's format, before the model loads
    translator = load_translator(checkpoints, engine, ensemble, device, overrides, languages, pivot)
    counts = EmptyCount()
    # one bar for the whole input, counting batches; shown after half a second, so that an error in the input
    # found before any translation is the only line printed
    with progress(unit="sent", desc="translate", disable=not translator.show_progress, delay=0.5) as bar:
        translator.progress = bar
        windows_ = itertools.chain([first] if first else [], chunks)
        outputs = translated_windows(translator, windows_, counts, names[1], constraints)

        def lines() -> Iterator[str]:
            for _, out in outputs:
                yield from out
                del out  # written: not held while the next window is translated

        if output is None:
            for _, out in outputs:
                write_stdout(out)
                del out
        else:
            atomic_write_lines(output, lines())
    warning = empty_warning(counts.given, counts.empty)
    if warning:
        print(warning, file=sys.stderr)
