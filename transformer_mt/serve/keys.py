"""API keys and request limits of `tmt serve`: the keys file, a sliding-window limiter, and the ASGI gate.

With ``--api-keys FILE``, every request but the open paths (`OPEN_PATHS`)
carries a key listed in the file, as LibreTranslate's clients send it: an
``api_key`` field of the JSON body, of a form body or of the query string.
Without one the answer is 403. A key with its own limit (``KEY 60``) is held
to that many requests a minute, wherever it comes from; a key without one,
and every request of a server without keys, to ``--req-limit`` requests a
minute per client address. Beyond either, 429 with ``Retry-After``.

The gate is ASGI middleware in front of the routes, so the handlers never
see a refused request, and it reads the key from a copy of the body that
it then hands on unchanged. Keys are compared in constant time and never
written anywhere (the access log writes the path without its query).
"""

from __future__ import annotations

import hmac
import json
import math
import time
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer_mt.errors import UserError
from transformer_mt.serve.protocol import RequestError, body_in_time, declared_over

WINDOW_S = 60.0  # limits are requests per minute
OPEN_PATHS = frozenset({"/", "/health", "/languages", "/frontend/settings", "/metrics"})  # no key, no limit
OPEN_PREFIXES = ("/download_file/",)  # a translated file: its name, unguessable, is the key (as LibreTranslate has it)


def is_open(path: str) -> bool:
    """Whether ``path`` needs no key and counts against no limit."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class KeysFileError(UserError):
    """A keys file that cannot be read or has a malformed line: one line naming the file and the line."""


def read_keys(path: Path) -> dict[str, int | None]:
    """Each key of ``path`` and its own requests per minute (None: the server's ``--req-limit``).

    A line is ``KEY`` or ``KEY LIMIT``; ``#`` starts a comment, blank lines
    are skipped. Anything else (a third word, a limit that is no positive
    integer, a key given twice) stops the server before it starts, rather
    than leaving a client locked out by a typo nobody sees.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KeysFileError(f"--api-keys {path}: cannot read it ({err})") from None
    keys: dict[str, int | None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--api-keys {path}, line {number}"
        if len(words) > 2 or (len(words) == 2 and not (words[1].isdigit() and int(words[1]) > 0)):
            raise KeysFileError(f"{where}: expected 'KEY' or 'KEY REQUESTS_PER_MINUTE', got {len(words)} words")
        if words[0] in keys:
            raise KeysFileError(f"{where}: this key is given twice")
        keys[words[0]] = int(words[1]) if len(words) == 2 else None
    if not keys:
        raise KeysFileError(f"--api-keys {path}: no key in it (a key per line)")
    return keys


class Limiter:
    """At most ``limit`` requests per `WINDOW_S` for each name (a key or an address), a sliding window.

    Each name keeps the times of its requests in the window (at most its
    limit of them); names are kept in the order they were last seen, and at
    most ``max_names`` of them: the oldest is dropped first (a name not seen
    for a window has nothing left to count anyway), so a flood of addresses
    costs bounded memory. ``clock`` is injectable for tests.
    """

    def __init__(self, max_names: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_names, self.clock = max_names, clock
        self.seen: OrderedDict[str, deque[float]] = OrderedDict()

    def admit(self, name: str, limit: int) -> float:
        """0 when ``name`` may make one more request now (it is counted), else the seconds until it may."""
        now = self.clock()
        times = self.seen.pop(name, None) or deque()
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        wait = 0.0 if len(times) < limit else times[0] + WINDOW_S - now
        if not wait:
            times.append(now)
        self.seen[name] = times  # last seen: the newest end
        while len(self.seen) > self.max_names:
            self.seen.popitem(last=False)
        return wait


def api_key(query: str, content_type: str, body: bytes) -> str | None:
    """The ``api_key`` of a request, where LibreTranslate's clients put it: the query string, a JSON body or a
    form body (url-encoded or multipart); None when it has none (or a body that is no JSON or form: the route
    refuses it)."""
    found = urllib.parse.parse_qs(query).get("api_key")
    if found:
        return found[0]
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == "application/x-www-form-urlencoded":
        found = urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("api_key")
        return found[0] if found else None
    if kind == "multipart/form-data":
        return _multipart_field(content_type, body, "api_key")
    try:
        raw = json.loads(body)
    except ValueError:
        return None
    key = raw.get("api_key") if isinstance(raw, dict) else None
    return key if isinstance(key, str) else None


def _multipart_field(content_type: str, body: bytes, name: str) -> str | None:
    """One text field of a multipart body, parsed by python-multipart (the parser starlette's forms use)."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    boundary = parse_options_header(content_type)[1].get(b"boundary")
    if not boundary:
        return None
    found: dict[str, Any] = {"name": None, "value": b"", "done": None}

    def on_header_value(data: bytes, start: int, end: int) -> None:
        options = parse_options_header(data[start:end])[1]
        if b"name" in options:
            found["name"] = options[b"name"].decode("utf-8", "replace")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if found["name"] == name and found["done"] is None:
            found["value"] += data[start:end]

    def on_part_end() -> None:
        if found["name"] == name and found["done"] is None:
            found["done"] = found["value"].decode("utf-8", "replace")

    callbacks = {"on_header_value": on_header_value, "on_part_data": on_part_data, "on_part_end": on_part_end}
    try:
        MultipartParser(boundary, callbacks).write(body)
    except Exception:  # a malformed body: no key; the route says what is wrong with it
        return None
    return found["done"]


@dataclass(frozen=True)
class Policy:
    """Who may call the guarded routes: ``keys`` (None: no keys asked) with their own limits, and ``req_limit``
    requests per minute per address (0: none) for keyless servers and keys without a limit of their own."""

    keys: dict[str, int | None] | None = None
    req_limit: int = 0

    def __bool__(self) -> bool:
        return self.keys is not None or self.req_limit > 0

    def find(self, given: str | None) -> str | None:
        """The listed key equal to ``given``, compared with every key in constant time (no early exit either:
        the time says nothing about which key came close)."""
        if given is None:
            return None
        match = None
        for key in self.keys or ():
            if hmac.compare_digest(key.encode(), given.encode()):
                match = key
        return match


class OverLimit(RequestError):
    """A 429 past a limit, with the whole seconds until the oldest request in the window leaves it."""

    def __init__(self, limit: int, wait: float) -> None:
        self.retry_after = max(1, math.ceil(wait))
        super().__init__(429, f"over {limit} requests per minute; retry after {self.retry_after} s")


class Gate:
    """ASGI middleware: the guarded requests of `Policy`, refused (403, 429) before the routes see them."""

    def __init__(self, app: Any, policy: Policy, body_limit: int, limiter: Limiter | None = None) -> None:
        self.app, self.policy, self.body_limit = app, policy, body_limit
        self.limiter = limiter or Limiter()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        guarded = scope["type"] in ("http", "websocket") and not is_open(scope["path"])
        if not guarded or scope.get("method") == "OPTIONS":  # a CORS preflight carries no key
            await self.app(scope, receive, send)
            return
        try:
            body, receive = await self._body(scope, receive)
            self.check(scope, body)
        except RequestError as err:
            await _refuse(scope, send, err)
            return
        await self.app(scope, receive, send)

    def check(self, scope: dict, body: bytes) -> None:
        """403 without a valid key (when keys are asked), 429 past the key's or the address's limit."""
        policy, limit, name = self.policy, self.policy.req_limit, f"address {_client(scope)}"
        if policy.keys is not None:
            headers = dict(scope.get("headers") or [])
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            key = policy.find(api_key(scope.get("query_string", b"").decode("latin-1"), content_type, body))
            if key is None:
                raise RequestError(403, "a valid api_key is required: send it as the api_key field", "api_key")
            if (own := policy.keys[key]) is not None:
                limit, name = own, f"key {key}"
        if limit and (wait := self.limiter.admit(name, limit)):
            raise OverLimit(limit, wait)

    async def _body(self, scope: dict, receive: Any) -> tuple[bytes, Any]:
        """The body, when keys are asked (the key may be in it), and a ``receive`` that hands it to the route as
        if unread. As the routes read theirs: 413 past the body limit (before reading when the declared length
        says so), 408 when it takes more than `protocol.BODY_TIMEOUT_S` to arrive."""
        if self.policy.keys is None or scope["type"] != "http":
            return b"", receive
        too_large = RequestError(413, f"the request body is over {self.body_limit} bytes; send less per request")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared_over(declared.decode("latin-1"), self.body_limit):
            raise too_large
        messages: list[dict] = []
        await body_in_time(_gather(receive, messages, self.body_limit))
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if len(body) > self.body_limit:
            raise too_large

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        return body, replay


async def _gather(receive: Any, messages: list[dict], limit: int) -> None:
    """The messages of a body into ``messages``, until its end, a disconnect, or more than ``limit`` bytes."""
    size = 0
    while True:
        messages.append(await receive())
        if messages[-1]["type"] != "http.request":
            return
        size += len(messages[-1].get("body", b""))
        if not messages[-1].get("more_body", False) or size > limit:
            return


async def _refuse(scope: dict, send: Any, err: RequestError) -> None:
    """``err`` as LibreTranslate's error answer (a WebSocket: closed before it is accepted, HTTP 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})
        return
    headers = [(b"content-type", b"application/json")]
    if err.status in (408, 413):  # what the client still sends is no next request
        headers.append((b"connection", b"close"))
    if isinstance(err, OverLimit):
        headers.append((b"retry-after", str(err.retry_after).encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(err.body()).encode()})


def _client(scope: dict) -> str:
    client = scope.get("client")
    return client[0] if client else "?"
