"""Keep freed memory in the process: glibc's malloc set for PyTorch's CPU tensors.

Why: PyTorch allocates every CPU tensor with malloc and frees it when its last
reference goes; on the CPU it keeps no cache of its own. glibc serves blocks
above its mmap threshold (128 KiB at first, rising with use up to 32 MiB) with
fresh ``mmap`` calls, and hands the top of its heap back to the system once
more than its trim threshold is free there. A decoding step allocates and
frees dozens of tensors of 0.1 to 30 MB and a training step hundreds, so the
kernel kept mapping in and zeroing the same pages again. With the mmap
threshold at glibc's largest (32 MiB), a trim threshold of 1 GiB and 256 MiB of
top pad, freed memory stays with the process for the next step: beam search
on Multi30k's test2016 is 23-25% faster in int8 and 9-10% in fp32, a
base-shape training update 1-4% (benchmarks/README.md). The price: the
resident size stays near its peak, as with any caching allocator.

With batches of varying shapes the freed blocks also fragment: holes between
live blocks that later requests do not fit, so the heap grows. Over 100
base-shape training updates of varying batches the resident size rose from 3
to 7 GB, with glibc's defaults as well. `release_free_memory` (glibc's
``malloc_trim``) gives every free page of the heap back; the trainer calls it
at each metric line (``train.log_every``), where it costs about one update's
page faults, and `Translator` after each decoding batch, so that a long
translation or a server stays at one batch's memory instead of the sum of
the holes that batches of other shapes left (Multi30k test2016, int8: peak
resident size 0.87-0.99 GB before, about 0.70 GB after; benchmarks/README.md).

Within a batch the holes still grow: every decoding step frees and
allocates tensors of new shapes (sentences leave the batch, the cache grows),
and Multi30k test2016 in int8 peaked 360 MiB above the loaded model where
the tensors alive at the end of a step never took more than 170 MiB.
`FreedMemory` bounds that: after each step it compares the resident size
with what malloc has handed out and trims once more than
`FREE_SLACK` is free, so a step still reuses the memory the previous one
freed and the resident size stays within the slack of what is in use (with
a slack of 128 MiB: 120 MiB less at the peak for about 4% of CPU time;
benchmarks/README.md).

``TMT_MALLOC=system`` keeps glibc's defaults. Where the C library has no
``mallopt`` (macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt options (malloc.h)
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20))
FREE_SLACK = 128 << 20  # bytes of freed memory a decoder keeps resident between steps (`FreedMemory`)


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc 2.33+): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _malloc_function(name: str, *argtypes: type) -> Any:
    """The C library's function ``name`` (typed, returning an int), or None: under ``TMT_MALLOC=system`` or
    where the library has no such function."""
    if os.environ.get("TMT_MALLOC") == "system":
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)  # the C library this process already runs on
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def keep_freed_memory() -> bool:
    """Apply `SETTINGS` through glibc's ``mallopt``; True when each one took. Calling it again changes nothing."""
    mallopt = _malloc_function("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and all(mallopt(option, value) == 1 for option, value in SETTINGS)


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``); True when some were.

    The resident size falls back to what is in use. ``TMT_MALLOC=system`` and C libraries without
    ``malloc_trim`` leave it as it is.
    """
    trim = _malloc_function("malloc_trim", ctypes.c_size_t)
    return trim is not None and trim(0) == 1


class FreedMemory:
    """Freed memory kept resident up to a slack: `check` after each decoding step trims beyond it.

    What is free but resident is estimated as the resident size, less what
    malloc has handed out (``mallinfo2``: heap blocks in use and mmapped
    ones), less what was resident outside malloc at the last trim (libraries,
    Python's own arenas). Where the C library or the system cannot tell
    (``TMT_MALLOC=system``, no ``mallinfo2``, no ``/proc``), `check` does
    nothing. Constructing one trims: what loading the model freed goes back
    before the first batch.
    """

    def __init__(self, slack: int = FREE_SLACK) -> None:
        self.slack = slack
        self._info = _malloc_function("mallinfo2")
        if self._info is not None:
            self._info.restype = _Mallinfo2
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._outside = 0  # resident bytes not from malloc, as of the last trim
        self.release()

    def _resident(self) -> int | None:
        try:
            return int(Path("/proc/self/statm").read_text().split()[1]) * self._page
        except (OSError, IndexError, ValueError):
            return None

    def _in_use(self) -> int:
        info = self._info()
        return info.uordblks + info.hblkhd

    def release(self) -> bool:
        """Give every free page back now (`release_free_memory`) and note what is resident outside malloc."""
        trimmed = release_free_memory()
        resident = self._resident() if self._info is not None else None
        if resident is None:
            self._info = None  # nothing to compare with: checks do nothing from now on
        else:
            self._outside = resident - self._in_use()
        return trimmed

    def check(self) -> bool:
        """Trim when more than the slack of the resident size is freed memory; True when it trimmed."""
        if self._info is None:
            return False
        resident = self._resident()
        if resident is None or resident - self._outside - self._in_use() <= self.slack:
            return False
        return self.release()
