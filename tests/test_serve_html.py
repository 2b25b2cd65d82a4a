"""``format: "html"`` and ``/translate_file``: the HTML module's pure functions, the app through starlette's test
client, and one upload and download through a real `tmt serve` process.

Tag placement is checked with alignments written by hand (the toy model's
are random); that every tag survives any alignment is checked over many
random documents and random alignments.
"""

from __future__ import annotations

import json
import random
import signal
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from bs4 import BeautifulSoup, Tag
from helpers import quiet_translator

from transformer_mt.decode.translate import Translator
from transformer_mt.serve.batcher import Batcher
from transformer_mt.serve.html import join, split
from transformer_mt.serve.protocol import Limits

pytestmark = pytest.mark.usefixtures("one_thread")


def identity(document: str, upper: bool = True) -> str:
    """``document`` "translated" word for word (upper-cased), each word aligned to itself."""
    segments = split(document)
    return join(document, [(s.text.upper() if upper else s.text, " ".join(f"{i}-{i}" for i in range(len(s.words))))
                           for s in segments])  # fmt: skip


def tags(document: str) -> Counter:
    """Each tag of ``document`` with its attributes, counted."""
    soup = BeautifulSoup(document, "html.parser")
    return Counter((t.name, tuple(sorted((k, str(v)) for k, v in t.attrs.items()))) for t in soup.find_all(True))


# -- pure functions


def test_a_sentence_is_one_segment_whatever_inline_tags_it_holds() -> None:
    doc = '<p>A <b>big <i>red</i></b> dog &amp; a <a href="/c?x=1&amp;y=2" title="t">cat</a>.</p><p>Next.</p>'
    assert [s.text for s in split(doc)] == ["A big red dog & a cat.", "Next."]
    assert identity(doc) == (
        '<p>A <b>BIG <i>RED</i></b> DOG &amp; A <a href="/c?x=1&amp;y=2" title="t">CAT.</a></p><p>NEXT.</p>'
    )


def test_tags_follow_their_words_when_the_order_changes() -> None:
    doc = "<p>the <b>red</b> car <i>is here</i></p>"
    # "the red car is here" -> "here is car red the": word i goes to 4 - i
    out = join(doc, [("HERE IS CAR RED THE", "0-4 1-3 2-2 3-1 4-0")])
    assert out == "<p><i>HERE IS</i> CAR <b>RED</b> THE</p>"


def test_blocks_and_br_are_boundaries_and_kept_elements_are_untouched() -> None:
    doc = (
        "<div>One<br>two<ul><li>three<li>four</ul></div><script>if (a < b) x = 1;</script><style>p{}</style>"
        "<p>run <code>ls -l</code> now</p><pre> keep  me </pre><!-- a comment --><p translate='no'>Name</p>"
        "<table><tr><td>five</td><td>six</td></tr></table>"
    )
    assert [s.text for s in split(doc)] == ["One", "two", "three", "four", "run", "now", "five", "six"]
    out = identity(doc)
    for kept in ("<script>if (a < b) x = 1;</script>", "<style>p{}</style>", "<code>ls -l</code>",
                 "<pre> keep  me </pre>", "<!-- a comment -->", '<p translate="no">Name</p>'):  # fmt: skip
        assert kept in out
    assert "ONE<br/>TWO" in out and "<td>FIVE</td><td>SIX</td>" in out


def test_unclosed_and_empty_tags_and_whitespace() -> None:
    doc = "<p>  an <b>unclosed tag <i></i>here</p><p>and <img src='x.png'> an image\n"  # closed where the parser does
    assert [s.text for s in split(doc)] == ["an unclosed tag here", "and an image"]
    out = identity(doc)
    assert tags(out) == tags(doc)
    assert out == '<p>  AN <b>UNCLOSED TAG<i></i> HERE</b></p><p>AND<img src="x.png"/> AN IMAGE\n</p>'


def test_a_word_cut_by_a_tag_is_one_word() -> None:
    doc = "<p>a <b>big</b>ger dog</p>"
    assert [s.words for s in split(doc)] == [["a", "bigger", "dog"]]
    assert identity(doc) == "<p>A <b>BIGGER</b> DOG</p>"


def test_soft_alignments_place_tags_by_the_links_both_directions_agree_on() -> None:
    doc = "<p>around the <b>barrel.</b></p>"
    # "um das Fass herum.": "herum." likeliest from "barrel.", but "barrel." likeliest to "Fass"
    soft = "0.80,0.10,0.10 0.10,0.80,0.10 0.10,0.10,0.80 0.20,0.10,0.70"
    assert join(doc, [("um das Fass herum.", soft)]) == "<p>um das <b>Fass</b> herum.</p>"
    hard = "0-0 1-1 2-2 2-3"
    assert join(doc, [("um das Fass herum.", hard)]) == "<p>um das <b>Fass herum.</b></p>"
    # no link at all for the tag's word: the target words of the nearest source word ("a": both)
    assert join("<p>a <b>b</b></p>", [("x y", "0.6,0.4 0.7,0.3")]) == "<p><b>x y</b></p>"


def test_a_tag_whose_words_got_no_alignment_wraps_the_nearest_aligned_words() -> None:
    doc = "<p>one two three <b>four</b> five</p>"
    assert join(doc, [("EINS ZWEI DREI FUENF", "0-0 1-1 2-2")]) == "<p>EINS ZWEI <b>DREI</b> FUENF</p>"
    assert join(doc, [("EINS ZWEI", "")]) == "<p>EINS ZWEI<b></b></p>"  # no alignment at all: at the end


def test_no_segments_and_no_words() -> None:
    for doc in ("", "<p></p>", "<p>  </p><br>", "<!-- x -->", "<script>a b</script>"):
        assert split(doc) == []
        assert join(doc, []) == str(BeautifulSoup(doc, "html.parser"))
    with pytest.raises(ValueError, match="1 translations for 0 segments"):
        join("<p></p>", [("x", "")])


def random_document(rng: random.Random, depth: int = 0) -> str:
    parts = []
    for _ in range(rng.randint(0, 4)):
        kind = rng.random()
        if kind < 0.45 or depth > 3:
            parts.append(rng.choice(["", " "]) + " ".join(rng.choices(["cat", "dog", "&amp;", "a", "x."], k=3)))
        elif kind < 0.8:
            name = rng.choice(["b", "i", "em", "span", "a"])
            attrs = f' href="/p?{rng.randint(0, 9)}"' if name == "a" else ""
            parts.append(f"<{name}{attrs}>{random_document(rng, depth + 1)}</{name}>")
        elif kind < 0.9:
            parts.append(rng.choice(["<br>", "<img src='i.png'>", "<!-- c -->", "<code>k</code>"]))
        else:
            parts.append(f"<p>{random_document(rng, depth + 1)}</p>")
    return "".join(parts)


def test_no_tag_lost_or_duplicated_over_many_random_documents_and_alignments() -> None:
    rng = random.Random(7)
    for _ in range(400):
        doc = random_document(rng)
        translations = []
        for segment in split(doc):
            n = rng.randint(1, len(segment.words) + 2)
            pairs = {f"{rng.randrange(len(segment.words) + 1)}-{j}" for j in range(n) if rng.random() < 0.8}
            translations.append((" ".join(["w"] * n), " ".join(sorted(pairs))))
        out = join(doc, translations)
        assert tags(out) == tags(doc), doc
        assert len(split(out)) == len(translations), doc
        assert all(isinstance(t, Tag) for t in BeautifulSoup(out, "html.parser").find_all(True))


# -- through the app


@pytest.fixture(scope="module")
def translator(toy_ckpt: Path) -> Translator:
    return quiet_translator(toy_ckpt)


@pytest.fixture(scope="module")
def client(translator: Translator):
    from starlette.testclient import TestClient

    from transformer_mt.serve.app import ServerInfo, build_app

    batcher = Batcher(translator, max_batch_tokens=1000, max_wait_ms=5, queue_size=16)
    app = build_app(batcher, ServerInfo("toy.pt", "pytorch", "cpu", "none"), Limits(max_lines=8, max_chars=2000))
    with TestClient(app) as c:
        yield c


def test_format_html_translates_the_segments_as_text_would(client, translator: Translator) -> None:
    doc = '<p>a <b>man</b> rides a <a href="/h">horse</a> .</p><ul><li>two dogs</li></ul><script>x</script>'
    r = client.post("/translate", json={"q": [doc, "plain"], "source": "en", "target": "de", "format": "html"})
    assert r.status_code == 200, r.text
    out = r.json()["translatedText"]
    assert tags(out[0]) == tags(doc) and out[0].endswith("<script>x</script>")
    want = translator.translate_lines(["a man rides a horse .", "two dogs", "plain"])
    assert [s.text for s in split(out[0])] == want[:2] and out[1] == want[2]
    r = client.post("/translate", json={"q": doc, "source": "en", "target": "de", "format": "html", "alternatives": 1})
    assert r.status_code == 200, r.text
    assert tags(r.json()["translatedText"]) == tags(doc) and tags(r.json()["alternatives"][0]) == tags(doc)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"q": "<p>a</p>", "format": "markdown"}, 400, "'text' or 'html'"),
        ({"q": "<b>" + "a " * 1500 + "</b>", "format": "html"}, 413, "--max-chars"),
        ({"q": "".join(f"<p>{i}</p>" for i in range(9)), "format": "html"}, 413, "--max-lines"),
        ({"q": "<b>" * 600 + "a", "format": "html"}, 400, "nests elements too deeply"),
    ],
)
def test_bad_html_requests(client, body: dict, status: int, message: str) -> None:
    r = client.post("/translate", json={"source": "en", "target": "de", **body})
    assert r.status_code == status and message in r.json()["error"] and r.json()["field"] in ("q", "format")
    assert client.post("/translate", json={"q": "a", "source": "en", "target": "de"}).status_code == 200


def test_translate_file_txt_and_html(client, translator: Translator) -> None:
    text = "a man .\ntwo dogs\n"
    r = client.post("/translate_file", data={"source": "en", "target": "de", "api_key": ""},
                    files={"file": ("notes.txt", text.encode(), "text/plain")})  # fmt: skip
    assert r.status_code == 200, r.text
    url = r.json()["translatedFileUrl"]
    assert url.startswith("http://testserver/download_file/") and url.endswith(".notes.txt")
    got = client.get(url)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    assert got.text == "\n".join([*translator.translate_lines(["a man .", "two dogs"]), ""])
    assert 'filename="notes.txt"' in got.headers["content-disposition"]
    doc = "<html><body><h1>a man</h1><p>two <i>dogs</i></p></body></html>"
    r = client.post("/translate_file", data={"source": "en", "target": "de"},
                    files={"file": ("page.HTML", doc.encode(), "text/html")})  # fmt: skip
    got = client.get(r.json()["translatedFileUrl"])
    assert got.headers["content-type"].startswith("text/html") and tags(got.text) == tags(doc)
    r = client.post(
        "/translate_file", data={"target": "de"}, files={"file": ("注記 ü.txt", b"a man .\n", "text/plain")}
    )
    got = client.get(r.json()["translatedFileUrl"])  # a name in any script: an ASCII fallback and the UTF-8 name
    assert got.status_code == 200, got.text
    assert got.headers["content-disposition"] == (
        "attachment; filename=\"____.txt\"; filename*=UTF-8''%E6%B3%A8%E8%A8%98_%C3%BC.txt"
    )


@pytest.mark.parametrize(
    ("files", "status", "message"),
    [
        ({"file": ("a.pdf", b"%PDF", "application/pdf")}, 400, "rename a plain-text file to .txt"),
        ({"file": ("a.txt", b"caf\xe9", "text/plain")}, 400, "is not UTF-8 (byte 3); save it as UTF-8"),
        ({"file": ("a.txt", b"a " * 2000, "text/plain")}, 413, "--max-chars"),
        ({"file": ("a.txt", b"a" * 300_000, "text/plain")}, 413, "split it and send the parts"),
        ({"other": ("a.txt", b"a", "text/plain")}, 400, "missing 'file'"),
    ],
)
def test_bad_files(client, files: dict, status: int, message: str) -> None:
    r = client.post("/translate_file", data={"source": "en", "target": "de"}, files=files)
    assert r.status_code == status and message in r.json()["error"], r.text
    assert client.post("/translate", json={"q": "a", "source": "en", "target": "de"}).status_code == 200


def test_bad_forms_and_unknown_downloads(client) -> None:
    r = client.post("/translate_file", content=b"{}", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]
    r = client.post("/translate_file", content=b"--x\r\nbroken", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and r.json()["field"] == "file"
    r = client.get("/download_file/nothing.txt")
    assert r.status_code == 404 and "translate it again" in r.json()["error"]


def test_only_the_newest_files_are_kept(client) -> None:
    from transformer_mt.serve.app import KEPT_FILES

    urls = [
        client.post("/translate_file", data={"target": "de", "source": "en"},
                    files={"file": ("a.txt", b"a", "text/plain")}).json()["translatedFileUrl"]
        for _ in range(KEPT_FILES + 1)
    ]  # fmt: skip
    assert client.get(urls[0]).status_code == 404 and client.get(urls[-1]).status_code == 200


def test_html_needs_alignments_of_one_model(toy_ckpt: Path) -> None:
    from starlette.testclient import TestClient

    from transformer_mt.serve.app import ServerInfo, build_app

    ensemble = Translator.from_checkpoints([toy_ckpt, toy_ckpt], device="cpu", ensemble=True)
    batcher = Batcher(ensemble, max_batch_tokens=1000, max_wait_ms=5, queue_size=16)
    with TestClient(build_app(batcher, ServerInfo("toy.pt", "pytorch", "cpu", "none"), Limits())) as client:
        r = client.post("/translate", json={"q": "<b>a</b>", "source": "en", "target": "de", "format": "html"})
        assert r.status_code == 400 and "runs an ensemble" in r.json()["error"] and r.json()["field"] == "format"
        assert client.post("/translate", json={"q": "a", "source": "en", "target": "de"}).status_code == 200


# -- a real process


@pytest.mark.slow
def test_upload_and_download_through_a_real_server(toy_ckpt: Path, translator: Translator) -> None:
    from conftest import _free_port
    from helpers import start_server as _start

    port = _free_port()
    proc = _start(toy_ckpt, port)
    try:
        boundary = "tmtboundary"
        doc = "<p>a <b>man</b> rides</p>\n<p>two dogs</p>"
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="source"\r\n\r\nen\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="target"\r\n\r\nde\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="page.html"\r\n'
            f"Content-Type: text/html\r\n\r\n{doc}\r\n--{boundary}--\r\n"
        ).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/translate_file", data=body,
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            url = json.loads(r.read())["translatedFileUrl"]
        assert url.startswith(f"http://127.0.0.1:{port}/download_file/")
        with urllib.request.urlopen(url, timeout=60) as r:
            out = r.read().decode()
        assert tags(out) == tags(doc)
        assert [s.text for s in split(out)] == translator.translate_lines(["a man rides", "two dogs"])
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "Traceback" not in output, output
