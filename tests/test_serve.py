"""`tmt serve`: request parsing, the batching worker, the app through starlette's test client.

The real server process, over HTTP and the WebSocket, and the demo page in a
real browser are in test_serve_process.py. A random-weight toy model is
enough: its translations differ from line to line, so a line answered with
another's translation, or out of order, is caught by comparing with
`tmt translate`'s output for each line alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import quiet_translator

from transformer_mt.config import Config
from transformer_mt.decode.translate import Translation, Translator
from transformer_mt.serve.batcher import Batcher, QueueFull, ShuttingDown
from transformer_mt.serve.protocol import Job, Limits, RequestError, libre_response, parse_json, parse_libre, parse_v1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def translator(toy_ckpt: Path) -> Translator:
    return quiet_translator(toy_ckpt)


@pytest.fixture(scope="module")
def lines(prepared_toy: Config) -> list[str]:
    return Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:24]


@pytest.fixture(scope="module")
def alone(translator: Translator, lines: list[str]) -> dict[str, str]:
    """Each line translated by itself, as `tmt translate` of a one-line file does."""
    return {line: translator.translate_lines([line])[0] for line in lines}


def assert_same_translations(got: list[list[Translation]], want: list[list[Translation]]) -> None:
    """The same texts, and the same scores to float rounding: a line's scores change in the last digits with the
    lines it is batched with (BLAS sums in another order), in `tmt translate` too."""
    assert [[t.text for t in hyps] for hyps in got] == [[t.text for t in hyps] for hyps in want]
    scores = [x for hyps in got for t in hyps for x in (t.score, t.log_prob)]
    assert scores == pytest.approx([x for hyps in want for t in hyps for x in (t.score, t.log_prob)], rel=1e-6)


# -- protocol


def test_libre_request_shapes(translator: Translator) -> None:
    cfg = translator.cfg
    one = parse_libre({"q": "a b", "source": "en", "target": "de"}, cfg, Limits())
    assert one.single and one.job.lines == ["a b"] and one.detected is None
    doc = parse_libre({"q": ["x\ny", "", "z"], "source": "auto", "alternatives": 1}, cfg, Limits())
    assert doc.job.lines == ["x", "y", "", "z"] and doc.parts == [2, 1, 1] and doc.job.nbest == 2
    results = [[Translation(t, -1.0, -2.0), Translation(t + "'", -2.0, -3.0)] for t in ("X", "Y", "", "Z")]
    answer = libre_response(doc, results)
    assert answer["translatedText"] == ["X\nY", "", "Z"]
    assert answer["alternatives"] == [["X'\nY'"], ["'"], ["Z'"]]
    assert answer["detectedLanguage"] == [{"confidence": 100.0, "language": "en"}] * 3


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({}, 400, "q"),
        ({"q": 3}, 400, "q"),
        ({"q": ["a", 1]}, 400, "q"),
        ({"q": "a", "source": "fr"}, 400, "source"),
        ({"q": "a", "target": "en"}, 400, "target"),
        ({"q": "a", "alternatives": -1}, 400, "alternatives"),
        ({"q": "a", "alternatives": 9}, 400, "alternatives"),
        ({"q": "a", "format": "markdown"}, 400, "format"),
        ({"q": ["a"] * 5}, 413, "q"),
        ({"q": "x" * 101}, 413, "q"),
    ],
)
def test_libre_refusals_name_the_field(translator: Translator, body: dict, status: int, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_libre(body, translator.cfg, Limits(max_lines=4, max_chars=100))
    assert (caught.value.status, caught.value.field) == (status, field), caught.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "sources"),
        ({"sources": "a"}, "sources"),
        ({"sources": ["a\nb"]}, "sources[0]"),
        ({"sources": ["a"], "beam": 0}, "beam"),
        ({"sources": ["a"], "beam": 17}, "beam"),
        ({"sources": ["a"], "beam": True}, "beam"),
        ({"sources": ["a"], "beam": 2, "nbest": 3}, "nbest"),
        ({"sources": ["a"], "len_penalty": "x"}, "len_penalty"),
        ({"sources": ["a"], "lenpen": 1}, "lenpen"),
        ({"sources": ["a"], "sample": 5}, "sample"),
        ({"sources": ["a"], "sample": "topk:5", "temperature": "hot"}, "temperature"),
        ({"sources": ["a"], "sample": "topk:5", "seed": -1}, "seed"),
        ({"sources": ["a"], "sample": "topk:5", "nbest": 17}, "nbest"),
        ({"sources": ["a"], "prefixes": ["x", "y"]}, "prefixes"),
        ({"sources": ["a"], "prefixes": "x"}, "prefixes"),
        ({"sources": ["a", "b"], "prefixes": ["", "x\ny"]}, "prefixes[1]"),
    ],
)
def test_v1_refusals_name_the_field(translator: Translator, body: dict, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_v1(body, translator.cfg, Limits())
    assert (caught.value.status, caught.value.field) == (400, field), caught.value.message


def test_v1_settings_become_decode_changes(translator: Translator) -> None:
    job = parse_v1({"sources": ["a"], "beam": 2, "nbest": 2, "len_penalty": 1}, translator.cfg, Limits()).job
    assert job.decode == {"beam_size": 2, "len_penalty": 1.0} and job.nbest == 2
    assert translator.with_decode(job.decode).cfg.decode.beam_size == 2
    assert translator.cfg.decode.beam_size == 4  # the served translator itself is unchanged


def test_bad_json_is_a_400() -> None:
    for body in (b"{", b"[1]", b"\xff"):
        with pytest.raises(RequestError) as caught:
            parse_json(body)
        assert caught.value.status == 400


# -- the worker


def test_concurrent_requests_get_their_own_lines_in_order(translator: Translator, lines, alone) -> None:
    batcher = Batcher(translator, max_batch_tokens=400, max_wait_ms=20, queue_size=64)
    batcher.start()
    try:
        jobs = [lines[i : i + 1 + i % 3] for i in range(0, len(lines), 2)]  # overlapping, of 1-3 lines
        with ThreadPoolExecutor(8) as pool:
            futures = list(pool.map(lambda job: batcher.submit(Job(job)), jobs))
        for job, future in zip(jobs, futures, strict=True):
            assert [hyps[0].text for hyps in future.result(timeout=60)] == [alone[line] for line in job]
        assert batcher.stats.batches < len(jobs)  # requests shared batches
        assert batcher.stats.lines == sum(map(len, jobs))
    finally:
        batcher.close()


def test_requests_with_their_own_settings_are_decoded_apart(translator: Translator, lines) -> None:
    greedy = translator.with_decode({"beam_size": 1}).translate_lines(lines[:3])
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=50, queue_size=8)
    a = batcher.submit(Job(lines[:3], decode={"beam_size": 1}))
    b = batcher.submit(Job(lines[:3]))
    batcher.start()
    try:
        assert [h[0].text for h in a.result(timeout=60)] == greedy
        assert [h[0].text for h in b.result(timeout=60)] == translator.translate_lines(lines[:3])
    finally:
        batcher.close()


def test_full_queue_and_shutdown(translator: Translator, lines) -> None:
    batcher = Batcher(translator, max_batch_tokens=100, max_wait_ms=0, queue_size=2)
    first, second = batcher.submit(Job(lines[:1])), batcher.submit(Job(lines[1:2]))
    with pytest.raises(QueueFull):
        batcher.submit(Job(lines[2:3]))
    batcher.start()
    batcher.close(timeout=60)  # what was queued is finished, not dropped
    assert first.result(timeout=0)[0][0].text and second.done()
    with pytest.raises(ShuttingDown):
        batcher.submit(Job(lines[:1]))


def test_the_clients_a_round_answered_are_awaited_together_and_a_lone_one_is_not_kept(
    translator: Translator, lines, alone
) -> None:
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=60_000, queue_size=8, continuous=False)
    first = [batcher.submit(Job([line])) for line in lines[:3]]  # queued before the worker starts: one round
    batcher.start()
    try:
        for future in first:
            future.result(timeout=60)
        assert batcher.stats.batches == 1
        # the three clients come back one by one, 50 ms apart: the worker waits for the three (within max_wait)
        with ThreadPoolExecutor(3) as pool:
            again = list(pool.map(lambda i: (time.sleep(0.05 * i), batcher.submit(Job([lines[3 + i]])))[1], range(3)))
        assert [f.result(timeout=60)[0][0].text for f in again] == [alone[line] for line in lines[3:6]]
        assert batcher.stats.batches == 2
    finally:
        batcher.close()
    # one client: each request is translated at once, not after the minute of max_wait
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=60_000, queue_size=8, continuous=False)
    batcher.start()
    try:
        for line in lines[6:9]:
            assert batcher.submit(Job([line])).result(timeout=20)[0][0].text == alone[line]
    finally:
        batcher.close()


def test_requests_join_the_running_search(translator: Translator, lines, alone) -> None:
    """A request queued while the search runs joins it at the next step, beside the lines already in it, and
    every line still gets `tmt translate`'s translation of it alone."""
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=0, queue_size=8)
    assert batcher.search is not None
    active: list[int] = []
    later = []

    def after_step() -> None:  # on the worker, after each step: the second request comes after the first step
        active.append(batcher.search.active)
        if len(active) == 1:
            later.append(batcher.submit(Job(lines[4:6])))

    batcher.search.after_step = after_step
    first = batcher.submit(Job(lines[:4]))
    batcher.start()
    try:
        assert [h[0].text for h in first.result(timeout=60)] == [alone[line] for line in lines[:4]]
        assert [h[0].text for h in later[0].result(timeout=60)] == [alone[line] for line in lines[4:6]]
    finally:
        batcher.close()
    assert active[0] == 4 and max(active) > 4  # the second request's lines ran beside the first's
    assert batcher.stats.batches == 2 and batcher.stats.steps == len(active)
    assert batcher.stats.sentence_steps == sum(active)  # each step counts the sentences it held


def assert_the_worker_goes_on(batcher: Batcher, error: type, match: str, lines, alone) -> None:
    """The first request fails with ``error`` (a fault set up by the caller); the next is translated as alone."""
    doomed = batcher.submit(Job(lines[:2]))
    batcher.start()
    try:
        with pytest.raises(error, match=match):
            doomed.result(timeout=60)
        assert [h[0].text for h in batcher.submit(Job(lines[2:4])).result(timeout=60)] == [
            alone[line] for line in lines[2:4]
        ]
    finally:
        batcher.close()


def test_a_failing_step_fails_the_requests_in_the_search_and_the_worker_goes_on(
    translator: Translator, lines, alone
) -> None:
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=0, queue_size=8)
    assert batcher.search is not None
    calls = []

    def after_step() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a step failed")

    batcher.search.after_step = after_step
    assert_the_worker_goes_on(batcher, RuntimeError, "a step failed", lines, alone)
    assert batcher.stats.errors == 1


def test_a_failing_join_fails_its_requests_and_the_worker_goes_on(translator: Translator, lines, alone) -> None:
    batcher = Batcher(translator, max_batch_tokens=10_000, max_wait_ms=0, queue_size=8)
    assert batcher.search is not None
    add = batcher.search.add

    def add_once_out_of_memory(sources, keys) -> None:  # the first join fails, as an allocation would
        batcher.search.add = add
        raise MemoryError("no memory for the join")

    batcher.search.add = add_once_out_of_memory
    assert_the_worker_goes_on(batcher, MemoryError, "no memory", lines, alone)
    assert batcher.stats.errors == 1 and batcher.search.active == 0


def test_a_failing_request_leaves_the_worker_alive(translator: Translator, lines, alone) -> None:
    batcher = Batcher(translator, max_batch_tokens=100, max_wait_ms=0, queue_size=8)
    batcher.start()
    try:
        boom = batcher.call(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            boom.result(timeout=60)
        assert batcher.submit(Job(lines[:1])).result(timeout=60)[0][0].text == alone[lines[0]]
    finally:
        batcher.close()


def test_the_server_socket_sends_answers_without_waiting_for_acknowledgements() -> None:
    """asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets made with their protocol named; with it
    on, each answer after the first on a keep-alive connection waited about 40 ms (`listen`)."""
    import asyncio
    import socket

    from transformer_mt.serve import listen

    sock = listen("127.0.0.1", 0)
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    async def connect_once() -> None:
        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()  # until the server's side closes
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(connect_once())
    assert len(seen) == 1 and seen[0] != 0


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        (b'{"q": "a\\ud800b"}', "q", "lone surrogate"),
        (b'{"q": ["a", "\\udc00"]}', "q[1]", "lone surrogate"),
        (b'{"sources": ["a"], "prefixes": ["\\ud800"]}', "prefixes[0]", "lone surrogate"),
        (b'{"\\ud800": 1}', None, "a key holds a lone surrogate"),
        (b"[" * 100_000, None, "nests lists or objects too deeply"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests lists or objects too deeply"),
    ],
)
def test_json_python_cannot_take_is_a_400_naming_the_field(body: bytes, field: str | None, says: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_json(body)
    assert (caught.value.status, caught.value.field) == (400, field) and says in caught.value.message


def test_an_integer_of_thousands_of_digits_is_refused_by_its_field(translator: Translator) -> None:
    """Python refuses to convert an int of more than 4300 digits; the body parses, and the field says no."""
    for key in ("beam", "nbest", "seed"):
        raw = parse_json(b'{"sources": ["a"], "sample": "topk:5", "%s": %s}' % (key.encode(), b"9" * 5000))
        with pytest.raises(RequestError) as caught:
            parse_v1(raw, translator.cfg, Limits())
        assert caught.value.field == key and "an integer of 5000 digits" in caught.value.message
    raw = parse_json(b'{"q": "a", "alternatives": -%s}' % (b"1" * 5000))
    with pytest.raises(RequestError) as caught:
        parse_libre(raw, translator.cfg, Limits())
    assert caught.value.field == "alternatives"
    assert parse_json(b'{"beam": %s}' % (b"9" * 100)) == {"beam": int("9" * 100)}  # a long one is still a number


# -- the app


@pytest.fixture
def client(translator: Translator):
    from starlette.testclient import TestClient

    from transformer_mt.serve.app import ServerInfo, build_app

    batcher = Batcher(translator, max_batch_tokens=1000, max_wait_ms=5, queue_size=16)
    app = build_app(batcher, ServerInfo("toy.pt", "pytorch", "cpu", "none"), Limits(max_lines=8, max_chars=2000))
    with TestClient(app) as c:
        c.batcher = batcher
        yield c


def test_libretranslate_endpoints(client, lines, alone) -> None:
    languages = client.get("/languages").json()
    assert languages[0] == {"code": "en", "name": "English", "targets": ["de"]}
    r = client.post("/translate", json={"q": lines[0], "source": "en", "target": "de", "format": "text"})
    assert r.status_code == 200 and r.json() == {"translatedText": alone[lines[0]]}
    r = client.post("/translate", json={"q": [lines[1], "", lines[2]], "source": "en", "target": "de"})
    assert r.json()["translatedText"] == [alone[lines[1]], "", alone[lines[2]]]
    r = client.post("/translate", json={"q": f"{lines[3]}\n{lines[4]}", "source": "auto", "alternatives": 2})
    body = r.json()
    assert body["translatedText"] == f"{alone[lines[3]]}\n{alone[lines[4]]}"
    assert len(body["alternatives"]) == 2 and body["detectedLanguage"]["language"] == "en"


def test_v1_endpoint_scores_and_nbest(client, translator: Translator, lines, alone) -> None:
    r = client.post("/v1/translate", json={"sources": lines[:3], "nbest": 3})
    assert r.status_code == 200
    found = r.json()["translations"]
    expected = translator.translate_lines_nbest(lines[:3], nbest=3)
    assert [t["translation"] for t in found] == [alone[line] for line in lines[:3]]
    for got, want in zip(found, expected, strict=True):
        assert [h["translation"] for h in got["nbest"]] == [h.text for h in want]
        assert got["score"] == pytest.approx(want[0].score)


def test_errors_are_json_with_the_field(client) -> None:
    r = client.post("/translate", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = client.post("/translate", json={"source": "en"})
    assert r.status_code == 400 and r.json()["field"] == "q"
    r = client.post("/translate", json={"q": ["a"] * 9})
    assert r.status_code == 413 and "--max-lines 8" in r.json()["error"]
    r = client.post("/translate", content=b"x" * (Limits(8, 2000).body_bytes() + 1))
    assert r.status_code == 413
    r = client.post("/v1/translate", content=b'{"sources": ["a"], "len_penalty": 1e400}')
    assert r.status_code == 400  # JSON's 1e400 is inf: refused, field named
    assert client.get("/health").json()["status"] == "ok"  # the worker is unharmed


def test_a_full_queue_is_a_429_with_retry_after(client, lines) -> None:
    running, release = threading.Event(), threading.Event()
    blocker = client.batcher.call(lambda: running.set() or release.wait(60))  # the worker is busy with this
    assert running.wait(60)
    queued = [client.batcher.submit(Job(lines[:1])) for _ in range(16)]  # the queue is full
    try:
        r = client.post("/translate", json={"q": "a"})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert client.get("/health").json()["queue_depth"] == 16
    finally:
        release.set()
    assert blocker.result(timeout=60) is True and all(f.result(timeout=60) for f in queued)


def test_health_and_page(client) -> None:
    health = client.get("/health").json()
    assert health["model"] == "toy.pt" and health["engine"] == "pytorch" and health["device"] == "cpu"
    assert {"queue_depth", "uptime_s", "requests"} <= set(health)
    page = client.get("/")
    assert page.status_code == 200 and "<textarea" in page.text and "/v1/translate" in page.text


def test_attention_map(client, lines, alone) -> None:
    r = client.post("/v1/attention", json={"text": lines[0]})
    body = r.json()
    assert r.status_code == 200 and body["translation"] == alone[lines[0]]
    assert len(body["weights"]) == len(body["queries"]) and len(body["weights"][0]) == len(body["keys"])
    assert all(abs(sum(row) - 1) < 1e-2 for row in body["weights"])  # each target token's weights sum to 1
    r = client.post("/v1/attention", json={"text": lines[0], "layer": 9})
    assert r.status_code == 400 and "layers 1 to 1" in r.json()["error"]


def test_websocket_one_line_in_one_line_out_in_order(client, lines, alone) -> None:
    with client.websocket_connect("/ws") as ws:
        for line in lines[:6]:  # all sent before any is read: batched, answered in order
            ws.send_text(line)
        assert [ws.receive_text() for _ in lines[:6]] == [alone[line] for line in lines[:6]]
        ws.send_text("")
        assert ws.receive_text() == ""
        ws.send_text("a\nb")
        from starlette.websockets import WebSocketDisconnect

        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1008


def test_a_binary_websocket_message_closes_with_1003_after_the_lines_before_it(client, lines, alone, caplog) -> None:
    from starlette.websockets import WebSocketDisconnect

    with client.websocket_connect("/ws") as ws:
        ws.send_text(lines[0])
        ws.send_bytes(b"\x00\x01")
        assert ws.receive_text() == alone[lines[0]]
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
    assert closed.value.code == 1003 and "text message" in closed.value.reason
    assert [r.getMessage() for r in caplog.records if "binary" in r.getMessage()] == [
        "websocket client testclient:50000: a binary message: send each line as a text message (UTF-8); "
        "closing the socket"
    ]


def test_a_declared_body_over_the_limit_is_a_413_before_it_is_read(client) -> None:
    def never() -> Iterator[bytes]:
        raise AssertionError("the body was read")
        yield b""

    r = client.post("/v1/translate", content=never(), headers={"Content-Length": str(10**11)})
    assert r.status_code == 413 and r.headers["Connection"] == "close"
    r = client.post("/v1/translate", content=never(), headers={"Content-Length": "9" * 5000})
    assert r.status_code == 413


def test_json_error_bodies_are_json(client) -> None:
    r = client.post("/v1/translate", json={"sources": ["a"], "beam": 99})
    assert r.status_code == 400 and json.loads(r.text)["field"] == "beam"


def test_the_ctranslate2_engine_behind_the_same_api(toy_ckpt: Path, lines, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    from starlette.testclient import TestClient

    from transformer_mt.decode.translate import load_translator
    from transformer_mt.export import export_ctranslate2
    from transformer_mt.serve.app import ServerInfo, build_app

    export_ctranslate2([toy_ckpt], tmp_path / "ct2")
    ct2 = load_translator([tmp_path / "ct2"], "ctranslate2", device="cpu")
    ct2.show_progress = False
    expected = [ct2.translate_lines([line])[0] for line in lines[:4]]
    greedy = ct2.with_decode({"beam_size": 1}).translate_lines(lines[:4])
    batcher = Batcher(ct2, max_batch_tokens=1000, max_wait_ms=5, queue_size=8)
    with TestClient(build_app(batcher, ServerInfo("ct2", "ctranslate2", "cpu", "none"), Limits())) as client:
        assert client.post("/translate", json={"q": lines[:4]}).json()["translatedText"] == expected
        found = client.post("/v1/translate", json={"sources": lines[:4], "beam": 1}).json()["translations"]
        assert [t["translation"] for t in found] == greedy
        r = client.post("/v1/attention", json={"text": lines[0]})
        assert r.status_code == 400 and "engine pytorch" in r.json()["error"]
        r = client.post("/v1/translate", json={"sources": lines[:1], "alignment": "hard"})
        assert r.status_code == 400 and "'alignment' reads the attention of one tmt model" in r.json()["error"]
        r = client.post("/v1/translate", json={"sources": lines[:1], "constraints": [["Hund"]]})
        assert r.status_code == 400 and "CTranslate2 has no lexical constraints" in r.json()["error"]
    assert ct2.cfg.decode.beam_size == 4 and ct2.engine_search.cfg is ct2.cfg  # the served engine is unchanged


def test_v1_sampling_fields_become_decode_changes(translator: Translator) -> None:
    job = parse_v1({"sources": ["a"], "sample": "topp:0.9", "temperature": 0.7, "seed": 5, "nbest": 6},
                   translator.cfg, Limits()).job  # fmt: skip
    assert job.decode == {"beam_size": 1, "sampling_temperature": 0.7, "sampling": "topp:0.9", "seed": 5}
    assert job.nbest == 6 and translator.with_decode(job.decode).cfg.decode.sampling == "topp:0.9"


def test_v1_samples_a_line_as_tmt_translate_does_whatever_shares_its_request(client, translator, lines) -> None:
    sampler = translator.with_decode({"sampling": "topk:20", "seed": 7, "beam_size": 1})
    expected = {line: sampler.translate_lines_nbest([line], nbest=2)[0] for line in lines[:4]}
    for sources in (lines[:4], lines[3:4], [lines[2], lines[5], lines[0]]):
        r = client.post("/v1/translate", json={"sources": sources, "sample": "topk:20", "seed": 7, "nbest": 2})
        assert r.status_code == 200, r.text
        for line, got in zip(sources, r.json()["translations"], strict=True):
            if line in expected:
                assert [h["translation"] for h in got["nbest"]] == [h.text for h in expected[line]]
    r = client.post("/v1/translate", json={"sources": ["a"], "sample": "topk:0"})
    assert r.status_code == 400 and "topk:K (K >= 1" in r.json()["error"]
    r = client.post("/v1/translate", json={"sources": ["a"], "sample": "topk:3", "beam": 2})
    assert r.status_code == 400 and "takes no beam" in r.json()["error"]


def test_v1_alignment_is_translate_alignments_per_hypothesis(client, translator: Translator, lines) -> None:
    for kind in ("hard", "soft"):
        expected = translator.with_decode({"alignment": kind}).translate_lines_nbest(lines[:3], nbest=2)
        r = client.post("/v1/translate", json={"sources": lines[:3], "nbest": 2, "alignment": kind})
        assert r.status_code == 200, r.text
        got = r.json()["translations"]
        assert [[h["alignment"] for h in t["nbest"]] for t in got] == [[h.alignment for h in e] for e in expected]
        assert [t["alignment"] for t in got] == [e[0].alignment for e in expected] and got[0]["alignment"]
    plain = client.post("/v1/translate", json={"sources": lines[:1]}).json()["translations"][0]
    assert "alignment" not in plain and "alignment" not in plain["nbest"][0]  # asked for only
    r = client.post("/v1/translate", json={"sources": ["a"], "alignment": "diagonal"})
    assert r.status_code == 400 and r.json()["field"] == "alignment"


def test_v1_prefixes_start_each_translation(client, translator: Translator, lines) -> None:
    prefixes = ["Die Katze", "", "der Mann , der"]
    expected = translator.translate_lines_nbest(lines[:3], nbest=2, prefixes=prefixes)
    r = client.post("/v1/translate", json={"sources": lines[:3], "prefixes": prefixes, "nbest": 2})
    assert r.status_code == 200, r.text
    got = r.json()["translations"]
    assert [[h["translation"] for h in t["nbest"]] for t in got] == [[h.text for h in e] for e in expected]
    assert got[0]["translation"].startswith("Die Katze") and got[2]["translation"].startswith("der Mann , der")
    r = client.post("/v1/translate", json={"sources": lines[:2], "prefixes": ["", "Die ☃"]})
    assert r.status_code == 400 and "prefixes: line 2: '☃' is not in the model's vocabulary" in r.json()["error"]


def test_v1_constraints_are_translate_constraints_whatever_shares_the_round(
    client, translator, lines, prepared_toy: Config
) -> None:
    """Each line's translations hold its phrases and equal `tmt translate --constraints`'s of the line alone;
    requests with and without constraints in one round each get their own."""
    refs = Path(f"{prepared_toy.data.test}.de").read_text(encoding="utf-8").splitlines()
    constraints = [[refs[0].split()[1]], [], [refs[2].split()[0], refs[2].split()[-2]]]
    tabbed = ["\t".join([line, *c]) for line, c in zip(lines[:3], constraints, strict=True)]
    expected = [translator.translate_constrained([line], nbest=2)[0] for line in tabbed]
    batcher = client.batcher
    with_c = batcher.submit(Job(lines[:3], nbest=2, constraints=constraints))
    without = batcher.submit(Job(lines[:3], nbest=2))
    assert [[h.text for h in t] for t in with_c.result(timeout=60)] == [[h.text for h in e] for e in expected]
    assert_same_translations(without.result(timeout=60), translator.translate_lines_nbest(lines[:3], nbest=2))
    r = client.post("/v1/translate", json={"sources": lines[:3], "constraints": constraints, "nbest": 2})
    assert r.status_code == 200, r.text
    got = r.json()["translations"]
    assert [[h["translation"] for h in t["nbest"]] for t in got] == [[h.text for h in e] for e in expected]
    for t, phrases in zip(got, constraints, strict=True):
        assert all(p in h["translation"] for h in t["nbest"] for p in phrases)


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"constraints": [["x"]]}, "constraints", "has 1 entries for 2 sources"),
        ({"constraints": ["x", []]}, "constraints", "one list of phrases (strings) per source"),
        ({"constraints": [[""], []]}, "constraints[0][0]", "a non-empty phrase"),
        ({"constraints": [[], ["a\tb"]]}, "constraints[1][0]", "without tabs"),
        ({"constraints": [[], []], "prefixes": ["", ""]}, "constraints", "cannot be combined with 'prefixes'"),
        ({"constraints": [[], []], "sample": "topk:3"}, "constraints", "cannot be combined with 'sample'"),
        ({"constraints": [[], ["Hund \u2603"]]}, "constraints[1]", "constraints[1]: constraint 1"),
    ],
)
def test_v1_bad_constraints_are_400_naming_the_field(client, lines, body, field, message) -> None:
    r = client.post("/v1/translate", json={"sources": lines[:2], **body})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and message in r.json()["error"], r.json()
    assert client.post("/v1/translate", json={"sources": lines[:1]}).status_code == 200  # the worker lives on


def test_a_served_line_is_encoded_once(client, translator: Translator, lines, monkeypatch) -> None:
    """From the socket to the search each source (and prefix, and phrase) is BPE-encoded once, whether it joins
    the running search or is translated in a round of its own settings."""
    calls: list[str] = []
    encode = translator.bpe.encode
    monkeypatch.setattr(translator.bpe, "encode", lambda text, **kw: (calls.append(text), encode(text, **kw))[1])
    bodies = [
        ({"sources": lines[:3]}, 3),  # joins the continuous search
        ({"sources": lines[:3], "beam": 2}, 3),  # a round of its own settings
        ({"sources": lines[:2], "prefixes": ["Ein", ""]}, 3),
        ({"sources": lines[:2], "constraints": [["Mann"], []], "nbest": 2}, 3),
    ]
    for body, encoded in bodies:
        calls.clear()
        r = client.post("/v1/translate", json=body)
        assert r.status_code == 200, r.text
        assert len(calls) == encoded, (body, calls)
    calls.clear()
    assert client.post("/translate", json={"q": "\n".join(lines[:2])}).status_code == 200
    assert len(calls) == 2


def test_a_job_the_server_cannot_decode_is_refused_at_submit(translator: Translator, lines) -> None:
    """`Batcher.submit` judges every job as `/v1/translate` does (`mode_conflict`), also one built by hand: an
    n-best wider than the beam never joins the running search to come back short."""
    batcher = Batcher(translator, max_batch_tokens=1000, max_wait_ms=5, queue_size=4)
    with pytest.raises(RequestError, match=r"'nbest' \(5\) must be at least 1 and cannot exceed 'beam' \(4\)"):
        batcher.submit(Job(lines[:1], nbest=5))
    with pytest.raises(RequestError, match="'constraints' cannot be combined with 'prefixes'") as refused:
        batcher.submit(Job(lines[:1], prefixes=["Ein"], constraints=[["Mann"]]))
    assert refused.value.status == 400 and refused.value.field == "constraints" and batcher.depth() == 0


@pytest.fixture
def uvicorn_server(translator: Translator) -> Iterator[tuple[str, int]]:
    """The app behind a real uvicorn on a thread, with the slow-client protocol at a 0.5 s header timeout."""
    import uvicorn

    from transformer_mt.serve import listen, slow_client_protocol
    from transformer_mt.serve.app import ServerInfo, build_app

    batcher = Batcher(translator, max_batch_tokens=1000, max_wait_ms=5, queue_size=16)
    app = build_app(batcher, ServerInfo("toy.pt", "pytorch", "cpu", "none"), Limits(max_lines=8, max_chars=2000))
    sock = listen("127.0.0.1", 0)
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", ws="websockets-sansio", http=slow_client_protocol(0.5)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield sock.getsockname()[:2]
    server.should_exit = True
    thread.join(30)


def _dribble(address: tuple[str, int], head: bytes, slow: bytes, seconds: float) -> tuple[bytes, float]:
    """Send ``head``, then ``slow`` a byte every 50 ms (again and again) until the server answers or closes, or
    ``seconds`` pass; what it sent back and when."""
    import select
    import socket

    start = time.monotonic()
    with socket.create_connection(address) as s:
        s.sendall(head)
        i = 0
        while time.monotonic() - start < seconds:
            if select.select([s], [], [], 0.05)[0]:
                answer = b""
                try:
                    while chunk := s.recv(65536):
                        answer += chunk
                except ConnectionResetError:  # closed with our dribbled bytes unread: a reset after its answer
                    pass
                return answer, time.monotonic() - start
            try:
                s.sendall(slow[i % len(slow) : i % len(slow) + 1])
            except OSError:  # closed under us
                return b"", time.monotonic() - start
            i += 1
    return b"<still open>", seconds


@pytest.mark.slow
def test_a_client_that_sends_a_byte_at_a_time_is_cut_off(uvicorn_server, lines, alone, monkeypatch) -> None:
    from websockets.sync.client import connect

    import transformer_mt.serve.protocol as protocol

    answer, took = _dribble(uvicorn_server, b"", b"POST /v1/translate HTTP/1.1\r\nX-Slow: " + b"a" * 1000, 5)
    assert answer == b"" and took < 3  # headers that never end: closed after the header timeout
    monkeypatch.setattr(protocol, "BODY_TIMEOUT_S", 0.5)
    head = b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
    answer, took = _dribble(uvicorn_server, head, b'{"sources": [" ', 5)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"took more than 0.5 s" in answer and took < 3
    host, port = uvicorn_server
    with connect(f"ws://{host}:{port}/ws") as ws:  # an upgraded socket is not timed out as headers
        time.sleep(1.2)
        ws.send(lines[0])
        assert ws.recv(timeout=30) == alone[lines[0]]
