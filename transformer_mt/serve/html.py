"""HTML documents for ``format: "html"``: which text to translate, and the translated document rebuilt around it.

Pure functions of strings, no server: `split` gives a document's segments
(the text to translate, one line each), `join` the document with each
segment replaced by its translation.

The document is parsed with BeautifulSoup's ``html.parser`` (unclosed tags
closed where that parser closes them). A segment is a run of text and inline
elements (`INLINE`: ``<b>``, ``<a href>``, ``<span>``...) between block
boundaries: any other element (``<p>``, ``<li>``, ``<td>``, ``<br>``...), a
comment, or an element left alone. So a sentence is never cut at a nested
inline tag: ``<p>A <b>big <i>red</i></b> dog.</p>`` is one line, "A big red
dog.". Left untranslated, as they are: `KEEP` elements (``<script>``,
``<style>``, ``<code>``, ``<pre>``...), comments, and any element with
``translate="no"``. Attributes are kept; entities come back as the
characters they stand for (``&`` and ``<`` escaped again).

Inline tags are placed with the translation's word alignment (soft: per
target word, the source words' probabilities; or hard, Pharaoh ``i-j``
pairs): a tag wraps the target words from the first to the last surely
linked to any source word it wrapped (`_pairs`), else linked at all. A tag
whose words got no target word wraps the target words of the nearest source
word that has some; an empty tag (``<b></b>``, ``<img>``) goes after the target
word aligned to the source word before it. Tags keep their nesting: a child
is clipped to its parent's span, and siblings that would overlap are made
to follow one another in target order. Every tag of the source therefore
appears exactly once in the translation, whatever the alignment.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from bs4 import BeautifulSoup, NavigableString, PageElement, Tag

INLINE = frozenset((
    "a", "abbr", "b", "bdi", "bdo", "big", "cite", "data", "del", "dfn", "em", "font", "i", "img", "ins", "label",
    "mark", "q", "s", "small", "span", "strike", "strong", "sub", "sup", "time", "tt", "u", "wbr",
))  # fmt: skip  # elements inside a sentence; any other element is a segment boundary
KEEP = frozenset((
    "script", "style", "code", "pre", "textarea", "template", "svg", "math", "noscript", "kbd", "samp", "var",
))  # fmt: skip  # never translated
SPACE = re.compile(r"[ \t\n\r\f]+")  # HTML's whitespace (not U+00A0, which is a character of the text)


@dataclass
class Segment:
    """One line of a document to translate: its ``words``; per word, the inline tags over it (indices into
    ``tags``); per tag, its parent tag (None at the top) and how many words come before it."""

    words: list[str]
    chains: list[set[int]]
    tags: list[Tag]
    parents: list[int | None]
    starts: list[int]
    lead: str  # the whitespace before the first word and after the last, kept around the translation
    trail: str

    @property
    def text(self) -> str:
        return " ".join(self.words)


def split(document: str) -> list[Segment]:
    """The segments of ``document`` to translate, in document order."""
    return [segment for _, segment in _segments(_parse(document))]


def join(document: str, translations: Sequence[tuple[str, str]]) -> str:
    """``document`` with each segment (as `split` finds them) replaced by its translation, a ``(text,
    alignment)`` pair: the translated words, with the segment's inline tags placed by the alignment line (soft
    or hard, as `tmt translate --alignment` writes them)."""
    soup = _parse(document)
    found = list(_segments(soup))
    if len(found) != len(translations):
        raise ValueError(f"{len(translations)} translations for {len(found)} segments")
    for (run, segment), (text, alignment) in zip(found, translations, strict=True):
        words = [w for w in SPACE.split(text) if w]
        nodes = _render(segment, words, _spans(segment, words, _pairs(alignment)))
        anchor = run[0]
        for node in nodes:
            anchor.insert_before(node)
        for node in run:
            node.extract()
    return soup.decode(formatter="minimal")


def _parse(document: str) -> BeautifulSoup:
    return BeautifulSoup(document, "html.parser")


def _kept(node: PageElement) -> bool:
    """Whether ``node`` is left as it is: a comment (or doctype, CDATA...), a `KEEP` element, ``translate="no"``."""
    if isinstance(node, Tag):
        return node.name in KEEP or str(node.get("translate", "")).lower() == "no"
    return type(node) is not NavigableString


def _inline(node: PageElement) -> bool:
    """Whether ``node`` belongs inside a sentence: text, or an `INLINE` element holding only such nodes."""
    if _kept(node):
        return False
    if isinstance(node, NavigableString):
        return True
    return node.name in INLINE and all(_inline(child) for child in node.children)


def _segments(parent: Tag) -> Iterator[tuple[list[PageElement], Segment]]:
    """Each run of inline siblings with words in it, and its segment, in document order; other elements not
    left alone are walked into."""
    run: list[PageElement] = []
    for child in [*parent.children, None]:
        if child is not None and _inline(child):
            run.append(child)
            continue
        if run:
            segment = _segment(run)
            if segment.words:
                yield run, segment
            run = []
        if isinstance(child, Tag) and not _kept(child):
            yield from _segments(child)


def _segment(run: list[PageElement]) -> Segment:
    """The words of ``run`` and the inline tags over each: a word cut by a tag (``<b>big</b>ger``, ``<a>cat</a>.``)
    is one word, under the tags over any of its parts, so that the model reads the text as written."""
    segment = Segment([], [], [], [], [], "", "")
    glue = [False]  # whether the text so far ends inside a word

    def walk(node: PageElement, chain: frozenset[int], parent: int | None) -> None:
        if isinstance(node, NavigableString):
            for k, word in enumerate(SPACE.split(str(node))):
                if word and k == 0 and glue[0]:
                    segment.words[-1] += word
                    segment.chains[-1] |= chain
                elif word:
                    segment.words.append(word)
                    segment.chains.append(set(chain))
            if node:
                glue[0] = bool(segment.words) and not str(node)[-1].isspace()
            return
        assert isinstance(node, Tag)
        index = len(segment.tags)
        segment.tags.append(node)
        segment.parents.append(parent)
        segment.starts.append(len(segment.words))
        for child in node.children:
            walk(child, chain | {index}, index)

    for node in run:
        walk(node, frozenset(), None)
    text = "".join(node.get_text() if isinstance(node, Tag) else str(node) for node in run)
    segment.lead = text[: len(text) - len(text.lstrip(" \t\n\r\f"))]
    segment.trail = text[len(text.rstrip(" \t\n\r\f")) :]
    return segment


def _pairs(alignment: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The links of an alignment line, as (sure, all) ``(source word, target word)`` pairs. A hard line (``i-j``)
    gives its pairs as both. A soft one (per target word, the source words' probabilities) gives as ``all`` each
    target word's likeliest source word, and as ``sure`` those links that are also the source word's likeliest
    target word: a target word with no source word of its own (German's "herum" in "um das Fass herum") lands
    on some source word in ``all``, but is rarely that word's best."""
    if "-" in alignment or not alignment.strip():
        pairs = [
            (int(i), int(j)) for i, _, j in (p.partition("-") for p in alignment.split()) if i.isdigit() and j.isdigit()
        ]
        return pairs, pairs
    rows = [[float(x) for x in row.split(",")] for row in alignment.split()]
    every = [(max(range(len(row)), key=row.__getitem__), j) for j, row in enumerate(rows)]
    best = {i: max(range(len(rows)), key=lambda j: rows[j][i]) for i in range(len(rows[0]))}
    return [(i, j) for i, j in every if best[i] == j], every


def _spans(
    segment: Segment, words: list[str], links: tuple[list[tuple[int, int]], list[tuple[int, int]]]
) -> list[tuple[int, int]]:
    """Each tag's target span ``[start, end)`` of word indices: first what the alignment says (its sure links,
    else any), then nested (children within their parent) and siblings made disjoint, so that the spans form
    the source's tree."""
    n = len(words)
    sure, targets = _targets(links[0], n), _targets(links[1], n)
    wanted = []
    for tag in range(len(segment.tags)):
        covered = [i for i, chain in enumerate(segment.chains) if tag in chain]
        found = [j for i in covered for j in sure.get(i, [])]
        wanted.append((min(found), max(found) + 1) if found else _wanted(covered, segment.starts[tag], targets, n))
    spans = list(wanted)

    def place(children: list[int], lo: int, hi: int) -> None:
        end = lo
        for child in sorted(children, key=lambda t: (wanted[t], t)):
            start = min(max(wanted[child][0], end, lo), hi)
            stop = min(max(wanted[child][1], start), hi)
            spans[child] = (start, stop)
            end = stop
            place([t for t, p in enumerate(segment.parents) if p == child], start, stop)

    place([t for t, p in enumerate(segment.parents) if p is None], 0, n)
    return spans


def _targets(pairs: list[tuple[int, int]], n: int) -> dict[int, list[int]]:
    """Per source word, its target words (of the ``n`` there are)."""
    targets: dict[int, list[int]] = {}
    for i, j in pairs:
        if j < n:
            targets.setdefault(i, []).append(j)
    return targets


def _wanted(covered: list[int], start: int, targets: dict[int, list[int]], n: int) -> tuple[int, int]:
    """The span the alignment asks for: the target words of the source words ``covered``; of the nearest
    source word with some when they have none; empty after the words of the source words before ``start``
    (where an empty tag stood)."""
    if covered:
        found = [j for i in covered for j in targets.get(i, [])]
        if not found and targets:
            nearest = min(targets, key=lambda i: (min(abs(i - c) for c in covered), i))
            found = targets[nearest]
        if found:
            return min(found), max(found) + 1
    before = [j for i, js in targets.items() if i < start for j in js]
    at = max(before) + 1 if before else (0 if targets or not covered else n)
    return at, at


def _render(segment: Segment, words: list[str], spans: list[tuple[int, int]]) -> list[PageElement]:
    """The translated run: ``words`` with copies of the segment's tags (attributes kept) over their spans."""
    top: list[PageElement] = [NavigableString(segment.lead)] if segment.lead else []
    space = [False]  # whether a word was written and the next one needs a space before it

    def fill(into: list[PageElement], children: list[int], lo: int, hi: int) -> None:
        at = lo
        for child in sorted(children, key=lambda t: (spans[t], t)):
            text(into, at, spans[child][0])
            start, stop = spans[child]
            if space[0] and stop > start:
                into.append(NavigableString(" "))
                space[0] = False
            tag = copy.copy(segment.tags[child])
            tag.clear()
            inner: list[PageElement] = []
            fill(inner, [t for t, p in enumerate(segment.parents) if p == child], start, stop)
            for node in inner:
                tag.append(node)
            into.append(tag)
            at = stop
        text(into, at, hi)

    def text(into: list[PageElement], lo: int, hi: int) -> None:
        if lo < hi:
            into.append(NavigableString((" " if space[0] else "") + " ".join(words[lo:hi])))
            space[0] = True

    fill(top, [t for t, p in enumerate(segment.parents) if p is None], 0, len(words))
    if segment.trail:
        top.append(NavigableString(segment.trail))
    return top
