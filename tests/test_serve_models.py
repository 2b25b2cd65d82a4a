"""One server, several bilingual models: each request answered by the model of its direction, as that model's own
`tmt translate` would, through the app, the worker and a real `tmt serve` process."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from pathlib import Path

import pytest

from transformer_mt.config import Config
from transformer_mt.errors import UserError
from transformer_mt.serve.protocol import Job

pytest.importorskip("starlette")
pytestmark = pytest.mark.usefixtures("one_thread")

from helpers import quiet_translator, request_json, start_server, write_checkpoint  # noqa: E402

ENGLISH = ["A dog runs across the green grass.", "Two children play in the park."]
GERMAN = ["Ein Hund läuft über das grüne Gras.", "Zwei Kinder spielen im Park."]
FRENCH = ["Un chien court sur l'herbe verte.", "Deux enfants jouent dans le parc."]


def checkpoint_of(cfg: Config, root: Path, src: str, tgt: str, seed: int, **decode: object) -> Path:
    """A random-weight model of ``src``-``tgt`` on the toy vocabulary, short outputs; ``decode``: other settings."""
    data = dataclasses.replace(cfg.data, src_lang=src, tgt_lang=tgt)
    settings = dataclasses.replace(cfg.decode, max_len_a=0.5, max_len_b=3, **decode)
    path = root / f"{src}_{tgt}_{seed}.pt"
    write_checkpoint(dataclasses.replace(cfg, data=data, decode=settings), path, seed=seed)
    return path


@pytest.fixture(scope="module")
def checkpoints(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "en-de": checkpoint_of(prepared_toy, root, "en", "de", seed=1),
        "de-en": checkpoint_of(prepared_toy, root, "de", "en", seed=2),
        "fr-en": checkpoint_of(prepared_toy, root, "fr", "en", seed=3),
    }


@pytest.fixture(scope="module")
def alone(checkpoints: dict[str, Path]) -> dict[str, object]:
    """Each model's own translator: what the server must answer for its direction."""
    return {pair: quiet_translator(path) for pair, path in checkpoints.items()}


def models_of(checkpoints: dict[str, Path], *pairs: str):
    from transformer_mt.serve.models import Models

    return Models([quiet_translator(checkpoints[p]) for p in pairs], [checkpoints[p].name for p in pairs])


@pytest.fixture(scope="module")
def client(checkpoints: dict[str, Path]):
    from starlette.testclient import TestClient

    from transformer_mt.serve.app import ServerInfo, build_app
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.protocol import Limits

    batcher = Batcher(models_of(checkpoints, "en-de", "de-en", "fr-en"), 2000, 5, 16)
    with TestClient(build_app(batcher, ServerInfo("three", "pytorch", "cpu", "none"), Limits())) as test_client:
        yield test_client


def test_each_direction_is_its_own_models_translation(client, alone) -> None:
    from starlette.websockets import WebSocketDisconnect

    languages = {entry["code"]: entry["targets"] for entry in client.get("/languages").json()}
    assert languages == {"en": ["de"], "de": ["en"], "fr": ["en"]}
    for pair, texts in (("en-de", ENGLISH), ("de-en", GERMAN), ("fr-en", FRENCH)):
        source, target = pair.split("-")
        want = alone[pair].translate_lines(texts)
        libre = client.post("/translate", json={"q": texts, "source": source, "target": target}).json()
        assert libre["translatedText"] == want, pair
        v1 = client.post("/v1/translate", json={"sources": texts, "source": source, "target": target}).json()
        assert [t["translation"] for t in v1["translations"]] == want, pair
        with client.websocket_connect(f"/ws?source={source}&target={target}") as ws:
            ws.send_text(texts[0])
            assert ws.receive_text() == want[0], pair
            ws.send_bytes(b"\x00")  # the server closes (1003): its handler ends before the test client's does
            with pytest.raises(WebSocketDisconnect):
                ws.receive_text()
        attention = client.post("/v1/attention", json={"text": texts[0], "source": source, "target": target})
        assert attention.status_code == 200 and attention.json()["translation"] == want[0], pair
    assert client.get("/health").json()["directions"] == ["en-de", "de-en", "fr-en"]
    settings = client.get("/frontend/settings").json()["language"]
    assert (settings["source"]["code"], settings["target"]["code"]) == ("en", "de")


def test_a_pair_no_model_translates_is_a_400_naming_what_is_served(client) -> None:
    answer = client.post("/translate", json={"q": "Un chien.", "source": "fr", "target": "de"})
    assert answer.status_code == 400 and answer.json()["field"] == "target"
    assert "does not translate 'fr' into 'de'; from 'fr' it translates into 'en'" in answer.json()["error"]
    unknown = client.post("/v1/translate", json={"sources": ["x"], "source": "cs", "target": "en"})
    assert unknown.status_code == 400 and unknown.json()["field"] == "source"


def test_auto_finds_the_model_by_the_texts_language(client, alone) -> None:
    pytest.importorskip("py3langid")
    # one model into German: no detection needed to choose it
    into_german = client.post("/translate", json={"q": ENGLISH[0], "source": "auto", "target": "de"}).json()
    assert into_german["translatedText"] == alone["en-de"].translate_lines(ENGLISH[:1])[0]
    # two models into English: the texts' language chooses
    for pair, texts in (("de-en", GERMAN), ("fr-en", FRENCH)):
        found = client.post("/translate", json={"q": texts, "source": "auto", "target": "en"}).json()
        assert found["translatedText"] == alone[pair].translate_lines(texts), pair
        assert {d["language"] for d in found["detectedLanguage"]} == {pair[:2]}
    mixed = client.post("/translate", json={"q": [GERMAN[0], FRENCH[0]], "source": "auto", "target": "en"})
    assert mixed.status_code == 400 and mixed.json()["field"] == "source"
    assert "name 'source'" in mixed.json()["error"]


@pytest.mark.parametrize("continuous", [True, False])
def test_requests_for_several_models_share_the_worker(checkpoints, alone, continuous: bool) -> None:
    """Jobs of two models queued together (one search per model, or one round with a group per model, though
    their settings are equal) each get their own model's translations."""
    from transformer_mt.serve.batcher import Batcher

    batcher = Batcher(models_of(checkpoints, "en-de", "de-en"), 10_000, 0, 16, continuous=continuous)
    assert len(batcher.lanes) == 2 and batcher.continuous is continuous
    futures: list[tuple[str, list[str], Future]] = []
    for i in range(3):
        futures.append(("en-de", ENGLISH[i % 2 :], batcher.submit(Job(ENGLISH[i % 2 :], languages=("en", "de")))))
        futures.append(("de-en", GERMAN[i % 2 :], batcher.submit(Job(GERMAN[i % 2 :], languages=(None, "en")))))
    batcher.start()
    try:
        for pair, texts, future in futures:
            assert [hyps[0].text for hyps in future.result(timeout=120)] == alone[pair].translate_lines(texts), pair
    finally:
        batcher.close(timeout=60)
    assert batcher.stats.requests == 6 and batcher.stats.errors == 0


def test_models_of_one_pair_or_of_other_settings_are_refused(checkpoints, prepared_toy, tmp_path) -> None:
    from transformer_mt.serve.models import Models, ModelsError

    other = quiet_translator(checkpoint_of(prepared_toy, tmp_path, "en", "de", seed=4))
    with pytest.raises(ModelsError, match="en_de_1.pt and other.pt both translate en-de: serve each direction"):
        Models([quiet_translator(checkpoints["en-de"]), other], ["en_de_1.pt", "other.pt"])
    wider = quiet_translator(checkpoint_of(prepared_toy, tmp_path, "cs", "en", seed=5, beam_size=5))
    with pytest.raises(ModelsError, match=r"decode.beam_size=4 and cs_en.pt with 5: .* --set decode.beam_size"):
        Models([quiet_translator(checkpoints["en-de"]), wider], ["en_de_1.pt", "cs_en.pt"])
    assert issubclass(ModelsError, UserError)


def test_checkpoints_group_by_their_directions(checkpoints, prepared_toy, tmp_path) -> None:
    from transformer_mt.serve import model_groups

    twin = checkpoint_of(prepared_toy, tmp_path, "en", "de", seed=6)
    en_de, de_en = checkpoints["en-de"], checkpoints["de-en"]
    assert model_groups([en_de, de_en, twin], "pytorch") == [[en_de, twin], [de_en]]
    assert model_groups([en_de], "pytorch") == [[en_de]]
    assert model_groups(["a", "b"], "ctranslate2") == [["a"], ["b"]]


def test_tmt_serve_holds_several_models(checkpoints, alone, prepared_toy, tmp_path, free_port) -> None:
    """``-c`` of two directions: two models; a third ``-c`` of one of them is averaged with it, as ever."""
    from transformer_mt.decode.translate import Translator

    twin = checkpoint_of(prepared_toy, tmp_path, "en", "de", seed=8)
    averaged = Translator.from_checkpoints([checkpoints["en-de"], twin], device="cpu")
    averaged.show_progress = False
    port = free_port()
    proc = start_server(checkpoints["en-de"], port, "-c", str(checkpoints["de-en"]), "-c", str(twin))
    try:
        url = f"http://127.0.0.1:{port}"
        status, languages = request_json(f"{url}/languages")
        assert status == 200 and {e["code"]: e["targets"] for e in languages} == {"en": ["de"], "de": ["en"]}
        for source, target, texts, want in (("en", "de", ENGLISH, averaged.translate_lines(ENGLISH)),
                                            ("de", "en", GERMAN, alone["de-en"].translate_lines(GERMAN))):  # fmt: skip
            status, answer = request_json(f"{url}/translate", {"q": texts, "source": source, "target": target})
            assert status == 200 and answer["translatedText"] == want, source
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert f"serving {checkpoints['en-de']}, {twin} (en-de); {checkpoints['de-en']} (de-en)" in out
    assert proc.returncode == 0


@pytest.mark.slow
def test_the_demo_page_chooses_the_model_by_the_source(checkpoints, alone, free_port) -> None:
    """A real `tmt serve` of de-en and fr-en and a real browser: German text left to detection is de-en's
    translation, the language found shown; French chosen by hand is fr-en's, nothing detected."""
    from helpers import browser_and_server
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    port = free_port()
    with browser_and_server(checkpoints["de-en"], port, "-c", str(checkpoints["fr-en"])) as driver:
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "directions de-en, fr-en" in d.find_element(By.ID, "model").text)
        assert driver.find_element(By.ID, "source-choice").is_displayed()
        for chosen, text, pair, shown in (("auto", GERMAN[0], "de-en", "detected: German (de)"),
                                          ("fr", FRENCH[0], "fr-en", "")):  # fmt: skip
            Select(driver.find_element(By.ID, "source-lang")).select_by_value(chosen)
            driver.find_element(By.ID, "source").clear()
            driver.find_element(By.ID, "source").send_keys(text)
            driver.execute_script("document.getElementById('output').textContent = ''")
            driver.find_element(By.ID, "translate").click()
            wait.until(lambda d: d.find_element(By.ID, "output").text.strip() or d.find_element(By.ID, "error").text)
            assert driver.find_element(By.ID, "error").text == ""
            assert driver.find_element(By.ID, "output").text == alone[pair].translate_lines([text])[0].strip(), pair
            assert driver.find_element(By.ID, "detected").text == shown
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap td"))  # the attention of that model


@pytest.fixture(scope="module")
def pivoting(checkpoints: dict[str, Path]):
    """The three models behind one app with --pivot en: fr-de is answered by fr-en, then en-de."""
    from starlette.testclient import TestClient

    from transformer_mt.serve.app import ServerInfo, build_app
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.models import Models
    from transformer_mt.serve.protocol import Limits

    pairs = ("en-de", "de-en", "fr-en")
    models = Models([quiet_translator(checkpoints[p]) for p in pairs], [checkpoints[p].name for p in pairs], "en")
    batcher = Batcher(models, 2000, 5, 16)
    with TestClient(build_app(batcher, ServerInfo("three", "pytorch", "cpu", "none"), Limits())) as test_client:
        yield test_client


def test_a_pivot_answers_a_pair_no_model_was_trained_on_in_two_legs(pivoting, alone) -> None:
    from starlette.websockets import WebSocketDisconnect

    languages = {entry["code"]: entry["targets"] for entry in pivoting.get("/languages").json()}
    assert languages == {"en": ["de"], "de": ["en"], "fr": ["de", "en"]}
    want = alone["en-de"].translate_lines(alone["fr-en"].translate_lines(FRENCH))
    libre = pivoting.post("/translate", json={"q": FRENCH, "source": "fr", "target": "de"}).json()
    assert libre["translatedText"] == want
    v1 = pivoting.post("/v1/translate", json={"sources": [FRENCH[0], "", FRENCH[1]], "source": "fr", "target": "de"})
    assert [t["translation"] for t in v1.json()["translations"]] == [want[0], "", want[1]]
    with pivoting.websocket_connect("/ws?source=fr&target=de") as ws:
        ws.send_text(FRENCH[1])
        assert ws.receive_text() == want[1]
        ws.send_bytes(b"\x00")
        with pytest.raises(WebSocketDisconnect):
            ws.receive_text()
    direct = pivoting.post("/translate", json={"q": FRENCH, "source": "fr", "target": "en"}).json()
    assert direct["translatedText"] == alone["fr-en"].translate_lines(FRENCH)  # a trained pair: one leg
    assert pivoting.get("/health").json()["pivot"] == "en"


def test_what_a_pivot_cannot_give_is_a_400(pivoting) -> None:
    html = pivoting.post("/translate", json={"q": "<p>Un chien.</p>", "source": "fr", "target": "de", "format": "html"})
    assert html.status_code == 400 and "no word alignment with the source" in html.json()["error"]
    aligned = pivoting.post(
        "/v1/translate", json={"sources": FRENCH, "source": "fr", "target": "de", "alignment": "hard"}
    )
    assert aligned.status_code == 400 and aligned.json()["field"] == "alignment"
    attention = pivoting.post("/v1/attention", json={"text": FRENCH[0], "source": "fr", "target": "de"})
    assert attention.status_code == 400 and "one leg, fr-en or en-de" in attention.json()["error"]


def test_a_source_left_open_is_detected_to_choose_the_pivot(pivoting, alone) -> None:
    """Into German, only en-de was trained: French text sent without a source must go through English, not be
    read by en-de as if it were English."""
    pytest.importorskip("py3langid")
    want = alone["en-de"].translate_lines(alone["fr-en"].translate_lines(FRENCH))
    v1 = pivoting.post("/v1/translate", json={"sources": FRENCH, "target": "de"}).json()
    assert [t["translation"] for t in v1["translations"]] == want
    with pivoting.websocket_connect("/ws?target=de") as ws:
        ws.send_text(FRENCH[0])
        assert ws.receive_text() == want[0]
        ws.close()
    english = pivoting.post("/v1/translate", json={"sources": ENGLISH, "target": "de"}).json()
    assert [t["translation"] for t in english["translations"]] == alone["en-de"].translate_lines(ENGLISH)
    mixed = pivoting.post("/v1/translate", json={"sources": [ENGLISH[0], FRENCH[0]], "target": "de"})
    assert mixed.status_code == 400 and mixed.json()["field"] == "source" and "en, fr" in mixed.json()["error"]


def test_a_pivot_the_models_cannot_carry_is_refused(checkpoints) -> None:
    from transformer_mt.serve.models import Models, ModelsError

    translators = [quiet_translator(checkpoints[p]) for p in ("en-de", "fr-en")]
    with pytest.raises(ModelsError, match="--pivot fr: a pivot must be translated into and out of"):
        Models(translators, pivot="fr")
    aligned = [t.with_decode({"alignment": "hard"}) for t in translators]
    with pytest.raises(ModelsError, match="--pivot with decode.alignment=hard: a pair answered through the pivot"):
        Models(aligned, pivot="en")
    with pytest.raises(UserError, match="--pivot: 'fr' is not a source language of this model"):
        translators[0].toward("en", "de", pivot="fr")  # a model of one pair has nothing to pivot through
    assert Models(translators, pivot="en").legs("fr", "de") == [("fr", "en"), ("en", "de")]
    assert Models(translators).legs("fr", "de") == [("fr", "de")]


def test_tmt_serve_pivot_names_the_pairs_it_answers_through_it(checkpoints, alone, free_port) -> None:
    port = free_port()
    proc = start_server(checkpoints["fr-en"], port, "-c", str(checkpoints["en-de"]), "--pivot", "en")
    try:
        status, answer = request_json(
            f"http://127.0.0.1:{port}/translate", {"q": FRENCH, "source": "fr", "target": "de"}
        )
        assert status == 200
        assert answer["translatedText"] == alone["en-de"].translate_lines(alone["fr-en"].translate_lines(FRENCH))
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert f"{checkpoints['en-de']} (en-de); through en: fr-de" in out and proc.returncode == 0


@pytest.mark.slow
def test_the_demo_page_translates_through_the_pivot_and_says_why_there_is_no_map(checkpoints, alone, free_port) -> None:
    """A real `tmt serve --pivot en` of fr-en and en-de and a real browser: fr-de is offered, its translation is
    the two legs', and the attention map it cannot have is a note beside it, not an error."""
    from helpers import browser_and_server
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    port = free_port()
    with browser_and_server(checkpoints["fr-en"], port, "-c", str(checkpoints["en-de"]), "--pivot", "en") as driver:
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "directions fr-en, en-de" in d.find_element(By.ID, "model").text)
        Select(driver.find_element(By.ID, "source-lang")).select_by_value("fr")
        Select(driver.find_element(By.ID, "target")).select_by_value("de")
        driver.find_element(By.ID, "source").send_keys(FRENCH[0])
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: "no attention map" in d.find_element(By.ID, "heatmap").text)
        want = alone["en-de"].translate_lines(alone["fr-en"].translate_lines(FRENCH[:1]))[0]
        assert driver.find_element(By.ID, "output").text == want.strip()
        assert driver.find_element(By.ID, "error").text == ""
        assert "one leg, fr-en or en-de" in driver.find_element(By.ID, "heatmap").text
