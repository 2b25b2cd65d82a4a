"""`tmt serve` as operators run it: API keys, request limits, ``/metrics`` and the access log.

One real `tmt serve` process per module, started with a keys file,
``--req-limit`` and ``--log-format json``, its stderr in a file the tests
read; the keys file's parser, the limiter (with an injected clock) and the
key's lookup in a request are tested alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transformer_mt.serve.keys import WINDOW_S, KeysFileError, Limiter, Policy, api_key, read_keys
from transformer_mt.serve.observe import access_line

BIG, SMALL, PLAIN = "big-Key-0a1b2c3d4e", "small-Key-5f6a7b8c9d", "plain-Key-0e1f2a3b4c"
KEYS_FILE = f"# keys of the test server\n{BIG} 1000\n\n{SMALL} 2   # two a minute\n{PLAIN}\n"
REQ_LIMIT = 5
LINE = "A man is riding a bike."


def _call(url: str, data: bytes | None = None, content_type: str = "application/json") -> tuple[int, dict, Any]:
    """(status, JSON answer ({} for another type), headers) of a GET (``data`` None) or a POST."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, _json(r.headers, r.read()), r.headers
    except urllib.error.HTTPError as err:
        return err.code, _json(err.headers, err.read()), err.headers


def _json(headers: Any, body: bytes) -> dict:
    return json.loads(body) if headers.get_content_type() == "application/json" else {}


def _translate(server: str, key: str | None, q: str | list[str] = LINE, path: str = "/translate") -> tuple:
    body = {"q": q, "source": "en", "target": "de", **({"api_key": key} if key is not None else {})}
    return _call(server + path, json.dumps(body).encode())


@pytest.fixture(scope="module")
def served(toy_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The server's URL and the file its stderr goes to; at the end it must stop cleanly, without a traceback."""
    from conftest import _free_port

    folder = tmp_path_factory.mktemp("ops")
    (folder / "keys.txt").write_text(KEYS_FILE)
    log = folder / "stderr.log"
    port = _free_port()
    args = ["--api-keys", str(folder / "keys.txt"), "--req-limit", str(REQ_LIMIT), "--log-format", "json"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "transformer_mt", "serve", "-c", str(toy_ckpt), "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    server = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if _call(f"{server}/health")[0] == 200:
                break
        except OSError:
            assert time.monotonic() < deadline, "tmt serve did not answer /health within 120 s"
            time.sleep(0.2)
    yield server, log
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    output = log.read_text()
    assert proc.returncode == 0 and "Traceback" not in output, output
    for key in (BIG, SMALL, PLAIN):
        assert key not in output and key[:8] not in output  # not the key, not even a prefix


def _metrics(server: str) -> dict[tuple[str, tuple], float]:
    """Each sample of ``/metrics``, parsed by prometheus_client's own parser: (name, labels) -> value."""
    with urllib.request.urlopen(f"{server}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
def test_a_valid_key_in_the_body_or_the_query_is_served(served: tuple[str, Path]) -> None:
    server, _ = served
    status, body, _ = _translate(server, BIG)
    assert status == 200 and isinstance(body["translatedText"], str) and body["translatedText"]
    query = urllib.parse.urlencode({"api_key": BIG})
    status, again, _ = _call(f"{server}/translate?{query}", json.dumps({"q": LINE, "target": "de"}).encode())
    assert status == 200 and again["translatedText"] == body["translatedText"]
    assert _translate(server, BIG, path="/detect")[0] == 200
    status, _, _ = _call(f"{server}/v1/translate", json.dumps({"sources": [LINE], "api_key": BIG}).encode())
    assert status == 200


@pytest.mark.slow
def test_a_form_body_carries_its_key_past_the_gate(served: tuple[str, Path]) -> None:
    """What the route then makes of a form is its own; the gate reads the key from it either way."""
    server, _ = served
    for key, refused in ((BIG, False), ("nope", True)):
        form = urllib.parse.urlencode({"q": LINE, "target": "de", "api_key": key}).encode()
        status = _call(f"{server}/translate", form, "application/x-www-form-urlencoded")[0]
        assert (status == 403) == refused
        boundary = "tmtboundary"
        multipart = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="q"\r\n\r\n{LINE}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="api_key"\r\n\r\n{key}\r\n--{boundary}--\r\n'
        ).encode()
        status = _call(f"{server}/translate", multipart, f"multipart/form-data; boundary={boundary}")[0]
        assert (status == 403) == refused


@pytest.mark.slow
def test_a_file_needs_the_key_and_its_download_needs_only_its_name(served: tuple[str, Path]) -> None:
    import httpx

    server, _ = served
    upload = {"file": ("notes.txt", f"{LINE}\n".encode(), "text/plain")}
    refused = httpx.post(f"{server}/translate_file", data={"target": "de", "api_key": "nope"}, files=upload)
    assert refused.status_code == 403 and refused.json()["field"] == "api_key"
    done = httpx.post(f"{server}/translate_file", data={"target": "de", "api_key": BIG}, files=upload, timeout=60)
    assert done.status_code == 200, done.text
    got = httpx.get(done.json()["translatedFileUrl"])  # no key: the random name is the file's
    assert got.status_code == 200 and got.text.strip()


@pytest.mark.slow
def test_a_wrong_or_missing_key_is_403_and_open_paths_stay_open(served: tuple[str, Path]) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    server, _ = served
    for key in (None, "", BIG + "x", BIG[:-1], SMALL.upper()):
        status, body, _ = _translate(server, key)
        assert status == 403 and set(body) == {"error", "field"} and body["field"] == "api_key", (key, body)
    assert _call(f"{server}/v1/translate", json.dumps({"sources": [LINE]}).encode())[0] == 403
    assert _call(f"{server}/translate", b"{not json")[0] == 403  # a body that is no JSON carries no key
    for path in ("/health", "/languages", "/metrics", "/", "/frontend/settings"):
        assert _call(server + path)[0] == 200, path
    settings = _call(server + "/frontend/settings")[1]
    assert settings["apiKeys"] is settings["keyRequired"] is True  # LibreTranslate's clients ask for a key
    with pytest.raises(InvalidStatus) as refused:
        connect(server.replace("http", "ws") + "/ws", open_timeout=30)
    assert refused.value.response.status_code == 403
    with connect(server.replace("http", "ws") + f"/ws?api_key={BIG}", open_timeout=30) as ws:
        ws.send(LINE)
        assert ws.recv(timeout=60)
    assert _translate(server, BIG)[0] == 200  # still serving


@pytest.mark.slow
def test_a_body_past_the_limit_is_413_with_or_without_a_key(served: tuple[str, Path]) -> None:
    server, _ = served
    for key in (BIG, None):
        status, body, headers = _translate(server, key, "word " * 100_000)  # 500 kB, past the default 225 kB
        assert status == 413 and set(body) == {"error", "field"} and headers["Connection"] == "close"
    assert _translate(server, BIG)[0] == 200


@pytest.mark.slow
def test_a_key_of_its_own_limit_then_429_with_retry_after(served: tuple[str, Path]) -> None:
    server, _ = served
    assert [_translate(server, SMALL)[0] for _ in range(2)] == [200, 200]
    status, body, headers = _translate(server, SMALL)
    assert status == 429 and set(body) == {"error", "field"} and "2 requests per minute" in body["error"]
    assert 1 <= int(headers["Retry-After"]) <= WINDOW_S
    assert _translate(server, BIG)[0] == 200  # another key is not held back


@pytest.mark.slow
def test_a_key_without_a_limit_shares_its_address_limit(served: tuple[str, Path]) -> None:
    server, _ = served
    statuses = [_translate(server, PLAIN)[0] for _ in range(REQ_LIMIT + 1)]
    assert statuses == [200] * REQ_LIMIT + [429]
    status, body, headers = _translate(server, PLAIN, path="/detect")
    assert status == 429 and int(headers["Retry-After"]) >= 1 and f"{REQ_LIMIT} requests" in body["error"]


@pytest.mark.slow
def test_metrics_move_by_what_was_sent(served: tuple[str, Path]) -> None:
    server, _ = served
    before = _metrics(server)
    lines = [LINE, "Two dogs play in the snow.", "A woman reads."]
    assert _translate(server, BIG, lines)[0] == 200
    assert _translate(server, "wrong")[0] == 403
    after = _metrics(server)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("tmt_requests_total", endpoint="/translate", status="200") == 1
    assert moved("tmt_requests_total", endpoint="/translate", status="403") == 1
    assert moved("tmt_lines_translated_total") == len(lines)
    assert moved("tmt_tokens_translated_total") >= 2 * len(lines)  # a word and EOS at least, each line
    assert moved("tmt_request_duration_seconds_count", endpoint="/translate") == 2
    assert moved("tmt_request_duration_seconds_bucket", endpoint="/translate", le="+Inf") == 2
    assert after[("tmt_queue_depth", ())] == 0
    assert ("tmt_search_sentences", ()) in after and ("tmt_search_steps_total", ()) in after
    assert moved("tmt_requests_total", endpoint="other", status="404") == 0
    _call(f"{server}/no/such/path?api_key={BIG}")
    assert _metrics(server)[("tmt_requests_total", (("endpoint", "other"), ("status", "404")))] >= 1


@pytest.mark.slow
def test_one_json_log_line_per_request_without_text_or_key(served: tuple[str, Path]) -> None:
    server, log = served
    query = urllib.parse.urlencode({"api_key": BIG})
    assert _call(f"{server}/translate?{query}", json.dumps({"q": [LINE, LINE], "target": "de"}).encode())[0] == 200
    assert _translate(server, "not-a-key")[0] == 403
    deadline = time.monotonic() + 10
    while True:
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        if len(entries) >= 2 and entries[-1]["status"] == 403 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    served_, refused = entries[-2], entries[-1]
    assert served_["path"] == "/translate" and served_["method"] == "POST" and served_["status"] == 200
    assert served_["lines"] == 2 and served_["client"] == "127.0.0.1" and served_["ms"] > 0
    assert refused["status"] == 403 and refused["lines"] is None
    assert set(served_) == {"time", "client", "method", "path", "status", "ms", "lines"}
    text = log.read_text()
    assert LINE not in text and "api_key" not in text.replace('"error"', "")


def test_the_text_log_line() -> None:
    scope = {"client": ("10.0.0.7", 5123), "method": "POST", "path": "/translate\nfake 200"}
    line = access_line("text", scope, 429, 0.01234, 3)
    assert "\n" not in line and line.endswith(" 10.0.0.7 POST /translate\\nfake 200 429 12.3 ms lines=3")
    line = access_line("text", {**scope, "client": None, "method": "GET", "path": "/health"}, 200, 0.001, None)
    assert line.endswith(" - GET /health 200 1.0 ms lines=-")


@pytest.mark.slow
def test_a_malformed_keys_file_stops_the_server_at_start(tmp_path: Path, toy_ckpt: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("good-key 10\nbad-key ten\n")
    done = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "serve", "-c", str(toy_ckpt), "--port", "0", "--api-keys", str(keys)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert f"{keys}, line 2" in done.stderr and "good-key" not in done.stderr and "Traceback" not in done.stderr


def test_the_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    assert read_keys(path) == {BIG: 1000, SMALL: 2, PLAIN: None}
    for text, why in (
        ("a 1\nb 2 3\n", "line 2"), ("a 0\n", "line 1"), ("a -1\n", "line 1"), ("a x\n", "line 1"),
        ("a\n\na 5\n", "line 3: this key is given twice"), ("# none\n\n", "no key"),
    ):  # fmt: skip
        path.write_text(text)
        with pytest.raises(KeysFileError, match=why) as err:
            read_keys(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
        assert "b 2 3" not in str(err.value)  # the line itself may hold a key: never echoed
    with pytest.raises(KeysFileError, match="cannot read"):
        read_keys(tmp_path / "missing")


def test_the_limiter_slides_its_window_and_forgets_old_names() -> None:
    now = [1000.0]
    limiter = Limiter(max_names=3, clock=lambda: now[0])
    assert limiter.admit("a", 2) == 0
    now[0] += 10
    assert limiter.admit("a", 2) == 0
    assert limiter.admit("a", 2) == pytest.approx(WINDOW_S - 10)  # until the first leaves the window
    assert limiter.admit("b", 2) == 0  # each name its own
    now[0] += WINDOW_S - 10
    assert limiter.admit("a", 2) == 0  # the first has left; the second is still in
    assert limiter.admit("a", 2) == pytest.approx(10)
    for name in ("c", "d", "e"):
        limiter.admit(name, 2)
    assert list(limiter.seen) == ["c", "d", "e"]  # bounded: the names seen longest ago dropped
    assert limiter.admit("a", 2) == 0  # forgotten, so counted afresh


def test_the_key_of_a_request_wherever_it_is() -> None:
    assert api_key("api_key=q1&x=2", "application/json", b'{"api_key": "j"}') == "q1"
    assert api_key("", "application/json", b'{"q": "x", "api_key": "j"}') == "j"
    assert api_key("", "application/json; charset=utf-8", b'{"api_key": 5}') is None
    assert api_key("", "", b'["api_key"]') is None and api_key("", "", b"\xff{") is None
    assert api_key("", "application/x-www-form-urlencoded", b"q=a&api_key=f%2B1") == "f+1"
    multipart = b'--B\r\nContent-Disposition: form-data; name="api_key"\r\n\r\nm1\r\n--B--\r\n'
    assert api_key("", "multipart/form-data; boundary=B", multipart) == "m1"
    assert api_key("", "multipart/form-data; boundary=B", b"--B\r\ngarbage") is None
    assert api_key("", "multipart/form-data", multipart) is None  # no boundary


def test_a_key_is_found_only_whole() -> None:
    policy = Policy({"k1": None, "k2": 5})
    assert policy.find("k2") == "k2" and policy.find("k") is None and policy.find("k22") is None
    assert policy.find(None) is None and policy.find("") is None
    assert not Policy() and Policy(req_limit=1) and Policy({"k": None})


def test_a_keyless_server_limits_each_address_and_logs_text(toy_ckpt: Path) -> None:
    from starlette.testclient import TestClient

    from transformer_mt.decode.translate import Translator
    from transformer_mt.serve.app import ServerInfo, build_app
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.protocol import Limits

    translator = Translator.from_checkpoints([toy_ckpt], device="cpu")
    batcher = Batcher(translator, max_batch_tokens=1000, max_wait_ms=5, queue_size=4)
    logged: list[str] = []
    app = build_app(
        batcher, ServerInfo("toy.pt", "pytorch", "cpu", "none"), Limits(), policy=Policy(req_limit=2),
        log=logged.append,
    )  # fmt: skip
    with TestClient(app) as client:
        answers = [client.post("/translate", json={"q": [LINE, LINE], "target": "de"}) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 429]
        assert 1 <= int(answers[2].headers["Retry-After"]) <= WINDOW_S and "error" in answers[2].json()
        assert client.get("/health").status_code == 200  # open, and not counted
    fields = [line.split() for line in logged]  # time, client, method, path, status, ms, "ms", lines
    assert [f[1:5] + f[7:] for f in fields] == [
        ["testclient", "POST", "/translate", "200", "lines=2"], ["testclient", "POST", "/translate", "200", "lines=2"],
        ["testclient", "POST", "/translate", "429", "lines=-"], ["testclient", "GET", "/health", "200", "lines=-"],
    ]  # fmt: skip
    assert all(float(f[5]) >= 0 and f[6] == "ms" for f in fields)
