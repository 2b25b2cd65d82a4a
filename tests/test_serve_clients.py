"""LibreTranslate's real clients, every request shape, and a page on another origin, against a real `tmt serve`.

One server process (the toy checkpoint) serves the whole file; it allows
CORS for one origin only, a local page server, and a second page server on
another port stands for every origin it does not allow.
"""

from __future__ import annotations

import functools
import http.server
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import browser as _browser
from helpers import serve_alone
from helpers import start_server as _start

from transformer_mt.config import Config

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

PAGE = """<!doctype html><meta charset="utf-8"><title>elsewhere</title><p id="out"></p>
<script>
async function translate(api, q) {
  try {
    const r = await fetch(api + "/translate", {method: "POST", headers: {"Content-Type": "application/json"},
                                               body: JSON.stringify({q: q, source: "en", target: "de"})});
    document.getElementById("out").textContent = "translated: " + (await r.json()).translatedText;
  } catch (err) {
    document.getElementById("out").textContent = "refused: " + err;
  }
}
</script>"""


@pytest.fixture(scope="module")
def lines(prepared_toy: Config) -> list[str]:
    return Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:6]


@pytest.fixture(scope="module")
def expected(toy_ckpt: Path, lines: list[str]) -> dict[str, str]:
    return serve_alone(toy_ckpt, lines)


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two page servers on 127.0.0.1: the origin the API allows, and one it does not."""
    root = tmp_path_factory.mktemp("pages")
    (root / "index.html").write_text(PAGE, encoding="utf-8")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in servers)  # type: ignore[misc]
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def server(toy_ckpt: Path, pages: tuple[str, str]) -> Iterator[str]:
    from conftest import _free_port

    port = _free_port()
    proc = _start(toy_ckpt, port, "--cors-origin", pages[0], "--max-chars", "2000")
    yield f"http://127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output


def test_libretranslatepy(server: str, lines: list[str], expected: dict[str, str]) -> None:
    from libretranslatepy import LibreTranslateAPI

    for api in (LibreTranslateAPI(server), LibreTranslateAPI(server, api_key="any key")):
        assert [api.translate(line, "en", "de") for line in lines[:2]] == [expected[line] for line in lines[:2]]
        found = api.detect(lines[0])
        assert [d["language"] for d in found] == ["en"] and 0 <= found[0]["confidence"] <= 100
        assert api.languages() == httpx.get(f"{server}/languages").json()
    assert [lang["code"] for lang in api.languages()] == ["en", "de"]


def test_deep_translator(server: str, lines: list[str], expected: dict[str, str], tmp_path: Path) -> None:
    from deep_translator import LibreTranslator

    client = LibreTranslator(source="en", target="de", custom_url=server + "/", api_key="unused")
    assert client.translate(lines[0]) == expected[lines[0]]
    assert client.translate_batch(lines[:3]) == [expected[line] for line in lines[:3]]
    (tmp_path / "one.txt").write_text(lines[3], encoding="utf-8")
    assert client.translate_file(str(tmp_path / "one.txt")) == expected[lines[3]]
    by_name = LibreTranslator(source="English", target="German", custom_url=server + "/", api_key="unused")
    assert by_name.translate(lines[4]) == expected[lines[4]]


def test_every_request_shape(server: str, lines: list[str], expected: dict[str, str]) -> None:
    want = [expected[line] for line in lines[:2]]
    fields = {"q": lines[:2], "source": "en", "target": "de"}
    shapes = {
        "json": httpx.post(f"{server}/translate", json=fields),
        "form": httpx.post(f"{server}/translate", data=fields),
        "multipart": httpx.post(f"{server}/translate", files={"x": (None, "")}, data=fields),
        "query": httpx.post(f"{server}/translate", params=fields),
        "mixed": httpx.post(f"{server}/translate", params={"target": "de", "source": "en"}, data={"q": lines[:2]}),
    }
    for shape, r in shapes.items():
        assert (r.status_code, r.json()) == (200, {"translatedText": want}), shape
    r = httpx.post(f"{server}/translate", data={"q": lines[0], "target": "de", "alternatives": "2"})
    assert r.status_code == 200 and r.json()["translatedText"] == expected[lines[0]]
    assert len(r.json()["alternatives"]) == 2
    r = httpx.post(f"{server}/detect", params={"q": lines[:2]})  # one list of candidates per text
    assert [[d["language"] for d in found] for found in r.json()] == [["en"], ["en"]]
    r = httpx.get(f"{server}/languages", params={"api_key": "k"})
    assert r.status_code == 200 and r.json()[0]["code"] == "en"


def test_frontend_settings(server: str) -> None:
    settings = httpx.get(f"{server}/frontend/settings").json()
    assert settings == {
        "charLimit": 2000, "frontendTimeout": 500, "apiKeys": False, "keyRequired": False, "suggestions": False,
        "filesTranslation": True, "supportedFilesFormat": [".txt", ".html"],
        "language": {"source": {"code": "en", "name": "English"}, "target": {"code": "de", "name": "German"}},
    }  # fmt: skip


def test_bad_bodies_are_refused_in_libretranslates_shape(server: str, lines: list[str]) -> None:
    url = f"{server}/translate"
    cut = b'--x\r\nContent-Disposition: form-data; name="q"\r\n\r\nA dog'
    refused = {
        "malformed multipart": httpx.post(url, content=cut, headers={"Content-Type": "multipart/form-data; boundary=x"}),
        "no boundary": httpx.post(url, content=b"q=a", headers={"Content-Type": "multipart/form-data"}),
        "a file to /translate": httpx.post(url, files={"q": ("a.txt", b"A dog.")}, data={"target": "de"}),
        "alternatives 'two'": httpx.post(url, data={"q": "A dog.", "alternatives": "two"}),
        "form over the limit": httpx.post(url, data={"q": "a" * 100_000}),
        "detect, broken form": httpx.post(f"{server}/detect", content=b"q=%ff", headers={"Content-Type": "application/x-www-form-urlencoded"}),
    }  # fmt: skip
    statuses = {name: (r.status_code, r.json().get("field")) for name, r in refused.items()}
    assert statuses == {
        "malformed multipart": (400, None), "no boundary": (400, None), "a file to /translate": (400, "q"),
        "alternatives 'two'": (400, "alternatives"), "form over the limit": (413, None),
        "detect, broken form": (400, None),
    }  # fmt: skip
    assert all(isinstance(r.json()["error"], str) and r.json()["error"] for r in refused.values())
    assert "'two'" in refused["alternatives 'two'"].json()["error"]
    r = httpx.post(url, data={"q": lines[0], "target": "de"})  # still serving
    assert r.status_code == 200


def test_health_names_the_file_not_its_path(server: str, toy_ckpt: Path) -> None:
    health = httpx.get(f"{server}/health").json()
    assert health["model"] == toy_ckpt.name and str(toy_ckpt.parent) not in httpx.get(f"{server}/health").text


def test_cors_preflight(server: str, pages: tuple[str, str]) -> None:
    allowed, other = pages
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(f"{server}/translate", headers={"Origin": allowed, **ask})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
    r = httpx.options(f"{server}/translate", headers={"Origin": other, **ask})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_a_page_on_another_origin_in_a_real_browser(
    server: str, pages: tuple[str, str], lines: list[str], expected: dict[str, str]
) -> None:
    """The allowed origin's page gets the translation through `fetch`; the same page from an origin the server
    does not name is refused by the browser itself (the server answers no CORS headers)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = _browser()
    try:
        shown = {}
        for origin in pages:
            driver.get(origin + "/index.html")
            driver.execute_script("translate(arguments[0], arguments[1])", server, lines[0])
            WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "out").text)
            shown[origin] = driver.find_element(By.ID, "out").text
        assert shown[pages[0]] == f"translated: {expected[lines[0]]}".strip()
        assert shown[pages[1]].startswith("refused: TypeError")  # "Failed to fetch": the browser's CORS refusal
    finally:
        driver.quit()
