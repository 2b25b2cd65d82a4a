"""Reading ahead: the next update's batches are collated (and pinned) while the current one trains.

Collating a batch is host work (gathering sentences from the memory-mapped
arrays, padding); on a GPU it would otherwise sit between two updates while
the device waits. One background thread and one item ahead suffice: the
work per update is small next to the update itself, and order is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")


def prefetched(items: Iterable[T], prepare: Callable[[T], U]) -> Iterator[tuple[T, U]]:
    """``(item, prepare(item))`` for each item in order, ``prepare`` of the next item running in the background.

    ``items`` is advanced on the caller's thread (so an iterator with side
    effects stays single-threaded); only ``prepare`` runs on the worker. An
    exception in ``prepare`` is raised when its item is reached. Closing the
    generator early waits for the one pending ``prepare``.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as pool:
        pending: tuple[T, Future[U]] | None = None
        for item in items:
            future = pool.submit(prepare, item)
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (item, future)
        if pending is not None:
            yield pending[0], pending[1].result()
