"""A request's fields as LibreTranslate's clients send them: a JSON body, a form body or the query string.

LibreTranslate's server reads a request's fields from whichever of these
the client used, and its clients use all three: `libretranslatepy` posts a
form body, `deep-translator` puts the fields in the query string, browsers
post JSON or `FormData` (multipart). `fields` turns any of them into one
dict, as plain data (no web framework), so that `protocol` checks a request
the same way whatever its shape. Fields in the body win over the same
fields in the query string.

Form and query values are strings; a field given more than once is a list
(``q=a&q=b`` is ``["a", "b"]``, as a JSON list would be), and the settings
that are numbers (`FORM_NUMBERS`) are read as numbers when they are
written as whole numbers, so that ``alternatives=2`` means 2. Anything else
is left as it came, for `protocol`'s checks to name.

The dict holds every field the client sent, ``api_key`` included: what
reads a key reads it there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

from transformer_mt.serve.protocol import RequestError, parse_json

FORM_NUMBERS = ("alternatives",)  # LibreTranslate's settings that are whole numbers
FORM, MULTIPART = "application/x-www-form-urlencoded", "multipart/form-data"


def fields(content_type: str, body: bytes, query: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
    """The request's fields from its body (by ``content_type``) and its ``query`` pairs; a 400 for a body that
    is not what its type says. An empty body, whatever its type, holds no fields (a GET with a form header, as `libretranslatepy` sends one)."""
    merged = _gather(query)
    if body.strip():
        merged.update(_body(content_type, body))
    return merged


def _body(content_type: str, body: bytes) -> dict[str, Any]:
    """The fields of a body of ``content_type`` (its media type, whatever its parameters): a form or a
    multipart body by its type, anything else as JSON (what tmt has always read, whatever the type said)."""
    media = content_type.split(";")[0].strip().lower()
    if media == FORM:
        try:
            pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=True, errors="strict")
        except UnicodeDecodeError:  # of the body, or of a %-escaped value
            raise RequestError(400, "the form body is not UTF-8 (its %-escapes included)") from None
        except ValueError:
            raise RequestError(400, "the form body is not name=value pairs joined by '&'") from None
        return _gather(pairs)
    if media == MULTIPART:
        return _gather(_multipart(content_type, body))
    return parse_json(body)


def _multipart(content_type: str, body: bytes) -> list[tuple[str, str]]:
    """The text parts of a ``multipart/form-data`` body as (name, value) pairs; a 400 for a malformed one, for
    a file part (this API takes text) and for a part that is not UTF-8."""
    from python_multipart import create_form_parser  # the serve extra's
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartState

    parts: list[tuple[bytes, bytes | None]] = []
    files: list[Any] = []
    try:
        parser = create_form_parser(
            {"Content-Type": content_type.encode("latin-1")},
            lambda part: parts.append((part.field_name or b"", part.value)),
            files.append,
        )
        parser.write(body)
        parser.finalize()
        if parser.parser.state != MultipartState.END:  # the parser takes a body cut short without a word
            raise FormParserError("it ends before its closing boundary")
    except (FormParserError, UnicodeEncodeError, ValueError) as err:
        raise RequestError(400, f"the multipart body is malformed ({err})") from None
    if files:
        name = (files[0].field_name or b"").decode("utf-8", "replace")
        raise RequestError(400, f"{name!r} is a file: this endpoint takes text fields", name or None)
    try:
        return [(name.decode("utf-8"), (value or b"").decode("utf-8")) for name, value in parts]
    except UnicodeDecodeError as err:
        raise RequestError(400, f"a field of the multipart body is not UTF-8 (byte {err.start})") from None


def _gather(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """``pairs`` as a dict: a name given once is its value, a name given more than once the list of its values;
    a `FORM_NUMBERS` field written as a whole number is that number."""
    gathered: dict[str, Any] = {}
    for name, value in pairs:
        if name not in gathered:
            gathered[name] = value
        elif isinstance(gathered[name], list):
            gathered[name].append(value)
        else:
            gathered[name] = [gathered[name], value]
    for name in FORM_NUMBERS:
        value = gathered.get(name)
        if isinstance(value, str) and value.isascii() and value.strip().isdigit() and len(value.strip()) <= 18:
            gathered[name] = int(value)
    return gathered
