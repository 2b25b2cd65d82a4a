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

A target that exists and is no regular file (a FIFO, /dev/null, a terminal)
or that names an open descriptor (/dev/stdout, /dev/fd/N) is written in
place instead: renaming over it would replace a device node or a pipe with a
regular file, which as root breaks /dev/null for the whole machine.

A full disk (ENOSPC, or EFBIG and EDQUOT, its kin: a file size limit, a
quota) fails a write without naming the file; these writers name it
(`naming`), so that the command line reports it in one line.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from transformer_mt.errors import UserError, raise_if_stopped

_TEMP_RE = re.compile(r"^\.(?P<target>.+)\.[0-9a-f]{8,}\.tmp$")  # 8 hex digits: names written before 16
DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # no room: the disk, the file size limit, a quota
_DESCRIPTOR_DIRS = re.compile(r"/dev/fd|/proc/(self|thread-self|\d+)/fd")
_IN_PLACE_FLAGS = os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)  # after what the stream holds: >> stays >>
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Yield a file open on a new temporary file beside ``path``; on success fsync it and rename it over ``path``.

    ``mode`` is "wb" or "w" (text is written with '\\n' line ends). The file is
    opened from the descriptor that created it, so nothing can swap a link in
    between. On any exception (KeyboardInterrupt and SIGTERM's `Terminated` included) the temporary file
    is removed and the exception propagates; the old ``path`` is kept. A ``path`` that `is_in_place` is
    opened and written as it is.
    """
    path = Path(path)
    newline = "\n" if "b" not in mode else None
    if is_in_place(path):
        with naming(path), open(os.open(path, _IN_PLACE_FLAGS), mode, encoding=encoding, newline=newline) as f:
            yield f
        return
    names: list[Path] = []  # the temporary file's name, known before it exists: an interrupt at once still removes it
    try:
        with naming(path):
            fd = _create_temp(path, names)
            with open(fd, mode, encoding=encoding, newline=newline) as f:
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
    A ``path`` that `is_in_place` is yielded itself, to be written in place.
    """
    path = Path(path)
    if is_in_place(path):
        with naming(path):
            yield path
        return
    names: list[Path] = []
    try:
        with naming(path):
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


def is_in_place(path: str | Path) -> bool:
    """Whether ``path`` is written in place rather than replaced: it exists and is no regular file or directory
    (a FIFO, a device such as /dev/null), or it names an open descriptor (/dev/stdout, /dev/fd/1), whatever that is.

    A descriptor's name leads to the file the shell opened for the command;
    writing through it keeps what the user asked for (``-o /dev/stdout >
    out.txt``), where a rename would replace the link /dev/stdout itself.
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) or (not stat.S_ISDIR(mode) and _names_descriptor(Path(path)))


def _names_descriptor(path: Path) -> bool:
    """Whether ``path``, or a link it leads through, is an entry of /dev/fd or /proc/PID/fd."""
    path = path.absolute()
    for _ in range(40):  # the kernel's own limit on links followed
        if _DESCRIPTOR_DIRS.fullmatch(str(path.parent)):
            return True
        if not path.is_symlink():
            return False
        path = path.parent / os.readlink(path)
    return False


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """A write in the block that fails for want of room (`DISK_FULL`) names ``path``: the OS names no file for it.

    The command line then reports it in one line with the file and the fix
    (`cli.os_error_message`), whichever writer failed: ours, matplotlib's,
    CTranslate2's.
    """
    try:
        yield
    except OSError as err:
        if err.errno not in DISK_FULL or err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from None


def no_room_message(path: str | Path | None, err: OSError, elsewhere: str) -> str:
    """The one line for a write that found no room: the file, the system's words, where to make room.

    ``elsewhere``: the other place the user can write to (training: another
    train.save_dir; a command's output: another -o). ``path`` None: a writer
    that named no file (the line still says what to do).
    """
    if path is None:
        return f"cannot write ({err.strerror or err}); free space on the disk written to or {elsewhere}"
    return f"{path}: cannot write ({err.strerror or err}); free space on that disk or {elsewhere}"


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
