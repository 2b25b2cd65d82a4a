"""What `tmt serve` tells its operators: ``GET /metrics`` (Prometheus) and one access-log line per request.

`Observe` is ASGI middleware around the whole app (the gate of `keys`
included, so refused requests are counted and logged too): it times each
HTTP request, counts it by endpoint and status and writes its log line. The
worker's own counters (lines and tokens translated, the queue, the sentences
in the running search) are read from the batcher when Prometheus scrapes,
not copied on every request. Each app has its own registry: two apps in one
process (the tests) count apart.

A log line has the client, method, path (without its query string, where a
client may have put its key), status, duration and the lines the request
asked to translate: never the text, never a key.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

LOG_FORMATS = ("text", "json")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The registry of one app: requests by endpoint and status, their latency, and the batcher's counters."""

    def __init__(self, batcher: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "tmt_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "tmt_request_duration_seconds", "Time from a request's arrival to its answer, by endpoint",
            ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_BatcherCollector(batcher))

    async def route(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus text format."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _BatcherCollector:
    """The worker's counters as Prometheus reads them, at scrape time."""

    def __init__(self, batcher: Any) -> None:
        self.batcher = batcher

    def collect(self) -> Iterator[Any]:
        stats = self.batcher.stats
        for name, text, value in (
            ("tmt_lines_translated", "Lines translated", stats.lines),
            ("tmt_tokens_translated", "Source tokens (subwords, with EOS) of the lines translated", stats.tokens),
            ("tmt_batches", "Rounds, and joins of the running search", stats.batches),
            ("tmt_search_steps", "Steps of the running search", stats.steps),
            ("tmt_search_sentence_steps", "Sentences in the running search, summed over its steps", stats.sentence_steps),
            ("tmt_worker_errors", "Batches the model failed (their requests got 500)", stats.errors),
        ):  # fmt: skip
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("tmt_queue_depth", "Requests waiting for the worker", value=self.batcher.depth())
        yield GaugeMetricFamily(
            "tmt_search_sentences",
            "Sentences in the running search at its last step (the batch size)",
            value=stats.active,
        )


class Observe:
    """ASGI middleware: each HTTP request counted, timed and (when ``log`` is given) written as one line."""

    def __init__(
        self, app: Any, metrics: Metrics, endpoints: Iterable[str], log: Callable[[str], None] | None = None,
        log_format: str = "text",
    ) -> None:  # fmt: skip
        self.app, self.metrics, self.log, self.log_format = app, metrics, log, log_format
        self.endpoints = frozenset(endpoints)  # any other path is "other": the label's values stay few

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500  # what the client gets if the app raises before answering

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.record(scope, status, time.perf_counter() - start)

    def record(self, scope: dict, status: int, seconds: float) -> None:
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.latency.labels(endpoint).observe(seconds)
        if self.log is not None:
            lines = (scope.get("state") or {}).get("lines")
            self.log(access_line(self.log_format, scope, status, seconds, lines))


def access_line(log_format: str, scope: dict, status: int, seconds: float, lines: int | None) -> str:
    """One request as a line of text or one JSON object: time (UTC), client, method, path, status, duration and
    the lines asked for (None where the request was no translation or was refused before it was read)."""
    client = scope.get("client")
    entry = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "client": client[0] if client else "-", "method": scope["method"],
        "path": scope["path"].encode("unicode_escape").decode("ascii"),  # a decoded line break ends no line
        "status": status, "ms": round(1000 * seconds, 1), "lines": lines,
    }  # fmt: skip
    if log_format == "json":
        return json.dumps(entry)
    shown = "-" if lines is None else lines
    return (f"{entry['time']} {entry['client']} {entry['method']} {entry['path']} {status} {entry['ms']} ms "
            f"lines={shown}")  # fmt: skip
