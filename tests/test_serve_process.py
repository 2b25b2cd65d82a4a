"""A real `tmt serve` process on a free local port: HTTP, the WebSocket, SIGTERM, and the demo page in Chromium.

The browser test drives Debian's ``chromium`` through its ``chromedriver``
(Selenium). `.ci/run` installs both; where they are missing the test is
skipped, except under CI (``CI=true``), where a missing browser fails it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from transformer_mt.config import Config
from transformer_mt.decode.translate import Translator

pytestmark = pytest.mark.usefixtures("one_thread")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _request(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _start(checkpoint: Path, port: int, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", "serve", "-c", str(checkpoint), "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tmt serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if _request(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("tmt serve did not answer /health within 120 s")


@pytest.fixture(scope="module")
def lines(prepared_toy: Config) -> list[str]:
    return Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:12]


@pytest.fixture(scope="module")
def expected(toy_ckpt: Path, lines: list[str]) -> dict[str, str]:
    """`tmt translate`'s output for each line, translated alone."""
    t = Translator.from_checkpoints([toy_ckpt], device="cpu")
    t.show_progress = False
    return {line: t.translate_lines([line])[0] for line in lines}


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


@pytest.mark.slow
def test_a_port_in_use_is_one_line(toy_ckpt: Path, server: str) -> None:
    port = server.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "serve", "-c", str(toy_ckpt), "--port", port],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "error: could not listen on" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def _browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the browser test: .ci/run installs chromium and chromium-driver")
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


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
