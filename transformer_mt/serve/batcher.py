"""One worker thread owns the model and batches the lines of many requests together.

Requests arrive one by one on the event loop; a beam search is much cheaper
per line over many lines at once. `Batcher.submit` queues a request's lines
and returns a future at once. Each future gets exactly its own lines'
results, in order, whatever else shared the search: with tmt's fp32 search a
line's translation does not depend on its batch, so it equals `tmt
translate`'s.

With tmt's own search and the server's decoding settings, the batch is
continuous (`transformer_mt.decode.continuous`): at every step the worker
takes what has been queued, lets its lines join the running search (while
the search holds fewer than ``max_batch_tokens`` source tokens), and answers
each request the step its last line is done. A client that sends its next
sentence right after an answer joins at the next step instead of waiting
for a whole round to end, and a short sentence never waits behind a long
one (benchmarks/README.md, "Serving": 8 single-sentence clients 28 to 34
sentences/s, 32 clients 51 to 56).

Requests that need whole batches (a ``beam`` or ``len_penalty`` of their
own, forced prefixes, constraints) are translated between two steps, all
that are queued, as one round. Without a running search (``--engine
ctranslate2``) every request is decoded in rounds: the worker takes the
oldest and what is queued behind it and, while fewer have come than it
expects (`_gather`), waits at most ``max_wait_ms`` for more; never past
``max_batch_tokens`` source tokens. A round is translated with
`Translator.translate_encoded`, one group per decoding setting; constraints
form groups of their own. `submit` encodes a request once (`encode_job`):
its lines, prefixes and phrases, and its own settings applied to the
server's; `Encoded.joins` alone decides what joins the running search.
Model work never runs on the event loop, and the worker survives any error:
the failed group's futures get the exception, the others their results.

A server of several models (`transformer_mt.serve.models`) has one such
lane per model: `encode_job` routes a request to its model, each model has
its running search and its requests waiting to join it, and the one worker
steps every search that holds sentences in turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from transformer_mt.config import API_NAMES, mode_conflict
from transformer_mt.decode.continuous import ContinuousSearch
from transformer_mt.decode.search import Hypothesis
from transformer_mt.decode.translate import Translation, Translator
from transformer_mt.errors import UserError
from transformer_mt.serve.models import Models
from transformer_mt.serve.protocol import Job, RequestError


class QueueFull(Exception):
    """More requests are waiting than ``queue_size``: the server answers 429 with Retry-After."""


class ShuttingDown(Exception):
    """The server stopped taking work (SIGTERM or Ctrl-C); what was queued before still finishes."""


@dataclass(frozen=True)
class Encoded:
    """A job as the worker translates it, encoded once (`encode_job`): each line's source ids (ids and EOS, []
    for an empty line), forced prefix ids and constraint phrases, and the translator that decodes it with the
    job's own settings (the model's translator itself when it asks for none); ``lane``: which of the server's
    models it goes to (`Models.route`)."""

    translator: Translator
    nbest: int
    sources: list[list[int]]
    prefixes: list[list[int]] | None = None
    phrases: list[list[list[int]]] | None = None
    lane: int = 0

    @property
    def tokens(self) -> int:
        return sum(map(len, self.sources))

    def joins(self, server: Translator) -> bool:
        """Whether it can join the running search of its model ``server``: the one place that decides. Only a
        job with the server's own settings (toward any direction: a model of several reads the target in the
        source ids), no prefixes and no constraints; the others are translated in rounds."""
        same = self.translator.cfg is server.cfg and self.translator.engine_search is server.engine_search
        return same and self.prefixes is None and self.phrases is None


def encode_job(models: Models, job: Job) -> Encoded:
    """``job`` encoded with its model's BPE model (`Models.route`), each line once, and its settings applied and
    checked: a request that cannot be translated is refused here (a 400 `RequestError` naming the field), not
    in the batch it would join."""
    lane = models.route(*job.languages)
    with _refused(None):
        translator = models.translators[lane].with_decode(job.decode)
    with _refused("target"):
        translator = translator.toward(*job.languages, where="'source'/'target'", any_source=True)
    conflict = mode_conflict(
        translator.mode(job.nbest, job.constraints is not None, any(job.prefixes or [])), API_NAMES
    )
    if conflict is not None:
        raise RequestError(400, conflict[1], conflict[0])
    sources = [translator.encode(i, line) for i, line in enumerate(job.lines)]
    prefixes = phrases = None
    if any(job.prefixes or []):
        prefixes = []
        for i, (text, source) in enumerate(zip(job.prefixes or [], sources, strict=True)):
            with _refused(f"prefixes[{i}]"):
                prefixes.append(translator.encode_prefix(i, text, source, origin="prefixes"))
    if job.constraints is not None:
        phrases = []
        for i, (texts, source) in enumerate(zip(job.constraints, sources, strict=True)):
            with _refused(f"constraints[{i}]"):
                phrases.append(translator.encode_constraints(texts, source, f"constraints[{i}]"))
    return Encoded(translator, job.nbest, sources, prefixes, phrases, lane)


@contextlib.contextmanager
def _refused(field: str | None) -> Iterator[None]:
    """A UserError inside as a 400 about ``field``, its message on one line."""
    try:
        yield
    except UserError as err:
        raise RequestError(400, " ".join(str(err).split()), field) from None


@dataclass
class _Pending:
    job: Encoded | None  # None: ``call`` is run instead (other model work, such as an attention map)
    future: Future
    call: Callable[[], Any] | None = None

    @property
    def tokens(self) -> int:
        return 0 if self.job is None else self.job.tokens


@dataclass(eq=False)
class _Joined:
    """A request whose lines are in (or waiting for) the continuous search: its results as they come."""

    pending: _Pending
    sources: list[list[int]]  # the ids of the lines still to join the search (emptied when they join)
    results: list[list[Translation] | None]
    left: int  # lines not answered yet
    todo: list[int] = field(default_factory=list)  # the lines in ``sources``

    @property
    def tokens(self) -> int:
        return sum(map(len, self.sources))


@dataclass(eq=False)
class _Lane:
    """One model's share of the worker: its translator, its running search (None: in rounds) and the requests
    waiting to join it."""

    translator: Translator
    search: ContinuousSearch | None
    waiting: deque[_Joined] = field(default_factory=deque)


@dataclass
class Stats:
    """What `GET /health` reports about the worker."""

    requests: int = 0
    lines: int = 0
    batches: int = 0  # rounds, and joins of the continuous search (each took in new requests)
    errors: int = 0
    steps: int = 0  # steps of the continuous search
    sentence_steps: int = 0  # sentences in the continuous search, summed over its steps
    tokens: int = 0  # source tokens of the lines answered (with EOS)
    active: int = 0  # sentences in the continuous search at its last step (its batch size now)


class Batcher:
    """The queue and the one worker; `start` it on a thread (or `run` it), `submit` jobs, `close` to finish.
    ``models``: one translator, or the server's `Models`."""

    def __init__(
        self,
        models: Translator | Models,
        max_batch_tokens: int,
        max_wait_ms: float,
        queue_size: int,
        continuous: bool = True,
    ) -> None:
        self.models = models if isinstance(models, Models) else Models([models])
        self.translator = self.models.first  # the server's settings
        for translator in self.models.translators:
            translator.show_progress = False
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=queue_size)
        self.stats = Stats()
        self._closed = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()  # submit's check of _closed and its put, against close's
        self._expected = 1  # requests the worker waits for, within max_wait (`_gather`)
        # search None: every request in rounds (another engine, or settings that need whole batches;
        # `continuous_search`); the models share their settings, so all have a search or none
        self.lanes = [_Lane(t, t.continuous_search() if continuous else None) for t in self.models.translators]
        self.continuous = self.lanes[0].search is not None

    @property
    def search(self) -> ContinuousSearch | None:
        """The first model's running search (the only one of a server of one model), or None."""
        return self.lanes[0].search

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
        """Queue ``job``, encoded once (`encode_job`, whose UserError refuses it here); the future's result is
        one n-best list (``job.nbest`` `Translation`s) per line."""
        return self._put(_Pending(encode_job(self.models, job), Future()))

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
        if not self.continuous:
            return self._run_rounds()
        stop = False
        while not stop or self._busy():
            if not stop:
                stop = self._take(block=not self._busy())
            for lane in self.lanes:
                self._join(lane)
                if lane.search.active:
                    self._step(lane)
        return None

    def _busy(self) -> bool:
        """Whether a search holds sentences or requests wait to join one."""
        return any(lane.search.active or lane.waiting for lane in self.lanes)

    def _run_rounds(self) -> None:
        stop = False
        while not stop:
            first = self.queue.get()
            if first is None:
                return
            round_, stop = self._gather(first)
            self._translate(round_)
            # the clients just answered, likely to send again, and those that queued meanwhile
            self._expected = max(1, sum(pending.job is not None for pending in round_) + self.queue.qsize())

    # -- the continuous search

    def _take(self, block: bool) -> bool:
        """Take what is queued (waiting for the first when ``block``): lines for the continuous search wait to
        join it; the other requests are translated in a round now. True once the queue's end (close) is seen."""
        try:
            item = self.queue.get() if block else self.queue.get_nowait()
        except queue.Empty:
            return False
        taken: list[_Pending] = []
        while item is not None:
            taken.append(item)
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
        rounds = [pending for pending in taken if not self._joins(pending)]
        if rounds:
            self._translate(rounds)
        return item is None

    def _joins(self, pending: _Pending) -> bool:
        """Queue ``pending`` to join the continuous search, if it can: a request with the server's settings."""
        job = pending.job
        if job is None or not job.joins(self.lanes[job.lane].translator):
            return False
        if not pending.future.set_running_or_notify_cancel():
            return True  # cancelled: nothing to do
        sources = job.sources
        empty = [Translation("", 0.0, 0.0)] * job.nbest
        todo = [i for i, ids in enumerate(sources) if ids]
        results: list[list[Translation] | None] = [None if ids else empty for ids in sources]
        joined = _Joined(pending, [sources[i] for i in todo], results, len(todo), todo)
        if todo:
            self.lanes[job.lane].waiting.append(joined)
        else:
            self._answer(joined)
        return True

    def _join(self, lane: _Lane) -> None:
        """Let the waiting requests join ``lane``'s search, oldest first, while it holds fewer than
        max_batch_tokens source tokens (one request always: an empty search takes the oldest whatever its
        length)."""
        sources: list[list[int]] = []
        keys: list[tuple[_Joined, int]] = []
        waiting, load = lane.waiting, lane.search.load
        while waiting and (not load or load + waiting[0].tokens <= self.max_batch_tokens):
            joined = waiting.popleft()
            load += joined.tokens
            sources += joined.sources
            keys += [(joined, i) for i in joined.todo]
            joined.sources = []
        if not sources:
            return
        try:
            lane.search.add(sources, keys)
        except BaseException as err:  # out of memory: the search may hold half of them, so it starts afresh
            self._fail(err, lane, [key[0] for key in keys])
            return
        self.stats.batches += 1

    def _step(self, lane: _Lane) -> None:
        """One step of ``lane``'s search; the requests whose last line is done now get their results. A failed
        step fails every request in that search, and the worker goes on."""
        search = lane.search
        active = search.active
        try:
            done: list[tuple[Any, list[Hypothesis]]] = search.step()
        except BaseException as err:  # the worker must outlive any request: their futures carry the error
            self._fail(err, lane)
            return
        self.stats.steps += 1
        self.stats.sentence_steps += active
        self.stats.active = sum(other.search.active for other in self.lanes)
        for (joined, line), hyps in done:
            joined.results[line] = lane.translator.translations(hyps, joined.pending.job.nbest)
            joined.left -= 1
            if joined.left == 0:
                self._answer(joined)
        if not search.active:
            lane.translator.freed.release()  # what the search freed goes back to the system while idle

    def _fail(self, err: BaseException, lane: _Lane, joining: Sequence[_Joined] = ()) -> None:
        """Give ``err`` to the requests in ``lane``'s search (emptied) and to those ``joining`` it, each once."""
        self.stats.errors += 1
        failed = dict.fromkeys([*(key[0] for key in lane.search.clear()), *joining])  # once each, in order
        self.stats.active = sum(other.search.active for other in self.lanes)
        for joined in failed:
            if not joined.pending.future.done():
                joined.pending.future.set_exception(err)

    def _answer(self, joined: _Joined) -> None:
        self.stats.requests += 1  # counted first: a client that has its answer finds it in /health
        self.stats.lines += len(joined.results)
        self.stats.tokens += joined.pending.tokens
        joined.pending.future.set_result(joined.results)

    # -- rounds

    def _gather(self, first: _Pending) -> tuple[list[_Pending], bool]:
        """``first``, what is queued already and, while fewer requests have come than expected, what arrives
        within ``max_wait`` of the start; within the token bound.

        Expected: the requests the last round answered (clients that wait for
        their answer send again right after it) and those that queued while it
        ran (benchmarks/README.md, "Serving", measured it against a fixed
        wait). A lone client is never kept waiting: one request expected, one came.
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
        groups: dict[tuple[int, tuple[Any, ...], int, bool], list[_Pending]] = {}
        for pending in round_:
            if pending.job is None:
                self._run_call(pending)
            elif pending.future.set_running_or_notify_cancel():
                job = pending.job
                key = (job.lane, dataclasses.astuple(job.translator.cfg.decode), job.nbest, job.phrases is not None)
                groups.setdefault(key, []).append(pending)
        for (_, _, nbest, _), group in groups.items():
            try:
                results = self._results([p.job for p in group if p.job is not None], nbest)
            except BaseException as err:  # the worker must outlive any request: its futures carry the error
                self.stats.errors += 1
                for pending in group:
                    pending.future.set_exception(err)
                continue
            self.stats.batches += 1
            start = 0
            for pending in group:
                n = len(pending.job.sources)
                self.stats.requests += 1
                self.stats.lines += n
                self.stats.tokens += pending.tokens
                pending.future.set_result(results[start : start + n])
                start += n

    @staticmethod
    def _results(jobs: list[Encoded], nbest: int) -> list[list[Translation]]:
        """The translations of the lines of ``jobs`` (one model and decoding setting, the first job's translator), in
        order, with their forced prefixes or their constraints (`Translator.translate_encoded`)."""
        sources = [ids for job in jobs for ids in job.sources]
        prefixes = phrases = None
        if any(job.prefixes is not None for job in jobs):
            prefixes = [p for job in jobs for p in job.prefixes or [[]] * len(job.sources)]
        if jobs[0].phrases is not None:  # a group has constraints in every job or in none
            phrases = [p for job in jobs for p in job.phrases or []]
        return jobs[0].translator.translate_encoded(sources, nbest, prefixes, phrases)

    @staticmethod
    def _run_call(pending: _Pending) -> None:
        if not pending.future.set_running_or_notify_cancel():
            return
        try:
            pending.future.set_result(pending.call())
        except BaseException as err:
            pending.future.set_exception(err)
