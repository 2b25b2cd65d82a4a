"""Atomic file writes: a crash, a kill or a full disk never leaves a file that looks complete.

Every output that a later step trusts by its presence (checkpoints, configs,
manifests, corpora, translations) is written to a temporary file in the same
directory, fsync'ed and then renamed over the target with ``os.replace``. A
reader therefore sees either the old file or the whole new one, never half of
one; on any error the temporary file is removed and the old target is kept.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it over ``path``.

    The caller opens and writes the temporary path itself, so large outputs
    stay streamed. It lives in the same directory because ``os.replace`` is
    only atomic within one file system. On any exception (KeyboardInterrupt
    included) the temporary file is removed and the exception propagates.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` as UTF-8 with '\\n' line ends to ``path``, whole or not at all."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path``, whole or not at all."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


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
