"""The HTTP and WebSocket face of `tmt serve`: a thin starlette app over `Batcher` and `protocol`.

Handlers parse and check a request (`protocol`), hand its lines to the
batcher and await the future, so the event loop only moves bytes. The app
keeps no state between requests beyond counters: replicas behind any load
balancer answer alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from transformer_mt.attention_maps import AttentionError, translator_attention
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import UserError
from transformer_mt.serve.batcher import Batcher, QueueFull, ShuttingDown
from transformer_mt.serve.detect import LanguageDetector
from transformer_mt.serve.keys import Gate, Policy
from transformer_mt.serve.models import Models
from transformer_mt.serve.observe import Metrics, Observe
from transformer_mt.serve.protocol import (
    Job,
    Limits,
    RequestError,
    body_in_time,
    check_languages,
    check_size,
    declared_over,
    languages,
    libre_response,
    parse_json,
    parse_libre,
    parse_v1,
    v1_response,
)
from transformer_mt.serve.wire import fields

RETRY_AFTER_S = 1  # what a 429 asks a client to wait
KEPT_FILES = 64  # translated files kept for /download_file, the oldest dropped first: docs/serving.md, "Files"
FILE_TYPES = {".txt": ("text", "text/plain; charset=utf-8"), ".html": ("html", "text/html; charset=utf-8"),
              ".htm": ("html", "text/html; charset=utf-8")}  # fmt: skip
SUPPORTED = [".txt", ".html"]  # what /frontend/settings offers LibreTranslate's clients (.htm is taken too)
logger = logging.getLogger("uvicorn.error")  # one line per event, beside the server's own


def refusal(err: RequestError) -> JSONResponse:
    """The JSON error answer of ``err``; a full queue (429) also says when to retry. A body refused before it was
    read whole (408, 413) also closes the connection: what the client still sends is no next request."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else {}
    if err.status in (408, 413):
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@dataclass
class ServerInfo:
    """What `GET /health` and the demo page say about the model behind the server."""

    model: str
    engine: str
    device: str
    quantize: str
    threads: str = ""  # the CPU threads the model runs on and why (`transformer_mt.cpus.Threads.why`)
    started: float = field(default_factory=time.monotonic)


def build_app(
    batcher: Batcher, info: ServerInfo, limits: Limits, start_worker: bool = True, policy: Policy | None = None,
    log: Any = None, log_format: str = "text", cors_origins: Sequence[str] = (),
) -> Starlette:  # fmt: skip
    """The app: routes over ``batcher``; its lifespan starts the worker (unless ``start_worker`` is False: the
    caller runs it) and, at shutdown, lets it finish. In front of the routes, outermost first: CORS for pages
    served from ``cors_origins`` (``*``: any; from no other origin, as a browser's same-origin policy has it by
    default), `Observe` (every request counted for ``/metrics`` and, when ``log`` is given, written as one line
    to it) and, when ``policy`` asks for keys or limits, its `Gate`."""
    handlers = _Handlers(batcher, info, limits, start_worker, keyed=policy is not None and policy.keys is not None)
    metrics = Metrics(batcher)
    routes = [*handlers.routes(), Route("/metrics", metrics.route)]
    paths = [route.path for route in routes]
    cors = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"], max_age=600)] if cors_origins else []  # fmt: skip
    middleware = [*cors, Middleware(Observe, metrics=metrics, endpoints=paths, log=log, log_format=log_format)]
    if policy:  # None or a policy of no keys and no limit: nothing to check
        middleware.append(Middleware(Gate, policy=policy, body_limit=limits.body_bytes()))
    return Starlette(routes=routes, middleware=middleware, lifespan=handlers.lifespan)


class _Handlers:
    """The route handlers of one app and the state they share: the batcher, what `/health` says, the limits and
    the model's config. Methods of one object rather than closures in `build_app`, so that each is short and
    named; the state is only what the app was built with (no state between requests beyond the batcher's
    counters)."""

    def __init__(
        self, batcher: Batcher, info: ServerInfo, limits: Limits, start_worker: bool, keyed: bool = False
    ) -> None:
        self.batcher, self.info, self.limits, self.start_worker = batcher, info, limits, start_worker
        self.keyed = keyed  # requests need an api_key (--api-keys): /frontend/settings says so
        self.cfg = batcher.translator.cfg  # the server's decoding settings (every model's: `Models`)
        self.langs = batcher.models.languages
        self.detector = LanguageDetector(list(self.langs.sources))  # source "auto", /detect
        self.files: OrderedDict[str, bytes] = OrderedDict()  # /translate_file's results, at most KEPT_FILES

    def routes(self) -> list[Route | WebSocketRoute]:
        """The paths the server answers: the demo page, LibreTranslate's, tmt's own, the WebSocket."""
        return [
            Route("/", self.page), Route("/languages", self.languages_route), Route("/health", self.health),
            Route("/frontend/settings", self.frontend_settings), Route("/translate", self.translate_libre, methods=["POST"]),
            Route("/detect", self.detect, methods=["POST"]),
            Route("/translate_file", self.translate_file, methods=["POST"]),
            Route("/download_file/{name}", self.download_file),
            Route("/v1/translate", self.translate_v1, methods=["POST"]),
            Route("/v1/attention", self.attention, methods=["POST"]), WebSocketRoute("/ws", self.websocket),
        ]  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The worker starts with the app; at shutdown, after in-flight requests are answered, it finishes."""
        if self.start_worker:
            self.batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.batcher.close)

    async def submit(self, job: Job) -> list:
        """``job``'s translations, in two jobs through the pivot where `Models.legs` says so: the first leg's
        translation of each line is the second's line, and prefixes, constraints and n-best bind the second, the
        target's (an n-best list on the first would multiply the second's work for one answer per line)."""
        job = self.with_source(job)
        legs = self.batcher.models.legs(*job.languages)
        if len(legs) == 2:
            if job.decode.get("alignment", self.cfg.decode.alignment) != "none":
                raise RequestError(
                    400, f"{'-'.join(map(str, job.languages))} is translated through {legs[0][1]!r} here, so its "
                    "translation has no word alignment with the source: send 'format' 'text' (on /v1/translate, "
                    "no 'alignment')", "format" if job.decode.get("alignment") == "soft" else "alignment",
                )  # fmt: skip
            first = await self.queue(Job(job.lines, decode=job.decode, languages=legs[0]))
            job = dataclasses.replace(job, lines=[hyps[0].text for hyps in first], languages=legs[1])
        return await self.queue(job)

    def with_source(self, job: Job) -> Job:
        """``job`` with its source detected, when it left the source open and the server pivots: whether a
        request goes through the pivot depends on its source, which the model alone never needs (it reads the
        target tag). Lines found in the target's own language, or in one not served into it, leave it open;
        lines found in several languages, one of which would go through the pivot, are a 400 asking for it."""
        models, (source, target) = self.batcher.models, job.languages
        if source is not None or target is None or models.pivot is None:
            return job
        found = {self.detector.detect(line)["language"] for line in job.lines if line.strip()}
        found = {lang for lang in found if lang != target and (lang, target) in self.langs.pairs}
        if len(found) == 1:
            return dataclasses.replace(job, languages=(found.pop(), target))
        if any(len(models.legs(lang, target)) == 2 for lang in found):
            raise RequestError(
                400, f"the lines were found in {', '.join(sorted(found))}, which this server translates into "
                f"{target!r} by different routes (through {models.pivot!r} or not): name 'source', or send one "
                "language per request", "source",
            )  # fmt: skip
        return job

    async def queue(self, job: Job) -> list:
        """``job``'s translations from the worker; a full queue (429) or a closing server (503) is the client's to
        retry."""
        try:
            future = self.batcher.submit(job)
        except QueueFull as err:
            raise RequestError(429, f"the server is busy ({err}); retry after {RETRY_AFTER_S} s") from None
        except ShuttingDown as err:
            raise RequestError(503, f"{err}; retry on another replica") from None
        return await asyncio.wrap_future(future)

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON body of tmt's own API (`read`)."""
        return parse_json(await self.read(request))

    async def fields(self, request: Request) -> dict[str, Any]:
        """The fields of a request to LibreTranslate's API, from a JSON, form or multipart body (`read`) and the
        query string alike, as its clients send them (`wire.fields`); ``api_key`` among them."""
        body = await self.read(request)
        return fields(request.headers.get("content-type", ""), body, request.query_params.multi_items())

    async def read(self, request: Request) -> bytes:
        """The body, read no further than the limits allow (413 past them, before reading when the declared
        Content-Length says so) and in time (408, `protocol.body_in_time`)."""
        limit = self.limits.body_bytes()
        declared = request.headers.get("content-length", "")
        if declared_over(declared, limit):
            raise RequestError(413, f"the request body is over {limit} bytes; send less per request")
        try:
            return await body_in_time(_read(request, limit))
        except ClientDisconnect:  # nobody is left to answer: the status is for the log
            raise RequestError(400, "the client left before sending the whole body") from None

    async def answer(self, parse: Any, request: Request, respond: Any, libre: bool = False) -> Response:
        """``respond(parse(body))`` as JSON (the body's fields, for LibreTranslate's API: ``libre``); a refused request, or a decoding setting the config refuses, is
        its JSON error answer: one place for both translation routes to turn errors into statuses."""
        try:
            parsed = parse(await (self.fields(request) if libre else self.body(request)))
            request.state.lines = len(parsed.job.lines)  # for the access log
            return JSONResponse(await respond(parsed))
        except RequestError as err:
            return refusal(err)
        except UserError as err:  # what only the model can tell (a line it cannot encode): the client's to fix
            return refusal(RequestError(400, " ".join(str(err).split())))

    async def translate_libre(self, request: Request) -> Response:
        """``POST /translate``, LibreTranslate's API."""
        return await self.answer(
            lambda raw: parse_libre(raw, self.cfg, self.limits, self.detector, self.langs),
            request,
            self.libre,
            libre=True,
        )

    async def detect(self, request: Request) -> Response:
        """``POST /detect``, LibreTranslate's: the language of ``q`` among the model's sources, as a list of
        candidates (the likeliest); for a list of texts, one such list per text."""
        try:
            q = (await self.fields(request)).get("q")
            texts = [q] if isinstance(q, str) else q
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise RequestError(400, "'q' must be a string or a list of strings", "q")
            check_size(texts, self.limits, "q")
        except RequestError as err:
            return refusal(err)
        found = [[self.detector.detect(text)] for text in texts]
        return JSONResponse(found[0] if isinstance(q, str) else found)

    async def libre(self, parsed: Any) -> dict[str, Any]:
        if parsed.documents is not None:
            mode = self.batcher.translator.mode()
            if mode.engine != "pytorch" or mode.ensemble:
                raise RequestError(
                    400, "'format' 'html' places tags by word alignment, which needs one tmt model: this server "
                    f"runs {'an ensemble' if mode.ensemble else 'the ' + mode.engine + ' engine'}", "format",
                )  # fmt: skip
        return libre_response(parsed, await self.submit(parsed.job))

    async def translate_file(self, request: Request) -> Response:
        """``POST /translate_file``, LibreTranslate's: a multipart ``file`` (.txt or .html, UTF-8) with ``source``
        and ``target``, translated as ``q`` with format "text" or "html" would be; the answer is the URL to
        download it from, kept until `KEPT_FILES` newer ones push it out."""
        try:
            name, raw = await self.upload(request)
            parsed = parse_libre(raw, self.cfg, self.limits, self.detector, self.langs)
            request.state.lines = len(parsed.job.lines)  # for the access log
            text = (await self.libre(parsed))["translatedText"]
        except RequestError as err:
            return refusal(err)
        except UserError as err:
            return refusal(RequestError(400, " ".join(str(err).split())))
        key = f"{uuid.uuid4().hex}.{name}"
        self.files[key] = text.encode("utf-8")
        while len(self.files) > KEPT_FILES:
            self.files.popitem(last=False)
        return JSONResponse({"translatedFileUrl": str(request.url_for("download_file", name=key))})

    async def upload(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The uploaded file's name and the request as `parse_libre` takes it (``q`` the file's text, ``format``
        from its extension): 413 past the body limit, 400 for a form without a file, another extension, or a
        file that is not UTF-8."""
        limit = self.limits.body_bytes()
        declared = request.headers.get("content-length", "")
        if declared_over(declared, limit):
            raise RequestError(413, f"the file is over {limit} bytes; split it and send the parts", "file")
        try:
            form = await body_in_time(request.form(max_files=1, max_fields=8, max_part_size=limit))
        except (HTTPException, MultiPartException, ClientDisconnect) as err:
            raise RequestError(400, f"the form could not be read ({getattr(err, 'detail', None) or err}); send "
                               "multipart/form-data with a 'file' field", "file") from None  # fmt: skip
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise RequestError(400, "missing 'file': send the document as a multipart/form-data file field", "file")
        name = (upload.filename or "").rsplit("/", 1)[-1].rsplit("\\", 1)[-1]
        ext = name[name.rfind(".") :].lower() if "." in name else ""
        if ext not in FILE_TYPES:
            raise RequestError(
                400, f"file {name!r}: this server translates {', '.join(FILE_TYPES)} files; rename a plain-text "
                "file to .txt", "file",
            )  # fmt: skip
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise RequestError(413, f"the file is over {limit} bytes; split it and send the parts", "file")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError(
                400, f"file {name!r} is not UTF-8 (byte {err.start}); save it as UTF-8 and send it again", "file"
            ) from None
        fields = {key: value for key, value in form.items() if isinstance(value, str) and key in ("source", "target")}
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        return safe, {**fields, "q": text, "format": FILE_TYPES[ext][0]}

    async def download_file(self, request: Request) -> Response:
        """``GET /download_file/<name>``: a translated file, while it is kept (404 after)."""
        name = request.path_params["name"]
        data = self.files.get(name)
        if data is None:
            return refusal(RequestError(404, f"no file {name!r}: translated files are kept for the last "
                                        f"{KEPT_FILES} uploads; translate it again", "name"))  # fmt: skip
        ext = name[name.rfind(".") :].lower()
        return Response(data, media_type=FILE_TYPES[ext][1],
                        headers={"Content-Disposition": attachment(name.split(".", 1)[1])})  # fmt: skip

    async def translate_v1(self, request: Request) -> Response:
        """``POST /v1/translate``, tmt's own API (decoding settings, prefixes, constraints, n-best)."""
        mode = self.batcher.translator.mode()
        return await self.answer(
            lambda raw: parse_v1(raw, self.cfg, self.limits, mode.engine, mode.ensemble, self.langs), request, self.v1
        )

    async def v1(self, parsed: Any) -> dict[str, Any]:
        return v1_response(await self.submit(parsed.job))

    async def attention(self, request: Request) -> Response:
        """The demo page's heat map: one sentence's cross-attention, mean over the heads of one layer (toward the
        request's ``target``, for a model of several directions)."""
        try:
            raw = await self.body(request)
            text, layer = attention_request(raw)
            source, target = check_languages(raw, self.langs, None)
            legs = self.batcher.models.legs(source, target)
            if len(legs) == 2:
                raise RequestError(
                    400, f"{source}-{target} is translated through {legs[0][1]!r} here: ask for the attention of "
                    f"one leg, {source}-{legs[0][1]} or {legs[0][1]}-{target}", "target",
                )  # fmt: skip
            model = self.batcher.models.translators[self.batcher.models.route(source, target)]
            toward = model.toward(source, target, any_source=True)
            found = await self.attend(toward, text, layer)
        except RequestError as err:
            return refusal(err)
        except AttentionError as err:
            return refusal(RequestError(400, str(err).replace("--", ""), "text"))
        return JSONResponse(attention_response(found))

    async def attend(self, translator: Translator, text: str, layer: int | None) -> Any:
        """The attention of ``text`` computed on the worker thread, where the model is used, never beside a batch."""
        try:
            return await asyncio.wrap_future(
                self.batcher.call(lambda: translator_attention(translator, text, "cross", layer, name=self.info.model))
            )
        except (QueueFull, ShuttingDown) as err:
            raise RequestError(429 if isinstance(err, QueueFull) else 503, str(err)) from None

    async def health(self, request: Request) -> Response:
        """``GET /health``: the model, the load and the decoding defaults, for a load balancer or a person."""
        info, batcher, cfg = self.info, self.batcher, self.cfg
        return JSONResponse({
            "status": "ok", "model": info.model, "engine": info.engine, "device": info.device,
            "quantize": info.quantize, "threads": info.threads, "source": cfg.data.src_lang, "target": cfg.data.tgt_lang,
            "directions": [way.name for way in self.batcher.models.directions()], "pivot": self.batcher.models.pivot,
            "queue_depth": batcher.depth(), "uptime_s": round(time.monotonic() - info.started, 1),
            "requests": batcher.stats.requests, "lines": batcher.stats.lines, "batches": batcher.stats.batches,
            "errors": batcher.stats.errors, "steps": batcher.stats.steps,
            "sentence_steps": batcher.stats.sentence_steps,
            "decode": {"beam": cfg.decode.beam_size, "len_penalty": cfg.decode.len_penalty,
                       "len_penalty_form": cfg.decode.len_penalty_form},
        })  # fmt: skip

    async def languages_route(self, request: Request) -> Response:
        return JSONResponse(languages(self.langs))

    async def frontend_settings(self, request: Request) -> Response:
        """``GET /frontend/settings``, LibreTranslate's: what its web UI and clients read before they send text
        (the character limit, whether a key is needed, the default direction, files)."""
        return JSONResponse(frontend_settings(self.batcher.models, self.limits, self.keyed))

    async def page(self, request: Request) -> Response:
        return HTMLResponse(resources.files("transformer_mt.serve").joinpath("demo.html").read_text(encoding="utf-8"))

    async def websocket(self, ws: WebSocket) -> None:
        """``/ws?target=de`` (and ``source``): a model of several directions takes them from the query."""
        try:
            languages = check_languages(dict(ws.query_params), self.langs, None)
        except RequestError as err:
            await ws.accept()
            await _close(ws, err)
            return
        await ws_lines(ws, self.submit, self.limits, languages)


async def _read(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is past ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the request body is over {limit} bytes; send less per request")
        chunks.append(chunk)
    return b"".join(chunks)


FRONTEND_TIMEOUT_MS = 500  # LibreTranslate's default: how long its web UI waits after a keystroke to translate


def attachment(filename: str) -> str:
    """The Content-Disposition of a download named ``filename``: an ASCII name for old clients and the UTF-8 one
    (RFC 6266's ``filename*``), since a header holds Latin-1 only and a name may be in any script."""
    fallback = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


def frontend_settings(models: Models, limits: Limits, keyed: bool = False) -> dict[str, Any]:
    """LibreTranslate's ``/frontend/settings`` for this server: whether a key is needed (``keyed``), the files
    /translate_file takes, no suggestions; the first model's first direction as the default source and target."""
    name = {entry["code"]: entry["name"] for entry in languages(models.languages)}
    first = models.directions()[0]
    return {
        "charLimit": limits.max_chars, "frontendTimeout": FRONTEND_TIMEOUT_MS, "apiKeys": keyed,
        "keyRequired": keyed, "suggestions": False, "filesTranslation": True, "supportedFilesFormat": SUPPORTED,
        "language": {"source": {"code": first.src, "name": name[first.src]},
                     "target": {"code": first.tgt, "name": name[first.tgt]}},
    }  # fmt: skip


def attention_request(raw: dict[str, Any]) -> tuple[str, int | None]:
    """The text and layer of a ``/v1/attention`` body, checked as plain data (no web framework)."""
    text, layer = raw.get("text"), raw.get("layer")
    if not isinstance(text, str) or "\n" in text:
        raise RequestError(400, "'text' must be one line of text", "text")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise RequestError(400, f"'layer' must be a layer number, got {layer!r}", "layer")
    return text, layer


def attention_response(found: Any) -> dict[str, Any]:
    """The heat map as the demo page draws it: weights (target tokens, source tokens), mean over the heads."""
    panel = found.panel
    return {
        "translation": found.target, "title": panel.title, "queries": panel.queries, "keys": panel.keys,
        "weights": panel.weights.mean(axis=0).round(4).tolist(),  # (target tokens, source tokens)
    }  # fmt: skip


async def ws_lines(
    ws: WebSocket, submit: Any, limits: Limits, languages: tuple[str | None, str | None] = (None, None)
) -> None:
    """``/ws``: each text message is one line, each answer its translation, in the order the lines came.

    Lines are submitted as they arrive, so a client that sends many before
    reading gets them batched; a writer task awaits the futures in order. A
    bad line (a line break, too long) closes the socket with code 1008 and
    the reason, a binary message with 1003, after the lines before it are
    answered; a full queue closes it with 1013 (try again later). A client
    that leaves, even in the middle of a message, is one line in the log:
    its lines not answered yet are cancelled, so that nothing waits
    for a reader that is gone (a server that must stop never waits on it).
    """
    await ws.accept()
    pending: asyncio.Queue = asyncio.Queue(maxsize=limits.max_lines)
    writer = asyncio.create_task(_ws_answer(ws, pending))
    reader = asyncio.create_task(_ws_read(ws, submit, limits, pending, languages))
    code = None  # the client's close code, once it has left
    try:
        await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        if not reader.done():
            await writer  # it closed the socket for a refused line (429, 503), or raises: the client is gone
        elif isinstance(ended := reader.result(), RequestError):
            if await writer:  # the lines before the bad message answered, then why it closes
                await _close(ws, ended)
        else:
            code = ended
    except WebSocketDisconnect as err:  # the client left while its answers were being sent
        code = err.code
    finally:
        left = await _cancel(reader, writer, pending)
        if left or code not in QUIET_CLOSE_CODES:
            logger.warning(
                "websocket client %s left (close code %s)%s", _peer(ws), code,
                f"; its {left} lines not answered yet were cancelled" if left else "",
            )  # fmt: skip


async def _ws_read(
    ws: WebSocket, submit: Any, limits: Limits, pending: asyncio.Queue, languages: tuple[str | None, str | None]
) -> RequestError | int:
    """Submit each line as it comes; the refusal of the first message that is no line, or the client's close
    code when it leaves (1006: without a close frame, as when it goes away in the middle of a message)."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return int(message.get("code", 1006))
        line = message.get("text")
        if line is None:
            refused = RequestError(415, "a binary message: send each line as a text message (UTF-8)")
        elif "\n" in line or len(line) > limits.max_chars:
            refused = RequestError(400, f"one line per message, at most {limits.max_chars} characters")
        else:
            await pending.put(asyncio.ensure_future(submit(Job([line], languages=languages))))
            continue
        await pending.put(None)
        logger.warning("websocket client %s: %s; closing the socket", _peer(ws), refused.message)
        return refused


async def _ws_answer(ws: WebSocket, pending: asyncio.Queue) -> bool:
    """Send each line's translation in order; True when the reader's end (None) is reached, False when the
    socket was closed for a refused line (429, 503)."""
    while (task := await pending.get()) is not None:
        try:
            results = await task
        except RequestError as err:
            await _close(ws, err)
            return False
        await ws.send_text(results[0][0].text)
    return True


async def _cancel(reader: asyncio.Task, writer: asyncio.Task, pending: asyncio.Queue) -> int:
    """Stop both tasks and cancel the lines not answered (the batcher skips them); how many there were."""
    tasks = [reader, writer]
    while not pending.empty():
        tasks.append(pending.get_nowait())
    left = sum(1 for task in tasks[2:] if task is not None and not task.done())
    for task in tasks:
        if task is not None:
            task.cancel()
    await asyncio.gather(*(task for task in tasks if task is not None), return_exceptions=True)
    return left


def _peer(ws: WebSocket) -> str:
    return f"{ws.client.host}:{ws.client.port}" if ws.client else "?"


QUIET_CLOSE_CODES = (None, 1000, 1001, 1012)  # the server closed it; a normal close; going away; restarting
WS_CLOSE_CODES = {415: 1003, 429: 1013, 503: 1013}  # unsupported data; try again later; anything else: 1008


async def _close(ws: WebSocket, err: RequestError) -> None:
    await ws.close(code=WS_CLOSE_CODES.get(err.status, 1008), reason=err.message[:120])
