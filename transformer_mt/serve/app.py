"""The HTTP and WebSocket face of `tmt serve`: a thin starlette app over `Batcher` and `protocol`.

Handlers parse and check a request (`protocol`), hand its lines to the
batcher and await the future, so the event loop only moves bytes. The app
keeps no state between requests beyond counters: replicas behind any load
balancer answer alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from transformer_mt.attention_maps import AttentionError, translator_attention
from transformer_mt.errors import UserError
from transformer_mt.serve.batcher import Batcher, QueueFull, ShuttingDown
from transformer_mt.serve.protocol import (
    Job,
    Limits,
    RequestError,
    languages,
    libre_response,
    parse_json,
    parse_libre,
    parse_v1,
    v1_response,
)

RETRY_AFTER_S = 1  # what a 429 asks a client to wait


def refusal(err: RequestError) -> JSONResponse:
    """The JSON error answer of ``err``; a full queue (429) also says when to retry."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
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


def build_app(batcher: Batcher, info: ServerInfo, limits: Limits, start_worker: bool = True) -> Starlette:
    """The app: routes over ``batcher``; its lifespan starts the worker (unless ``start_worker`` is False: the
    caller runs it) and, at shutdown, lets it finish."""
    handlers = _Handlers(batcher, info, limits, start_worker)
    return Starlette(routes=handlers.routes(), lifespan=handlers.lifespan)


class _Handlers:
    """The route handlers of one app and the state they share: the batcher, what `/health` says, the limits and
    the model's config. Methods of one object rather than closures in `build_app`, so that each is short and
    named; the state is only what the app was built with (no state between requests beyond the batcher's
    counters)."""

    def __init__(self, batcher: Batcher, info: ServerInfo, limits: Limits, start_worker: bool) -> None:
        self.batcher, self.info, self.limits, self.start_worker = batcher, info, limits, start_worker
        self.cfg = batcher.translator.cfg

    def routes(self) -> list[Route | WebSocketRoute]:
        """The paths the server answers: the demo page, LibreTranslate's, tmt's own, the WebSocket."""
        return [
            Route("/", self.page), Route("/languages", self.languages_route), Route("/health", self.health),
            Route("/translate", self.translate_libre, methods=["POST"]),
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
        """``job``'s translations; a full queue (429) or a closing server (503) is the client's to retry."""
        try:
            future = self.batcher.submit(job)
        except QueueFull as err:
            raise RequestError(429, f"the server is busy ({err}); retry after {RETRY_AFTER_S} s") from None
        except ShuttingDown as err:
            raise RequestError(503, f"{err}; retry on another replica") from None
        return await asyncio.wrap_future(future)

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON body, read no further than the limits allow (413 past them)."""
        chunks, size = [], 0
        limit = self.limits.body_bytes()
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"the request body is over {limit} bytes; send less per request")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    async def answer(self, parse: Any, request: Request, respond: Any) -> Response:
        """``respond(parse(body))`` as JSON; a refused request, or a decoding setting the config refuses, is
        its JSON error answer: one place for both translation routes to turn errors into statuses."""
        try:
            return JSONResponse(await respond(parse(await self.body(request))))
        except RequestError as err:
            return refusal(err)
        except UserError as err:  # what only the model can tell (a line it cannot encode): the client's to fix
            return refusal(RequestError(400, " ".join(str(err).split())))

    async def translate_libre(self, request: Request) -> Response:
        """``POST /translate``, LibreTranslate's API."""
        return await self.answer(lambda raw: parse_libre(raw, self.cfg, self.limits), request, self.libre)

    async def libre(self, parsed: Any) -> dict[str, Any]:
        return libre_response(parsed, await self.submit(parsed.job), self.cfg)

    async def translate_v1(self, request: Request) -> Response:
        """``POST /v1/translate``, tmt's own API (decoding settings, prefixes, constraints, n-best)."""
        mode = self.batcher.translator.mode()
        return await self.answer(
            lambda raw: parse_v1(raw, self.cfg, self.limits, mode.engine, mode.ensemble), request, self.v1
        )

    async def v1(self, parsed: Any) -> dict[str, Any]:
        return v1_response(await self.submit(parsed.job))

    async def attention(self, request: Request) -> Response:
        """The demo page's heat map: one sentence's cross-attention, mean over the heads of one layer."""
        try:
            text, layer = attention_request(await self.body(request))
            found = await self.attend(text, layer)
        except RequestError as err:
            return refusal(err)
        except AttentionError as err:
            return refusal(RequestError(400, str(err).replace("--", ""), "text"))
        return JSONResponse(attention_response(found))

    async def attend(self, text: str, layer: int | None) -> Any:
        """The attention of ``text`` computed on the worker thread, where the model is used, never beside a batch."""
        try:
            return await asyncio.wrap_future(
                self.batcher.call(
                    lambda: translator_attention(self.batcher.translator, text, "cross", layer, name=self.info.model)
                )
            )
        except (QueueFull, ShuttingDown) as err:
            raise RequestError(429 if isinstance(err, QueueFull) else 503, str(err)) from None

    async def health(self, request: Request) -> Response:
        """``GET /health``: the model, the load and the decoding defaults, for a load balancer or a person."""
        info, batcher, cfg = self.info, self.batcher, self.cfg
        return JSONResponse({
            "status": "ok", "model": info.model, "engine": info.engine, "device": info.device,
            "quantize": info.quantize, "threads": info.threads, "source": cfg.data.src_lang, "target": cfg.data.tgt_lang,
            "queue_depth": batcher.depth(), "uptime_s": round(time.monotonic() - info.started, 1),
            "requests": batcher.stats.requests, "lines": batcher.stats.lines, "batches": batcher.stats.batches,
            "errors": batcher.stats.errors, "steps": batcher.stats.steps,
            "sentence_steps": batcher.stats.sentence_steps,
            "decode": {"beam": cfg.decode.beam_size, "len_penalty": cfg.decode.len_penalty,
                       "len_penalty_form": cfg.decode.len_penalty_form},
        })  # fmt: skip

    async def languages_route(self, request: Request) -> Response:
        return JSONResponse(languages(self.cfg))

    async def page(self, request: Request) -> Response:
        return HTMLResponse(resources.files("transformer_mt.serve").joinpath("demo.html").read_text(encoding="utf-8"))

    async def websocket(self, ws: WebSocket) -> None:
        await ws_lines(ws, self.submit, self.limits)


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


async def ws_lines(ws: WebSocket, submit: Any, limits: Limits) -> None:
    """``/ws``: each text message is one line, each answer its translation, in the order the lines came.

    Lines are submitted as they arrive, so a client that sends many before
    reading gets them batched; a writer task awaits the futures in order. A
    bad line (a line break, too long) closes the socket with code 1008 and
    the reason, after the lines before it are answered; a full queue closes
    it with 1013 (try again later).
    """
    await ws.accept()
    pending: asyncio.Queue = asyncio.Queue(maxsize=limits.max_lines)

    async def writer() -> None:
        while (task := await pending.get()) is not None:
            try:
                results = await task
            except RequestError as err:
                await _close(ws, err)
                return
            await ws.send_text(results[0][0].text)

    sender = asyncio.create_task(writer())
    try:
        while True:
            line = await ws.receive_text()
            if "\n" in line or len(line) > limits.max_chars:
                await pending.put(None)
                await sender
                await _close(ws, RequestError(400, f"one line per message, at most {limits.max_chars} characters"))
                return
            await pending.put(asyncio.ensure_future(submit(Job([line]))))
    except (WebSocketDisconnect, RuntimeError):  # the client left, or the writer closed the socket
        sender.cancel()


async def _close(ws: WebSocket, err: RequestError) -> None:
    await ws.close(code=1013 if err.status in (429, 503) else 1008, reason=err.message[:120])
