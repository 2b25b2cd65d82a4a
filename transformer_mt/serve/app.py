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
from transformer_mt.decode.constrained import encode_constraints
from transformer_mt.decode.translate import CONSTRAINTS_ENGINE, Translator
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
    started: float = field(default_factory=time.monotonic)


def build_app(batcher: Batcher, info: ServerInfo, limits: Limits, start_worker: bool = True) -> Starlette:
    """The app: routes over ``batcher``; its lifespan starts the worker (unless ``start_worker`` is False: the
    caller runs it) and, at shutdown, lets it finish."""
    cfg = batcher.translator.cfg

    async def submit(job: Job) -> list:
        try:
            future = batcher.submit(job)
        except QueueFull as err:
            raise RequestError(429, f"the server is busy ({err}); retry after {RETRY_AFTER_S} s") from None
        except ShuttingDown as err:
            raise RequestError(503, f"{err}; retry on another replica") from None
        return await asyncio.wrap_future(future)

    async def body(request: Request) -> dict[str, Any]:
        """The JSON body, read no further than the limits allow (413 past them)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.body_bytes():
                raise RequestError(413, f"the request body is over {limits.body_bytes()} bytes; send less per request")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    async def translate_libre(request: Request) -> Response:
        return await answer(lambda raw: parse_libre(raw, cfg, limits), request, libre)

    async def libre(parsed: Any) -> dict[str, Any]:
        return libre_response(parsed, await submit(parsed.job), cfg)

    async def translate_v1(request: Request) -> Response:
        return await answer(lambda raw: parse_v1(raw, cfg, limits), request, v1)

    async def v1(parsed: Any) -> dict[str, Any]:
        translator = batcher.translator.with_decode(parsed.job.overrides)  # a ConfigError here, before the queue
        for i, (source, prefix) in enumerate(zip(parsed.job.lines, parsed.job.prefixes or [], strict=False)):
            translator.encode_prefix(i, prefix, translator.encode(i, source), origin="prefixes")  # its errors too
        if parsed.job.constraints is not None:
            check_constraints(translator, parsed.job.constraints)
        return v1_response(await submit(parsed.job))

    async def answer(parse: Any, request: Request, respond: Any) -> Response:
        try:
            return JSONResponse(await respond(parse(await body(request))))
        except RequestError as err:
            return refusal(err)
        except UserError as err:  # a decoding setting the config refuses
            return refusal(RequestError(400, " ".join(str(err).split())))

    async def attention(request: Request) -> Response:
        """The demo page's heat map: one sentence's cross-attention, mean over the heads of one layer."""
        try:
            raw = await body(request)
            text, layer = raw.get("text"), raw.get("layer")
            if not isinstance(text, str) or "\n" in text:
                raise RequestError(400, "'text' must be one line of text", "text")
            if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
                raise RequestError(400, f"'layer' must be a layer number, got {layer!r}", "layer")
            try:
                found = await asyncio.wrap_future(
                    batcher.call(
                        lambda: translator_attention(batcher.translator, text, "cross", layer, name=info.model)
                    )
                )
            except (QueueFull, ShuttingDown) as err:
                raise RequestError(429 if isinstance(err, QueueFull) else 503, str(err)) from None
        except RequestError as err:
            return refusal(err)
        except AttentionError as err:
            return refusal(RequestError(400, str(err).replace("--", ""), "text"))
        panel = found.panel
        return JSONResponse({
            "translation": found.target, "title": panel.title, "queries": panel.queries, "keys": panel.keys,
            "weights": panel.weights.mean(axis=0).round(4).tolist(),  # (target tokens, source tokens)
        })  # fmt: skip

    async def health(request: Request) -> Response:
        return JSONResponse({
            "status": "ok", "model": info.model, "engine": info.engine, "device": info.device,
            "quantize": info.quantize, "source": cfg.data.src_lang, "target": cfg.data.tgt_lang,
            "queue_depth": batcher.depth(), "uptime_s": round(time.monotonic() - info.started, 1),
            "requests": batcher.stats.requests, "lines": batcher.stats.lines, "batches": batcher.stats.batches,
            "errors": batcher.stats.errors,
            "decode": {"beam": cfg.decode.beam_size, "len_penalty": cfg.decode.len_penalty,
                       "len_penalty_form": cfg.decode.len_penalty_form},
        })  # fmt: skip

    async def languages_route(request: Request) -> Response:
        return JSONResponse(languages(cfg))

    async def page(request: Request) -> Response:
        return HTMLResponse(resources.files("transformer_mt.serve").joinpath("demo.html").read_text(encoding="utf-8"))

    async def websocket(ws: WebSocket) -> None:
        await ws_lines(ws, submit, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        """The worker starts with the app; at shutdown, after in-flight requests are answered, it finishes."""
        if start_worker:
            batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.close)

    routes = [
        Route("/", page), Route("/languages", languages_route), Route("/health", health),
        Route("/translate", translate_libre, methods=["POST"]), Route("/v1/translate", translate_v1, methods=["POST"]),
        Route("/v1/attention", attention, methods=["POST"]), WebSocketRoute("/ws", websocket),
    ]  # fmt: skip
    return Starlette(routes=routes, lifespan=lifespan)


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


def check_constraints(translator: Translator, constraints: list[list[str]]) -> None:
    """Refuse, before the queue, constraints that no translation could hold: an engine without constrained
    search, or a phrase with characters the vocabulary lacks (the error names its source)."""
    if translator.engine_search is not None:
        raise RequestError(400, CONSTRAINTS_ENGINE.replace("--constraints", "'constraints'"), "constraints")
    for i, phrases in enumerate(constraints):
        try:
            encode_constraints(translator.bpe, phrases, i)
        except UserError as err:
            message = " ".join(str(err).split()).replace(f"--constraints: line {i + 1}", f"sources[{i}]")
            raise RequestError(400, message, f"constraints[{i}]") from None
