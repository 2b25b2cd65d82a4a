"""Interactive translation: lines translated and printed as they arrive, for a terminal or a program on a pipe.

`tmt translate` reads a file or a pipe in large windows (10,000 lines)
and batches each by length, the fastest way through a test set; but a person typing at a
terminal, or a program that writes a line to tmt's stdin and waits for its
translation before writing the next, would then wait for an end of input
that never comes. Here the input is read N lines at a time (``--buffer-lines
N``; 1 at a terminal), each group translated as soon as it is complete (or
the input ends) and its output printed and flushed at once: one line out per
line in, in order, empty lines included (K lines with ``--nbest K``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from transformer_mt.decode.lines import (
    EmptyCount,
    empty_warning,
    input_lines,
    translated_windows,
    windows,
    write_stdout,
)
from transformer_mt.decode.translate import TranslateError, Translator, load_translator

READY = "ready: type a sentence and press Enter for its translation; Ctrl-D (end of input) or Ctrl-C to stop"


def stream_lines(
    buffer_lines: int | None, input: str | Path | None, output: str | Path | None, stdin_is_terminal: bool
) -> int | None:
    """How many lines to translate at a time as they arrive, or None to read the input in windows (`translate_file`).

    ``--buffer-lines N`` asks for N; a person typing at a terminal (stdin,
    no ``--output``) gets one line at a time. Files and pipes are read in
    windows and batched by length, the fastest. ``--output`` is written whole or not
    at all, so it cannot grow line by line: it refuses ``--buffer-lines``.
    """
    if buffer_lines is not None:
        if buffer_lines < 1:
            raise TranslateError(f"--buffer-lines must be at least 1, got {buffer_lines}")
        if output is not None:
            raise TranslateError(
                "--buffer-lines prints each translation to stdout as soon as it is ready, and --output is written "
                "whole at the end; drop --output (redirect stdout instead) or drop --buffer-lines"
            )
        return buffer_lines
    return 1 if input is None and output is None and stdin_is_terminal else None


def translate_stream(
    translator: Translator, input: str | Path | None, buffer_lines: int, prefix_file: str | Path | None = None,
    constraints: bool = False,
) -> int:  # fmt: skip
    """Translate ``input`` (stdin when None) ``buffer_lines`` lines at a time as they are read; returns the lines.

    Each group's translations go to stdout, flushed, before the next group
    is read; ``--nbest`` rows are numbered from the input's first line. The
    warning about empty translations comes once, at the end of the input.
    ``prefix_file``: one target prefix per input line, read beside it; ``constraints``: each line is
    ``source<TAB>phrase<TAB>...``.
    """
    translator.show_progress = False
    counts = EmptyCount()
    names = ("<stdin>" if input is None else str(input), str(prefix_file))
    prefix_lines = None if prefix_file is None else input_lines(prefix_file)
    # windows stops at N lines (islice): it never waits for line N + 1
    chunks = windows(input_lines(input), prefix_lines, buffer_lines, names)
    done = 0
    for lines, out in translated_windows(translator, chunks, counts, names[1], constraints):
        write_stdout(out)
        done += lines
    warning = empty_warning(counts.given, counts.empty)
    if warning:
        print(warning, file=sys.stderr)
    return done


def translate_interactive(
    checkpoints: Sequence[str | Path], input: str | Path | None, buffer_lines: int, engine: str = "pytorch",
    ensemble: bool = False, device: str | None = None, overrides: Sequence[str] = (),
    prefix_file: str | Path | None = None, constraints: bool = False, ready: bool = False,
    languages: tuple[str | None, str | None] = (None, None), pivot: str | None = None,
) -> int:  # fmt: skip
    """Load the model first (`load_translator`), so that it is ready for the first line, then `translate_stream`.

    ``constraints``: each line is ``source<TAB>phrase<TAB>...`` (`Translator.translate_constrained`).
    ``ready``: say on stderr when the model is loaded and how to stop, for a person at a terminal, who
    otherwise sees nothing while it loads and cannot tell when to type. ``languages``, ``pivot``: as
    `load_translator`'s."""
    translator = load_translator(checkpoints, engine, ensemble, device, overrides, languages, pivot)
    if ready:
        print(READY, file=sys.stderr, flush=True)
    return translate_stream(translator, input, buffer_lines, prefix_file, constraints)
