"""`serve.wire.fields`: a request's fields from a JSON, form or multipart body and the query string, as plain data."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest

from transformer_mt.serve.protocol import RequestError
from transformer_mt.serve.wire import fields

FORM = "application/x-www-form-urlencoded"


def _multipart(parts: list[tuple[str, str]], boundary: str = "b0und") -> tuple[str, bytes]:
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode() for name, value in parts
    )  # fmt: skip
    return f"multipart/form-data; boundary={boundary}", body + f"--{boundary}--\r\n".encode()


def test_every_shape_gives_the_same_fields() -> None:
    want = {"q": "Ein Hund läuft.", "source": "de", "target": "en", "alternatives": 2, "api_key": "k"}
    pairs = [(k, str(v)) for k, v in want.items()]
    assert fields("application/json", b'{"q": "Ein Hund l\\u00e4uft.", "source": "de", "target": "en", '
                  b'"alternatives": 2, "api_key": "k"}') == want  # fmt: skip
    assert fields(f"{FORM}; charset=UTF-8", urlencode(pairs).encode()) == want
    assert fields(*_multipart(pairs)) == want
    assert fields("", b"", pairs) == want  # the query string alone, as deep-translator sends it


def test_a_repeated_field_is_a_list_and_the_body_wins_over_the_query() -> None:
    assert fields(FORM, b"q=a&q=b&q=", [("q", "x"), ("target", "de")]) == {"q": ["a", "b", ""], "target": "de"}
    assert fields("", b"", [("q", "a"), ("q", "b")]) == {"q": ["a", "b"]}
    assert fields(*_multipart([("q", "a"), ("q", "b\nc")])) == {"q": ["a", "b\nc"]}
    assert fields("application/json", b'{"q": ["a"]}', [("q", "x"), ("source", "en")]) == {"q": ["a"], "source": "en"}


def test_only_whole_numbers_become_numbers() -> None:
    """A form's ``alternatives=2`` is 2; anything else stays the string it was, for the field's check to name."""
    assert fields(FORM, b"alternatives=2")["alternatives"] == 2
    for odd in ("two", "-1", "1.5", "", "\u00b2", "9" * 40):
        assert fields(FORM, urlencode({"alternatives": odd}).encode())["alternatives"] == odd
    assert fields("application/json", b'{"alternatives": "2"}')["alternatives"] == "2"  # JSON says what it means


def test_an_empty_body_of_any_type_holds_no_fields() -> None:
    """`libretranslatepy` sends its GET /languages with an empty form body."""
    assert fields(FORM, b"") == {} and fields("application/json", b"  ") == {}


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        ("application/json", b"q=a", "not valid JSON"),
        (FORM, b"q=%ff", "not UTF-8"),
        (FORM, b"q", "name=value"),
        ("multipart/form-data", b"--x\r\n", "No boundary"),
        ("multipart/form-data; boundary=x", b"garbage", "malformed"),
        ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="q"\r\n\r\nhal', "closing"),
        ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="q"\r\n\r\n\xff\r\n--x--',
         "not UTF-8"),
    ],
)  # fmt: skip
def test_a_malformed_body_is_a_400_naming_why(content_type: str, body: bytes, says: str) -> None:
    with pytest.raises(RequestError) as caught:
        fields(content_type, body)
    assert caught.value.status == 400 and says in caught.value.message


def test_a_file_part_is_refused_by_name() -> None:
    body = b'--x\r\nContent-Disposition: form-data; name="doc"; filename="a.txt"\r\n\r\nhello\r\n--x--\r\n'
    with pytest.raises(RequestError) as caught:
        fields("multipart/form-data; boundary=x", body)
    assert caught.value.status == 400 and caught.value.field == "doc"
