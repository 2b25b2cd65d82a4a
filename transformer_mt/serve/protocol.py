"""What `tmt serve` accepts and answers, as plain functions of bytes and dicts: no web framework here.

Two request shapes share one worker:

- ``POST /translate``: LibreTranslate's (``q`` a string or a list of
  strings, ``source``, ``target``, ``alternatives``, ``format``), so that
  LibreTranslate's clients work unchanged. A string with several lines is
  translated line by line and joined again with '\\n', as a document;
  with ``format: "html"``, each text is an HTML document translated segment
  by segment, its tags placed by word alignment (`transformer_mt.serve.html`).
- ``POST /v1/translate``: tmt's own (``sources``, a list of single lines;
  optional ``beam``, ``nbest``, ``len_penalty``, for sampling ``sample``,
  ``temperature``, ``seed``, ``prefixes``, one forced target prefix per
  source, ``constraints``, phrases each source's translations must contain,
  and ``alignment``, "hard" or "soft"), answered with each line's
  translation, score and n-best list (``nbest`` samples with ``sample``),
  each with its word alignment when asked (`transformer_mt.decode.align`).

Every refusal is a `RequestError`: an HTTP status, a message a client can act
on and the request field it is about (``None`` for the body as a whole).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transformer_mt.config import (
    API_NAMES,
    SAMPLING_FIX,
    SEED_MAX,
    Config,
    ConfigError,
    DataConfig,
    DecodeMode,
    mode_conflict,
    parse_sampling,
)
from transformer_mt.data.directions import sources, targets
from transformer_mt.decode.translate import Translation
from transformer_mt.serve.detect import LanguageDetector
from transformer_mt.serve.html import join as join_html
from transformer_mt.serve.html import split as split_html

LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish", "fi": "Finnish",
    "fr": "French", "hi": "Hindi", "it": "Italian", "ja": "Japanese", "nl": "Dutch", "pl": "Polish",
    "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese",
}  # fmt: skip


@dataclass(frozen=True)
class Languages:
    """What a server translates: its source and target languages and the pairs among them it answers."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    pairs: frozenset[tuple[str, str]]

    @classmethod
    def of(cls, *models: DataConfig) -> Languages:
        """The languages of the models a server holds (their ``data`` sections). A model of several directions
        answers every pair of its sources and targets (a pair never trained is translated zero-shot); a
        bilingual one its pair."""
        pairs = {(s, t) for data in models for s in sources(data) for t in targets(data) if s != t}
        return cls(
            tuple(dict.fromkeys(s for data in models for s in sources(data))),
            tuple(dict.fromkeys(t for data in models for t in targets(data))),
            frozenset(pairs),
        )

    def sources_into(self, target: str) -> list[str]:
        """The sources the server translates into ``target``, in order."""
        return [s for s in self.sources if (s, target) in self.pairs]


class RequestError(Exception):
    """A request the server refuses: ``status`` (400 malformed, 413 too large), ``message`` and ``field``."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field

    def body(self) -> dict[str, Any]:
        """The JSON error body: LibreTranslate's ``error`` key, and the field the message is about."""
        return {"error": self.message, "field": self.field}


BODY_TIMEOUT_S = 30  # the longest a request body may take to arrive (408 beyond): docs/serving.md, "Limits"
T = TypeVar("T")


def declared_over(content_length: str, limit: int) -> bool:
    """Whether a request's Content-Length says its body is over ``limit`` bytes: a 413 before reading any of it (a
    malformed header never gets here: h11 refuses it)."""
    return content_length.isdigit() and (len(content_length) > 18 or int(content_length) > limit)


async def body_in_time(reading: Awaitable[T]) -> T:
    """``reading`` (a request body arriving), or a 408 when it takes more than `BODY_TIMEOUT_S`: a client that
    sends its body byte by byte forever holds a connection no longer."""
    try:
        return await asyncio.wait_for(reading, BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body took more than {BODY_TIMEOUT_S} s to arrive") from None


@dataclass(frozen=True)
class Limits:
    """How much one request may ask for (413 beyond), and the widest beam a request may set (400 beyond)."""

    max_lines: int = 256
    max_chars: int = 20_000
    max_beam: int = 16

    def body_bytes(self) -> int:
        """The largest request body read: every character 4 UTF-8 bytes, JSON-escaped, plus room for the keys."""
        return 8 * self.max_chars + 65_536


@dataclass(frozen=True)
class Job:
    """Lines to translate, as a request asked: ``decode``, its own values of the decode section (``{"beam_size":
    2}``; empty: the server's settings), ``prefixes`` and ``constraints`` as text. `transformer_mt.serve.batcher`
    encodes it once."""

    lines: list[str]
    nbest: int = 1
    decode: dict[str, Any] = field(default_factory=dict)
    prefixes: list[str] | None = None  # per line, the target text its translations start with ("" for none)
    constraints: list[list[str]] | None = None  # per line, phrases its translations must contain ([] for none)
    languages: tuple[str | None, str | None] = (None, None)  # source (None: any) and target of a model of several


@dataclass(frozen=True)
class LibreRequest:
    """``q`` as lines to translate; ``parts[i]`` how many of those lines the i-th text of ``q`` was."""

    job: Job
    parts: list[int]
    single: bool  # q was a string, not a list: answer with strings
    alternatives: int
    detected: list[dict[str, Any]] | None  # source "auto": each text's detectedLanguage, as LibreTranslate answers
    documents: list[str] | None = None  # format "html": the texts, whose segments are the lines


@dataclass(frozen=True)
class V1Request:
    job: Job


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 naming what is wrong with it: not UTF-8, not JSON, nested
    deeper than Python's parser goes, or a string holding a lone surrogate (JSON's ``"\\ud800"``, which no text
    holds and the tokenizer cannot take). An integer of more than `MAX_DIGITS` digits is parsed as `Huge`, which
    no field accepts, so that the field's own check names it."""
    try:
        value = json.loads(body.decode("utf-8"), parse_int=_parse_int)
    except UnicodeDecodeError as err:
        raise RequestError(400, f"the request body is not UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise RequestError(
            400, f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except RecursionError:
        raise RequestError(400, "the request body nests lists or objects too deeply; send a flat JSON object") from None
    if not isinstance(value, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(value).__name__}")
    where = _surrogate(value)
    if where is not None:
        raise RequestError(
            400, f"{where} holds a lone surrogate (an escape such as \\ud800 without its pair), which is no "
            "character; send text as UTF-8", None if where == "a key" else where,
        )  # fmt: skip
    return value


MAX_DIGITS = 100  # an integer longer than this in a request is no setting any field takes


class Huge:
    """An integer of more than `MAX_DIGITS` digits in a request: kept as its length, never converted (Python
    refuses to convert one of more than 4300 digits, and a field would refuse it anyway)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(text: str) -> int | Huge:
    return int(text) if len(text) <= MAX_DIGITS else Huge(len(text.lstrip("-")))


def _surrogate(value: Any) -> str | None:
    """Where in ``value`` the first string with a lone surrogate is ("q", "sources[2]", "a key"), or None.
    Walked without recursion: the parser takes nesting deeper than a recursive walk could."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return where
        if isinstance(item, dict):
            if not all(_is_text(key) for key in item):
                return "a key"
            stack.extend(reversed([(f"{where}.{key}" if where else key, v) for key, v in item.items()]))
        elif isinstance(item, list):
            stack.extend(reversed([(f"{where}[{i}]", v) for i, v in enumerate(item)]))
    return None


def _is_text(text: str) -> bool:
    """Whether ``text`` is text UTF-8 can hold: no lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_size(lines: list[str], limits: Limits, name: str) -> None:
    """413 when ``lines`` are more lines or characters than one request may send."""
    if len(lines) > limits.max_lines:
        raise RequestError(
            413, f"{len(lines)} lines in one request, more than this server's --max-lines {limits.max_lines}; "
            "split the text over several requests", name,
        )  # fmt: skip
    chars = sum(len(line) for line in lines)
    if chars > limits.max_chars:
        raise RequestError(
            413, f"{chars} characters in one request, more than this server's --max-chars {limits.max_chars}; "
            "split the text over several requests", name,
        )  # fmt: skip


def parse_libre(
    raw: dict[str, Any],
    cfg: Config,
    limits: Limits,
    detector: LanguageDetector | None = None,
    langs: Languages | None = None,
) -> LibreRequest:
    """LibreTranslate's ``/translate`` request: ``q`` and a direction the server translates (``langs``, by
    default ``cfg``'s model's); with ``source: "auto"`` (the default), each text's language as ``detector``
    finds it among the server's sources, and the job's source is the one they share (None if they differ)."""
    langs = langs or Languages.of(cfg.data)
    q = raw.get("q")
    if q is None:
        raise RequestError(400, "missing 'q': the text to translate (a string, or a list of strings)", "q")
    single = isinstance(q, str)
    texts = [q] if single else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise RequestError(400, "'q' must be a string or a list of strings", "q")
    source, target = check_languages(raw, langs, "auto")
    alternatives = raw.get("alternatives", 0)
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise RequestError(
            400, f"'alternatives' must be a whole number, 0 or more, got {alternatives!r}", "alternatives"
        )
    if alternatives + 1 > cfg.decode.beam_size:
        raise RequestError(
            400, f"'alternatives' {alternatives}: this model decodes with beam {cfg.decode.beam_size}, so it has at "
            f"most {cfg.decode.beam_size - 1} alternatives", "alternatives",
        )  # fmt: skip
    form = raw.get("format", "text")
    if form not in FORMATS:
        raise RequestError(400, f"'format' {form!r}: this server translates 'text' or 'html'", "format")
    if form == "html":
        check_size(texts, limits, "q")  # the markup counts too
    split = [text.split("\n") for text in texts] if form == "text" else _segments(texts)
    lines = [line for part in split for line in part]
    check_size(lines, limits, "q")
    decode = {"alignment": "soft"} if form == "html" else {}
    detector = detector or LanguageDetector(list(langs.sources[:1]))
    detected = None if source is not None else [detector.detect(text) for text in texts]
    found = {d["language"] for d in detected or []}
    if source is None and len(found) == 1 and found <= set(langs.sources_into(target)):
        source = found.pop()  # where several models translate into the target, the source chooses among them
    job = Job(lines, nbest=alternatives + 1, decode=decode, languages=(source, target))
    documents = texts if form == "html" else None
    return LibreRequest(job, [len(part) for part in split], single, alternatives, detected, documents)


FORMATS = ("text", "html")  # LibreTranslate's values of 'format'


def _segments(documents: list[str]) -> list[list[str]]:
    """Each HTML document's segments as lines; a document nested deeper than the parser's walk goes is a 400."""
    try:
        return [[segment.text for segment in split_html(text)] for text in documents]
    except RecursionError:
        raise RequestError(400, "the HTML nests elements too deeply; send a flatter document", "q") from None


def check_languages(raw: dict[str, Any], langs: Languages, auto: str | None) -> tuple[str | None, str]:
    """A request's ``source`` and ``target``, refused unless the server translates the one into the other; the
    source is None for ``auto`` (any of the server's: it detects it). ``target`` may be left out for a server of
    one target; ``auto``: what a missing source means ("auto" for LibreTranslate's API, None for tmt's)."""
    froms, intos = langs.sources, langs.targets
    source, target = raw.get("source", auto), raw.get("target", intos[0] if len(intos) == 1 else None)
    if source not in (*froms, "auto", None):
        raise RequestError(
            400, f"'source' {source!r}: this model translates from {', '.join(map(repr, froms))} (or pass 'auto')",
            "source",
        )  # fmt: skip
    if target not in intos:
        given = "no 'target'" if target is None else f"'target' {target!r}"
        raise RequestError(
            400, f"{given}: this model translates into {', '.join(map(repr, intos))}", "target"
        )  # fmt: skip
    if source == target:
        raise RequestError(400, f"'source' and 'target' are both {source!r}: choose two languages", "target")
    if source not in ("auto", None) and (source, target) not in langs.pairs:
        into = ", ".join(repr(t) for t in intos if (source, t) in langs.pairs)
        raise RequestError(
            400, f"this server does not translate {source!r} into {target!r}; from {source!r} it translates into "
            f"{into}", "target",
        )  # fmt: skip
    return (None if source in ("auto", None) else source), target


def libre_response(request: LibreRequest, results: list[list[Translation]]) -> dict[str, Any]:
    """LibreTranslate's answer: ``translatedText`` (a string or a list, as ``q`` was), ``alternatives`` when asked."""
    texts, alternatives, i = [], [], 0
    for k, n in enumerate(request.parts):
        part = results[i : i + n]
        i += n
        found = [_text(request, k, part, rank) for rank in range(request.alternatives + 1)]
        texts.append(found[0])
        alternatives.append(found[1:])
    answer: dict[str, Any] = {"translatedText": texts[0] if request.single else texts}
    if request.alternatives:
        answer["alternatives"] = alternatives[0] if request.single else alternatives
    if request.detected is not None:
        answer["detectedLanguage"] = request.detected[0] if request.single else request.detected
    return answer


def _text(request: LibreRequest, k: int, part: list[list[Translation]], rank: int) -> str:
    """The ``rank``-th translation of the ``k``-th text of ``q`` from its lines' translations ``part``."""
    if request.documents is None:
        return "\n".join(hyps[rank].text for hyps in part)
    return join_html(request.documents[k], [(hyps[rank].text, hyps[rank].alignment or "") for hyps in part])


def parse_v1(
    raw: dict[str, Any],
    cfg: Config,
    limits: Limits,
    engine: str = "pytorch",
    ensemble: bool = False,
    langs: Languages | None = None,
) -> V1Request:
    """tmt's ``/v1/translate`` request: ``sources`` (single lines) and optional decoding settings, refused
    when they do not combine on this server's ``engine`` (or ``ensemble``), as `mode_conflict` rules; a
    direction of ``langs`` (by default ``cfg``'s model's)."""
    sources = _v1_sources(raw, limits)
    unknown = sorted(set(raw) - set(V1_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field {unknown[0]!r}; known: {', '.join(V1_FIELDS)}", unknown[0])
    sample = raw.get("sample")
    if sample is not None and not isinstance(sample, str):
        raise RequestError(
            400, f'\'sample\' must be a string such as "topk:10" or "topp:0.9", got {sample!r}', "sample"
        )
    beam = _whole(raw, "beam", 1 if sample else cfg.decode.beam_size, 1, limits.max_beam)
    nbest = _whole(raw, "nbest", 1, 1, limits.max_beam)
    decode: dict[str, Any] = {"beam_size": beam} if beam != cfg.decode.beam_size else {}
    for key, setting in (("len_penalty", "len_penalty"), ("temperature", "sampling_temperature")):
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RequestError(400, f"'{key}' must be a number, got {value!r}", key)
            if key == "temperature" and value <= 0:
                raise RequestError(
                    400, f"'temperature' must be above 0 (1: the model's own distribution), got {value}", key
                )
            decode[setting] = float(value)
    if sample is not None:
        try:
            parse_sampling(sample)
        except ConfigError:
            raise RequestError(400, f"'sample' {sample!r}: {SAMPLING_FIX}", "sample") from None
        decode["sampling"] = sample
    if "seed" in raw:
        decode["seed"] = _whole(raw, "seed", 0, 0, SEED_MAX)
    alignment = raw.get("alignment")
    if alignment is not None:
        if alignment not in ALIGNMENTS:
            raise RequestError(400, f'\'alignment\' must be "hard" or "soft", got {alignment!r}', "alignment")
        decode["alignment"] = alignment
    prefixes, constraints = _prefixes(raw, len(sources)), _constraints(raw, len(sources))
    mode = DecodeMode(
        sample is not None, beam, nbest, constraints is not None, prefixes is not None, alignment is not None,
        engine, ensemble,
    )  # fmt: skip
    conflict = mode_conflict(mode, API_NAMES)
    if conflict is not None:
        raise RequestError(400, conflict[1], conflict[0])
    languages = check_languages(raw, langs or Languages.of(cfg.data), None)
    job = Job(list(sources), nbest, decode, prefixes, constraints, languages)
    return V1Request(job)


def _v1_sources(raw: dict[str, Any], limits: Limits) -> list[str]:
    """``sources``: a list of single lines within ``limits``."""
    sources = raw.get("sources")
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise RequestError(400, "'sources' must be a list of strings, one line each", "sources")
    for i, source in enumerate(sources):
        if "\n" in source or "\r" in source:
            raise RequestError(
                400, f"sources[{i}] holds a line break; send each line as its own source", f"sources[{i}]"
            )
    check_size(sources, limits, "sources")
    return sources


V1_FIELDS = (
    "sources", "beam", "nbest", "len_penalty", "sample", "temperature", "seed", "prefixes", "alignment", "constraints",
    "source", "target", "api_key",  # api_key: checked before the route (`keys.Gate`)
)  # fmt: skip
ALIGNMENTS = ("hard", "soft")  # decode.alignment's values besides "none"


def _prefixes(raw: dict[str, Any], lines: int) -> list[str] | None:
    """``prefixes``: one string per source, a single line each ("" for none), or absent."""
    prefixes = raw.get("prefixes")
    if prefixes is None:
        return None
    if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
        raise RequestError(400, "'prefixes' must be a list of strings, one per source (\"\" for none)", "prefixes")
    if len(prefixes) != lines:
        raise RequestError(
            400, f"'prefixes' has {len(prefixes)} entries for {lines} sources; give one per source", "prefixes"
        )
    for i, prefix in enumerate(prefixes):
        if "\n" in prefix or "\r" in prefix:
            raise RequestError(400, f"prefixes[{i}] holds a line break; a prefix is one line", f"prefixes[{i}]")
    return list(prefixes)


def _constraints(raw: dict[str, Any], lines: int) -> list[list[str]] | None:
    """``constraints``: per source, a list of phrases its translations must contain ([] for none), or absent."""
    constraints = raw.get("constraints")
    if constraints is None:
        return None
    shape = "'constraints' must be a list with one list of phrases (strings) per source ([] for none)"
    if not isinstance(constraints, list) or not all(isinstance(c, list) for c in constraints):
        raise RequestError(400, shape, "constraints")
    if len(constraints) != lines:
        raise RequestError(
            400, f"'constraints' has {len(constraints)} entries for {lines} sources; {shape}", "constraints"
        )
    for i, phrases in enumerate(constraints):
        for j, phrase in enumerate(phrases):
            if not isinstance(phrase, str) or not phrase.strip() or any(c in phrase for c in "\t\n\r"):
                raise RequestError(
                    400,
                    f"constraints[{i}][{j}] must be a non-empty phrase on one line, without tabs",
                    f"constraints[{i}][{j}]",
                )
    return [list(phrases) for phrases in constraints]


def _whole(raw: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(400, f"'{key}' must be a whole number from {low} to {high}, got {value!r}", key)
    return value


def v1_response(results: list[list[Translation]]) -> dict[str, Any]:
    """Per line: the translation, its length-normalized score, and the n-best list (best first); each with its
    ``alignment`` line (Pharaoh ``i-j`` pairs, or soft rows) when the request asked for one."""
    return {"translations": [{**_hypothesis(hyps[0]), "nbest": [_hypothesis(h) for h in hyps]} for hyps in results]}


def _hypothesis(h: Translation) -> dict[str, Any]:
    found = {"translation": h.text, "score": _number(h.score)}
    return found if h.alignment is None else {**found, "alignment": h.alignment}


def _number(x: float) -> float | None:
    """JSON has no -inf (a missing n-best entry's score): None."""
    return x if math.isfinite(x) else None


def languages(langs: Languages) -> list[dict[str, Any]]:
    """LibreTranslate's ``/languages``: each language of the server with the targets it translates into (for a
    model of several directions every target but itself: a pair never trained is translated zero-shot); a
    target only, with none."""
    return [
        {"code": lang, "name": LANGUAGE_NAMES.get(lang, lang),
         "targets": [t for t in langs.targets if (lang, t) in langs.pairs]}
        for lang in dict.fromkeys([*langs.sources, *langs.targets])
    ]  # fmt: skip
