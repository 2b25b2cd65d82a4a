"""`tmt serve`: a trained model behind HTTP and a WebSocket, with a demo page.

The parts, each testable alone:

- `protocol`: requests and answers as plain data (LibreTranslate's
  ``/translate`` and ``/languages``, tmt's ``/v1/translate``), every refusal
  a `protocol.RequestError` with its HTTP status and field;
- `batcher`: one worker thread that owns the model and batches the lines of
  concurrent requests (``max_batch_tokens``, ``max_wait_ms``), behind a
  bounded queue (429 when full);
- `models`: the models a server holds (one, or several of other
  directions) and which one answers a request;
- `app`: the starlette routes over those two; ``demo.html`` the page at ``/``.

starlette and uvicorn are an optional extra (``pip install -e ".[serve]"``):
only this package imports them, when `tmt serve` runs.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformer_mt.errors import UserError

if TYPE_CHECKING:
    from transformer_mt.serve.models import Models

HEADER_TIMEOUT_S = 10  # the longest a request's line and headers may take to arrive: docs/serving.md, "Limits"


class ServeError(UserError):
    """A server that cannot start: a missing extra, a port in use; the message says what to do."""


def require_web_stack() -> None:
    """starlette and uvicorn, or a ServeError naming the extra that installs them."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ServeError(
            f"tmt serve needs starlette and uvicorn ({err.name} is missing): pip install 'transformer_mt[serve]' "
            '(in a checkout: pip install -e ".[serve]")'
        ) from None


def serve(
    checkpoints: Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int = 8000,
    engine: str = "pytorch",
    device: str | None = None,
    overrides: Sequence[str] = (),
    max_wait_ms: float = 10.0,
    queue_size: int = 256,
    max_lines: int = 256,
    max_chars: int = 20_000,
    threads: str = "",
    cors_origins: Sequence[str] = (),
    api_keys: Path | None = None,
    req_limit: int = 0,
    log_format: str = "text",
    pivot: str | None = None,
) -> None:
    """Load the models (`model_groups`), then serve them until SIGTERM or Ctrl-C; in-flight requests are
    answered before exit. ``api_keys``: a keys file (`keys.read_keys`); ``req_limit``: requests per minute per
    client address (0: none); ``log_format``: the access log's, on stderr; ``pivot``: the language untrained
    pairs are translated through (`Models.legs`)."""
    require_web_stack()
    import uvicorn

    from transformer_mt.serve.app import ServerInfo, build_app
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.keys import Policy, read_keys
    from transformer_mt.serve.protocol import Limits

    check_options(max_wait_ms, {"--queue": queue_size, "--max-lines": max_lines, "--max-chars": max_chars},
                  req_limit, log_format)  # fmt: skip
    policy = Policy(read_keys(api_keys) if api_keys is not None else None, req_limit)  # a bad file: before loading
    limits = Limits(max_lines=max_lines, max_chars=max_chars)
    sock = listen(host, port)  # before the model loads: a port in use fails at once
    groups = model_groups(checkpoints, engine)
    models = load_models(groups, engine, device, overrides, pivot)
    d = models.first.cfg.decode
    batcher = Batcher(models, d.batch_tokens, max_wait_ms, queue_size)
    info = ServerInfo(public_name(checkpoints), engine, str(models.first.device), d.quantize, threads)
    app = build_app(
        batcher, info, limits, False, policy, log=_stderr_line, log_format=log_format, cors_origins=cors_origins
    )
    print(
        f"serving {served(groups, models)} ({engine}, {info.device}, threads {threads or 'as torch chose'}) on "
        f"http://{host}:{sock.getsockname()[1]} (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on", ws="websockets-sansio",
        http=slow_client_protocol(HEADER_TIMEOUT_S),
    )  # fmt: skip
    run_in_main_thread(uvicorn.Server(config), sock, batcher)


def load_models(
    groups: list[list[str | Path]], engine: str, device: str | None, overrides: Sequence[str], pivot: str | None = None
) -> Models:
    """The `Models` of ``groups`` (`model_groups`), each loaded as `tmt translate` loads its -c, a direction
    chosen per request; ``pivot``: as `Models`'."""
    from transformer_mt.decode.translate import load_translator
    from transformer_mt.serve.models import Models

    return Models(
        [load_translator(group, engine, False, device, overrides, languages=None) for group in groups],
        [public_name(group) for group in groups],
        pivot,
    )


def served(groups: list[list[str | Path]], models: Models) -> str:
    """What the start line says is served: each model's checkpoints and directions, and the pairs answered
    through the pivot."""
    from transformer_mt.data.directions import directions

    listed = "; ".join(
        f"{', '.join(map(str, group))} ({', '.join(w.name for w in directions(t.cfg.data))})"
        for group, t in zip(groups, models.translators, strict=True)
    )
    through = sorted(f"{s}-{t}" for s, t in models.pivoted)
    return listed + (f"; through {models.pivot}: {', '.join(through) or 'no pair'}" if models.pivot else "")


def model_groups(checkpoints: Sequence[str | Path], engine: str) -> list[list[str | Path]]:
    """``-c``'s checkpoints as the models the server holds, in order of first appearance. With tmt's engine,
    checkpoints of the same directions are one model (averaged, as `tmt translate` averages several -c) and
    checkpoints of other directions models of their own, each answering its directions; with ctranslate2,
    each directory is a model. Only the stored configs are read here (`read_checkpoint`'s cheap look)."""
    if engine != "pytorch" or len(checkpoints) < 2:
        return [[checkpoint] for checkpoint in checkpoints]
    from transformer_mt.checkpoint.io import read_checkpoint
    from transformer_mt.checkpoint.run_dir import run_dir_checkpoint
    from transformer_mt.data.directions import directions

    groups: dict[tuple[str, ...], list[str | Path]] = {}
    for checkpoint in checkpoints:
        config = read_checkpoint(run_dir_checkpoint(Path(checkpoint)) or checkpoint, mmap=True).config
        groups.setdefault(tuple(way.name for way in directions(config.data)), []).append(checkpoint)
    return list(groups.values())


def check_options(max_wait_ms: float, at_least_one: dict[str, int], req_limit: int, log_format: str) -> None:
    """A ServeError naming the first option out of its range, before anything is loaded."""
    from transformer_mt.serve.observe import LOG_FORMATS

    if not max_wait_ms >= 0:
        raise ServeError(f"--max-wait-ms must be 0 or more, got {max_wait_ms}")
    for name, value in at_least_one.items():
        if value < 1:
            raise ServeError(f"{name} must be at least 1, got {value}")
    if req_limit < 0:
        raise ServeError(f"--req-limit must be 0 (none) or more, got {req_limit}")
    if log_format not in LOG_FORMATS:
        raise ServeError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def public_name(checkpoints: Sequence[str | Path]) -> str:
    """The model as `/health` and the demo page name it to every visitor: the checkpoints' file names, not
    their paths (a path tells strangers how the server's disk is laid out; the operator's log has it)."""
    return ", ".join(Path(checkpoint).name for checkpoint in checkpoints)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_in_main_thread(server: Any, sock: socket.socket, batcher: Any) -> None:
    """The model's worker in this (the main) thread, the HTTP server on another; SIGTERM or Ctrl-C stops both.

    The worker runs here because PyTorch's small operators are much slower on
    other threads (`Batcher.run`). A signal asks uvicorn to shut down: it
    stops listening, answers what is in flight, and its lifespan closes the
    batcher, which finishes its queue (work of clients that left is cancelled
    as they leave, `app.ws_lines`). A second signal stops at once, one line
    and the shell's status for that signal (130, 143): what is queued is not
    answered, and no client or request may hold the process any longer.
    """

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if server.should_exit:
            print(f"interrupted: {name} again, stopped at once; {batcher.depth()} queued requests not answered",
                  file=sys.stderr, flush=True)  # fmt: skip
            os._exit(128 + signum)  # the HTTP thread and the worker may be anywhere: nothing to unwind
        print(f"stopping on {name}: answering what is in flight (again to stop at once)", file=sys.stderr, flush=True)
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            batcher.close()  # whatever ended the server (a failed start included) ends the worker loop too

    web = threading.Thread(target=http, name="tmt-serve-http")
    try:
        web.start()
        batcher.run()
        web.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def slow_client_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request line and headers take longer than
    ``header_timeout_s`` to arrive.

    uvicorn waits for them forever (its keep-alive timeout starts afresh at
    every byte received), so a client that sends headers a byte at a time
    held a connection, and a slot of the process's file descriptors, for as
    long as it liked. The clock starts when the connection opens and when an
    answer is complete (the next request's headers); a WebSocket, once
    upgraded, is another protocol's and is left alone. The body has its own
    limit (`protocol.BODY_TIMEOUT_S`).
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()

        def _await_headers(self) -> None:
            if self.cycle is None or self.cycle.response_complete:  # not while a pipelined request is answered
                self.loop.call_later(header_timeout_s, self._headers_late, self.cycle)

        def _headers_late(self, cycle: Any) -> None:
            waiting = self.cycle is cycle and self.transport.get_protocol() is self
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is one line naming it, not the server's traceback.

    It is made with its protocol named (``IPPROTO_TCP``, where
    `socket.create_server` leaves 0): asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on connections whose socket says TCP, and with it
    on, every answer after the first on a keep-alive connection waited about
    40 ms (uvicorn writes the headers and the body apart; the second write
    waited for the client's delayed acknowledgement of the first).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":  # as create_server: a restarted server rebinds at once
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # as create_server: an IPv6 address listens on IPv6 only
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen()
        return sock
    except OSError as err:
        sock.close()
        raise ServeError(
            f"could not listen on {host}:{port}: {err.strerror}; pick another --port, or stop what holds it"
        ) from None
    except OverflowError:
        sock.close()
        raise ServeError(f"--port {port} is not a TCP port (0-65535)") from None
