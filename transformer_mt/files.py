"""Atomic file writes: a crash, a kill or a full disk never leaves a file that looks complete.

Every output that a later step trusts by its presence (checkpoints, configs,
manifests, corpora, translations) is written to a temporary file in the same
directory, fsync'ed and then renamed over the target with ``os.replace``. A
reader therefore sees either the old file or the whole new one, never half of
one; on any error the temporary file is removed and the old target is kept.

Temporary names are ``.<target name>.<16 random hex digits>.tmp``, created
with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a file or a symbolic link planted
under a predictable name can never make a write land somewhere else. A process
killed mid-write leaves its temporary file behind; `remove_leftovers` deletes
those of names the caller owns.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from transformer_mt.errors import UserError, raise_if_stopped

_TEMP_RE = re.compile(r"^\.(?P<target>.+)\.[0-9a-f]{8,}\.tmp$")  # 8 hex digits: names written before 16
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Yield a file open on a new temporary file beside ``path``; on success fsync it and rename it over ``path``.

    ``mode`` is "wb" or "w" (text is written with '\\n' line ends). The file is
    opened from the descriptor that created it, so nothing can swap a link in
    between. On any exception (KeyboardInterrupt and SIGTERM's `Terminated` included) the temporary file
    is removed and the exception propagates; the old ``path`` is kept.
    """
    path = Path(path)
    names: list[Path] = []  # the temporary file's name, known before it exists: an interrupt at once still removes it
    try:
        fd = _create_temp(path, names)
        with open(fd, mode, encoding=encoding, newline="\n" if "b" not in mode else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        raise_if_stopped()  # a Ctrl-C a finalizer swallowed still keeps the output from looking complete
        os.replace(names[-1], path)
    except BaseException:
        for tmp in names:
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield the path of a new temporary file beside ``path``; on success fsync it and rename it over ``path``.

    For writers that insist on a path rather than a file object. The file is
    created (exclusively, under a random name) before it is yielded; the caller
    reopens it by name. Prefer `atomic_open` where a file object will do. On
    any exception the temporary file is removed and the exception propagates.
    """
    path = Path(path)
    names: list[Path] = []
    try:
        os.close(_create_temp(path, names))
        tmp = names[-1]
        yield tmp
        _fsync_file(tmp)
        raise_if_stopped()
        os.replace(tmp, path)
    except BaseException:
        for tmp in names:
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def check_output_file(path: str | Path, flag: str = "-o", example: str = "out.txt") -> None:
    """Refuse, before any work is done, an output file path that names a directory.

    The atomic rename at the end would fail only after the work (hours of
    translating, say) and in words about the rename; this says which flag
    to fix. ``example``: a file name to suggest inside that directory.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; {flag} names the output file, e.g. {flag} {path / example}")
    check_output_parent(path, flag)


def check_output_parent(path: str | Path, flag: str = "-o") -> None:
    """Refuse, before any work, an output path below a regular file, or in a directory this process cannot write.

    The first ancestor that exists must be a directory we may create
    entries in; the directories below it are created when the output is
    written.
    """
    path = Path(path).absolute()
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is None:
        return
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a directory; choose an output path in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: no permission to write in {parent}; choose a directory you can write to")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` as UTF-8 with '\\n' line ends to ``path``, whole or not at all."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def atomic_write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Stream ``lines`` as UTF-8, each ended by '\\n', into ``path`` (its directory created), whole or not at all.

    For outputs of any length (translations, hypotheses): nothing is held
    in memory beyond what ``lines`` yields.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def remove_leftovers(directory: str | Path, owned: re.Pattern[str]) -> list[Path]:
    """Delete the temporary files that killed writers left in ``directory``, for targets ``owned`` matches whole.

    Only this module's pattern (``.<target>.<hex>.tmp``) in ``directory``
    itself, never below it; a link is removed, never followed. Call it only
    where no other live process writes those targets (e.g. under a lock).
    Returns the deleted paths.
    """
    removed = []
    for path in Path(directory).iterdir():
        match = _TEMP_RE.match(path.name)
        if match and owned.fullmatch(match.group("target")) and not path.is_dir():
            path.unlink(missing_ok=True)
            removed.append(path)
    return sorted(removed)


def _create_temp(path: Path, names: list[Path]) -> int:
    """A new empty file ``.<name>.<random>.tmp`` beside ``path``, its write descriptor: never an existing file.

    ``O_EXCL`` refuses any name that exists, a dangling link included, and
    ``O_NOFOLLOW`` any link; a clash of 64 random bits is simply retried. The
    name is appended to ``names`` before the file is created (and taken back
    when the name was someone else's), so that a caller interrupted at any
    point removes what was created.
    """
    for _ in range(100):
        names.append(path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp"))
        try:
            return os.open(names[-1], _CREATE_FLAGS, 0o666)
        except FileExistsError:
            names.pop()
            continue
    raise FileExistsError(f"{path.parent}: could not create a temporary file for {path.name} (100 names taken)")


def _fsync_file(path: Path) -> None:
    """Flush the written data to disk before the rename makes it visible under the real name."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
