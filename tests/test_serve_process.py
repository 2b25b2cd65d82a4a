"""A real `tmt serve` process on a free local port: HTTP, the WebSocket, SIGTERM, and the demo page in Chromium.

The browser test drives Debian's ``chromium`` through its ``chromedriver``
(Selenium). `.ci/run` installs both; where they are missing the test is
skipped, except under CI (``CI=true``), where a missing browser fails it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import browser as _browser
from helpers import request_json as _request
from helpers import serve_alone
from helpers import start_server as _start

from transformer_mt.config import Config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lines(prepared_toy: Config) -> list[str]:
    return Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:12]


@pytest.fixture(scope="module")
def expected(toy_ckpt: Path, lines: list[str]) -> dict[str, str]:
    return serve_alone(toy_ckpt, lines)


@pytest.fixture(scope="module")
def server(toy_ckpt: Path) -> Iterator[str]:
    from conftest import _free_port

    port = _free_port()
    proc = _start(toy_ckpt, port)
    yield f"http://127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output


@pytest.mark.slow
def test_http_and_websocket(server: str, lines: list[str], expected: dict[str, str]) -> None:
    from websockets.sync.client import connect

    status, body = _request(f"{server}/translate", {"q": lines[:4], "source": "en", "target": "de"})
    assert status == 200 and body["translatedText"] == [expected[line] for line in lines[:4]]
    status, body = _request(f"{server}/v1/translate", {"sources": ["", lines[4]], "nbest": 2})
    assert status == 200 and [t["translation"] for t in body["translations"]] == ["", expected[lines[4]]]
    status, body = _request(f"{server}/translate", {"q": "a", "target": "fr"})
    assert status == 400 and body["field"] == "target"
    with connect(server.replace("http", "ws") + "/ws") as ws:
        for line in lines:
            ws.send(line)
        assert [ws.recv(timeout=60) for _ in lines] == [expected[line] for line in lines]
    health = _request(f"{server}/health")[1]
    assert health["lines"] >= 4 + 2 + len(lines) and health["threads"] == "1 from OMP_NUM_THREADS"


@pytest.mark.slow
def test_sigterm_finishes_what_is_in_flight(toy_ckpt: Path, lines: list[str], expected: dict[str, str]) -> None:
    from conftest import _free_port

    port = _free_port()
    proc = _start(toy_ckpt, port, "--max-lines", "1000", "--max-chars", "100000")
    many = lines * 40
    answers: list[tuple[int, dict]] = []
    client = threading.Thread(
        target=lambda: answers.append(_request(f"http://127.0.0.1:{port}/translate", {"q": many}))
    )
    client.start()
    time.sleep(0.3)  # the request is in the worker
    proc.send_signal(signal.SIGTERM)
    client.join(120)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    status, body = answers[0]
    assert status == 200 and body["translatedText"] == [expected[line] for line in many]
    with pytest.raises(OSError):  # stopped: refuses new work
        _request(f"http://127.0.0.1:{port}/health", timeout=2)


def _raw_websocket(port: int) -> socket.socket:
    """A WebSocket opened by hand, so that a test can send what no client library would: half a frame, a flood,
    and a connection dropped without a close frame."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        f"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert s.recv(4096).startswith(b"HTTP/1.1 101 ")
    return s


def _frame(payload: bytes, opcode: int = 1) -> bytes:
    """One masked client frame (opcode 1: text, 2: binary) of fewer than 65536 bytes."""
    mask = os.urandom(4)
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
    return bytes([0x80 | opcode]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _raw_post(port: int, path: str, body: bytes, length: int | None = None) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.slow
def test_bad_clients_are_answered_and_logged_in_one_line_and_sigterm_still_stops(toy_ckpt: Path, lines) -> None:
    """What made the server answer 500 with a traceback, or hold SIGTERM for good: a lone surrogate, deep
    nesting, a 5000-digit number, a huge declared body; a binary message, a client gone in the middle of a
    message, and one that sends more lines than its queue holds and drops the connection without a close frame."""
    from conftest import _free_port

    port = _free_port()
    proc = _start(toy_ckpt, port)
    for path, body, length, status in [
        ("/translate", b'{"q": "\\ud800", "source": "en", "target": "de"}', None, b"400"),
        ("/v1/translate", b"[" * 100_000, None, b"400"),
        ("/v1/translate", b'{"sources": ["a"], "beam": ' + b"9" * 5000 + b"}", None, b"400"),
        ("/v1/translate", b"", 10**11, b"413"),
    ]:
        assert _raw_post(port, path, body, length).startswith(b"HTTP/1.1 " + status), path
    with _raw_websocket(port) as ws:
        ws.sendall(_frame(b"\x00\x01", opcode=2))
        assert ws.recv(4096).startswith(b"\x88") and ws.recv(4096) == b""  # a close frame, then the end
    with _raw_websocket(port) as ws:
        ws.sendall(_frame(lines[0].encode())[:5])  # half a message, then gone
    with _raw_websocket(port) as ws:
        for _ in range(1000):  # the server queues 256 and stops reading
            ws.sendall(_frame(lines[0].encode()))
        ws.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # gone, no close frame
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=30)[0]  # it ran past 90 s before
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "Exception" not in output, output
    logged = [line for line in output.splitlines() if line.startswith("WARNING:")]
    assert len(logged) == 3 and "a binary message" in logged[0], output
    assert re.search(r"left \(close code 100[56]\)$", logged[1]), output  # no close frame: 1005 or 1006
    assert re.search(r"left \(close code 1006\); its \d+ lines not answered yet were cancelled$", logged[2]), output
    assert output.splitlines()[-1] == "stopping on SIGTERM: answering what is in flight (again to stop at once)"


@pytest.mark.slow
def test_a_second_signal_stops_at_once(toy_ckpt: Path, lines: list[str]) -> None:
    from conftest import _free_port

    port = _free_port()
    proc = _start(toy_ckpt, port, "--max-lines", "1000", "--max-chars", "100000")
    client = threading.Thread(
        target=lambda: _raw_post(port, "/translate", json.dumps({"q": lines * 80}).encode()), daemon=True
    )
    client.start()
    _await_search(port)  # the request is in the worker: a signal now must not wait for it
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=10)[0]
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output
    assert output.splitlines()[-1].startswith("interrupted: SIGINT again, stopped at once"), output


def _await_search(port: int, timeout: float = 60) -> None:
    """Until the server's search has taken a step: polled, not slept, so that a loaded machine cannot make the
    signal come before the request is in flight."""
    deadline = time.monotonic() + timeout
    while _request(f"http://127.0.0.1:{port}/health", timeout=10)[1]["steps"] == 0:
        assert time.monotonic() < deadline, "the request never reached the search"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_port_in_use_is_one_line(toy_ckpt: Path, server: str) -> None:
    port = server.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "serve", "-c", str(toy_ckpt), "--port", port],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "error: could not listen on" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_demo_page_in_a_real_browser(server: str, lines: list[str], expected: dict[str, str], tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = _browser()
    try:
        driver.get(server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "English (en) → German (de)" in d.find_element(By.ID, "model").text)
        driver.find_element(By.ID, "source").send_keys(lines[0])
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: d.find_element(By.ID, "output").text.strip())
        assert driver.find_element(By.ID, "output").text == expected[lines[0]].strip()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap td"))  # the cross-attention map
        assert driver.find_element(By.ID, "error").text == ""
        driver.save_screenshot(str(tmp_path / "demo.png"))
    finally:
        driver.quit()
