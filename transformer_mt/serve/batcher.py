"""One worker thread owns the model and batches the lines of many requests together.

Requests arrive one by one on the event loop; a beam search is much cheaper
per line over many lines at once. `Batcher.submit` queues a request's lines
and returns a future at once; the worker takes the oldest request and what
is queued behind it and, while fewer have come than it expects (`_gather`),
waits at most ``max_wait_ms`` for more; never past ``max_batch_tokens``
source tokens. It translates what it gathered with `Translator.translate_lines_nbest`,
which batches by length and puts every line's result back in its place.
Each request's future then gets exactly its own lines' results, in order,
whatever else shared the batch: with tmt's fp32 search a line's translation
does not depend on its batch, so it equals `tmt translate`'s.

Requests with other decoding settings (a ``beam`` or ``len_penalty`` of
their own) are translated in a group of their own within the same round;
forced prefixes travel with their lines (a line without one: ""), and
requests with constraints form groups of their own
(`Translator.translate_constrained`).
Model work never runs on the event loop, and the worker survives any error:
the failed group's futures get the exception, the others their results.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from transformer_mt.data.clean import normalize
from transformer_mt.decode.translate import Translation, Translator
from transformer_mt.serve.protocol import Job


class QueueFull(Exception):
    """More requests are waiting than ``queue_size``: the server answers 429 with Retry-After."""


class ShuttingDown(Exception):
    """The server stopped taking work (SIGTERM or Ctrl-C); what was queued before still finishes."""


@dataclass
class _Pending:
    job: Job | None  # None: ``call`` is run instead (other model work, such as an attention map)
    future: Future
    tokens: int = 0
    call: Callable[[], Any] | None = None


@dataclass
class Stats:
    """What `GET /health` reports about the worker."""

    requests: int = 0
    lines: int = 0
    batches: int = 0
    errors: int = 0


class Batcher:
    """The queue and the one worker; `start` it on a thread (or `run` it), `submit` jobs, `close` to finish."""

    def __init__(self, translator: Translator, max_batch_tokens: int, max_wait_ms: float, queue_size: int) -> None:
        self.translator = translator
        self.translator.show_progress = False
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=queue_size)
        self.stats = Stats()
        self._closed = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()  # submit's check of _closed and its put, against close's
        self._expected = 1  # requests the worker waits for, within max_wait (`_gather`)

    def start(self) -> None:
        """Run the worker (`run`) on a thread of its own."""
        threading.Thread(target=self.run, name="tmt-serve-worker", daemon=True).start()

    def run(self) -> None:
        """The worker loop, in the calling thread, until `close`: what was queued before is finished first.

        `tmt serve` runs it in the main thread: PyTorch's small parallel
        operators (bmm, layer norm, softmax) ran about 8x slower per call in a
        thread other than the one that started the process's OpenMP pool
        (13 against 107 us per bmm; a single sentence 0.14 against 0.22-0.38 s).
        """
        try:
            self._run()
        finally:
            self._finished.set()

    def depth(self) -> int:
        """Requests waiting for the worker (not counting the round it is translating)."""
        return self.queue.qsize()

    def submit(self, job: Job) -> Future:
        """Queue ``job``; the future's result is one n-best list (``job.nbest`` `Translation`s) per line."""
        tokens = sum(len(self.translator.bpe.encode(normalize(line))) + 1 for line in job.lines)
        return self._put(_Pending(job, Future(), tokens=tokens))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the worker thread, between rounds: model work other than translation."""
        return self._put(_Pending(None, Future(), call=fn))

    def _put(self, pending: _Pending) -> Future:
        with self._lock:
            if self._closed.is_set():
                raise ShuttingDown("the server is shutting down")
            try:
                self.queue.put_nowait(pending)
            except queue.Full:
                raise QueueFull(f"{self.queue.maxsize} requests are waiting already") from None
        return pending.future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work, let the worker finish everything queued, and wait for it (``timeout`` seconds)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self.queue.put(None)  # after every queued job: the worker drains them first
        self._finished.wait(timeout)

    # -- the worker thread

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self.queue.get()
            if first is None:
                return
            round_, stop = self._gather(first)
            self._translate(round_)
            # the clients just answered, likely to send again, and those that queued meanwhile
            self._expected = max(1, sum(pending.job is not None for pending in round_) + self.queue.qsize())

    def _gather(self, first: _Pending) -> tuple[list[_Pending], bool]:
        """``first``, what is queued already and, while fewer requests have come than expected, what arrives
        within ``max_wait`` of the start; within the token bound.

        Expected: the requests the last round answered (clients that wait for
        their answer send again right after it) and those that queued while it
        ran. A fixed wait counted from the oldest request took only the part
        of 32 such clients whose next requests had come, and left the rest to
        a round of their own (18.2 lines a round, 44.5 sentences/s; now 23.8
        lines, 50.9/s; benchmarks/README.md, "Serving").
        A lone client is never kept waiting: one request expected, one came.
        """
        round_, tokens = [first], first.tokens
        deadline = time.monotonic() + self.max_wait
        while tokens < self.max_batch_tokens and first.job is not None:
            try:
                remaining = deadline - time.monotonic() if len(round_) < self._expected else 0
                nxt = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return round_, True
            round_.append(nxt)
            tokens += nxt.tokens
        return round_, False

    def _translate(self, round_: list[_Pending]) -> None:
        """Each group of one decoding setting in one `translate_lines_nbest` call; calls run on their own."""
        groups: dict[tuple[tuple[str, ...], int, bool], list[_Pending]] = {}
        for pending in round_:
            if pending.job is None:
                self._run_call(pending)
            elif pending.future.set_running_or_notify_cancel():
                key = (pending.job.overrides, pending.job.nbest, pending.job.constraints is not None)
                groups.setdefault(key, []).append(pending)
        for (overrides, nbest, constrained), group in groups.items():
            try:
                results = self._results(
                    self.translator.with_decode(overrides), [p.job for p in group], nbest, constrained
                )
            except BaseException as err:  # the worker must outlive any request: its futures carry the error
                self.stats.errors += 1
                for pending in group:
                    pending.future.set_exception(err)
                continue
            self.stats.batches += 1
            start = 0
            for pending in group:
                n = len(pending.job.lines)
                pending.future.set_result(results[start : start + n])
                start += n
                self.stats.requests += 1
                self.stats.lines += n

    @staticmethod
    def _results(translator: Translator, jobs: list[Job], nbest: int, constrained: bool) -> list[list[Translation]]:
        """The translations of the lines of ``jobs`` (one decoding setting), in order: with their forced prefixes,
        or their constraints (`Translator.translate_constrained`)."""
        if constrained:
            return translator.translate_constrained([line for job in jobs for line in job.constrained_lines()], nbest)
        lines = [line for job in jobs for line in job.lines]
        prefixes = [p for job in jobs for p in job.prefixes or [""] * len(job.lines)]
        return translator.translate_lines_nbest(lines, nbest=nbest, prefixes=prefixes if any(prefixes) else None)

    @staticmethod
    def _run_call(pending: _Pending) -> None:
        if not pending.future.set_running_or_notify_cancel():
            return
        try:
            pending.future.set_result(pending.call())
        except BaseException as err:
            pending.future.set_exception(err)
