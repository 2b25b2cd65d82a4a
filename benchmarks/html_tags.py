"""How well ``format: "html"`` places inline tags: test2016 sentences with 1-2 adjacent source words in a tag.

Each of the first N lines of the test set gets one tag (``<b>``, ``<a
href>`` or ``<i>``, in turn) around 1-2 adjacent source words that the gold
alignment links to some reference word. The gold alignment is independent
of tmt: eflomal, trained on Multi30k train plus the evaluated pairs in both
directions and symmetrized (grow-diag-final-and). Each tagged line is
translated through the server's code path without HTTP (`parse_libre`, the
translator with the request's decode settings, `libre_response`), twice:

- forced: the reference as the translation found (the search replaced by
  it, its alignment read by the same teacher-forced pass as any
  translation's), so that the tag lands on reference words, compared with
  the reference words eflomal links to the wrapped source words; for each
  decoder layer of ``--layers``;
- free: the model's own translation, compared with eflomal's links between
  the source and that translation.

A tag is *right* when the target words it wraps are exactly the span, first
to last, of the gold words; it *overlaps* when it wraps at least one of
them. On every line the output must hold the source's tags, each once.

Two tag sets are measured, each line tagged once in each: around any words
the gold links, and around *unambiguous* words only: words that every
eflomal run (``--gold-runs``, 5) links to the same target words in both
directions and after symmetrizing, in the reference and in the free
translation alike. On the first set the gold disagrees with itself on a few
percent of tags (``--gold-agreement`` measures it), which caps any
aligner's score; on the second it agrees with itself.

    python benchmarks/html_tags.py -c runs/multi30k_hour/average.pt --data ../shared/data/multi30k --lines 500
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path

from bs4 import BeautifulSoup

from transformer_mt.data.bpe import EOS
from transformer_mt.data.clean import normalize
from transformer_mt.decode.align import alignments, format_alignment, piece_attention, word_index, word_matrix
from transformer_mt.decode.translate import Translation, Translator
from transformer_mt.serve.html import split
from transformer_mt.serve.protocol import LibreRequest, Limits, libre_response, parse_libre
from transformer_mt.train.aligner import eflomal_samples, grow_diag_final_and

TAGS = ("<b>{}</b>", '<a href="https://example.org/?q=1&amp;r=2">{}</a>', "<i>{}</i>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="Multi30k: train.en, train.de, test.en, test.de")
    parser.add_argument("--split", default="test", help="test (test2016) or valid")
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--set", action="append", default=[], help="a decode override, e.g. decode.alignment_layer=5")
    parser.add_argument("--layers", default="0", help="decoder layers to align forced references with (0: the top)")
    parser.add_argument("--shift", action="store_true", help="also align forced references by the shifted attention")
    parser.add_argument("--gold-runs", type=int, default=5, help="eflomal runs the gold is the majority of")
    parser.add_argument("--gold-agreement", action="store_true", help="only how often two golds, made alike and "
                        "independently, give a tag the same span: the most any aligner can agree with one")  # fmt: skip
    parser.add_argument("--alignment", choices=("soft", "hard"), help="the kind of alignment line the tags are "
                        "placed by (default: the server's choice)")  # fmt: skip
    args = parser.parse_args()
    src = (args.data / f"{args.split}.en").read_text(encoding="utf-8").splitlines()[: args.lines]
    ref = (args.data / f"{args.split}.de").read_text(encoding="utf-8").splitlines()[: args.lines]
    if args.gold_agreement:
        return gold_agreement(args.data, src, ref, args.gold_runs)
    translator = Translator.from_checkpoints([args.checkpoint], device="cpu", overrides=args.set)
    translator.show_progress = False
    started = time.monotonic()
    free = [hyps[0].text for hyps in translator.translate_lines_nbest(src, nbest=1)]
    gold, sure = gold_alignments(args.data, src + src, ref + free, args.gold_runs)
    n = len(src)
    unambiguous = [a & b for a, b in zip(sure[:n], sure[n:], strict=True)]  # in the reference and in `free`
    sets = {"every gold-linked word": None, "unambiguous words": unambiguous}
    for name, words in sets.items():
        print(f"== tags around {name}")
        rng = random.Random(48)
        tagged = [tag_line(line, links if words is None else {p for p in links if p[0] in words[k]}, k, rng)
                  for k, (line, links) in enumerate(zip(src, gold[:n], strict=True))]  # fmt: skip
        kept = [i for i, t in enumerate(tagged) if t is not None]
        print(f"{len(kept)} of {n} {args.split} lines tagged (the others: no such word)")
        docs = [tagged[i][0] for i in kept]  # type: ignore[index]
        spans = [tagged[i][1] for i in kept]  # type: ignore[index]
        for layer in map(int, args.layers.split(",")):
            for shift in (False, True) if args.shift else (False,):
                forced = force_html(translator, docs, [ref[i] for i in kept], layer, shift, args.alignment)
                report(f"forced, layer {layer or 'top'}{', shifted' if shift else ''}", docs, forced, spans,
                       [gold[i] for i in kept], [ref[i] for i in kept])  # fmt: skip
        freed = translate_html(translator, docs, args.alignment)
        report("free decoding", docs, freed, spans, [gold[n + i] for i in kept], [free[i] for i in kept])
    print(f"{time.monotonic() - started:.0f} s")


def request_of(translator: Translator, docs: list[str], kind: str | None) -> LibreRequest:
    """``/translate`` with ``"format": "html"`` and ``q`` the documents, each of one segment; ``kind``: the
    alignment line asked for instead of the server's."""
    request = parse_libre(
        {"q": docs, "source": "en", "target": "de", "format": "html"}, translator.cfg,
        Limits(max_lines=len(docs), max_chars=10**9),
    )  # fmt: skip
    assert len(request.job.lines) == len(docs), "one segment per document"
    if kind is not None:
        request.job.decode["alignment"] = kind
    return request


def translate_html(translator: Translator, docs: list[str], kind: str | None) -> list[str]:
    """Each document translated as ``/translate`` does, all in one search."""
    request = request_of(translator, docs, kind)
    results = translator.with_decode(request.job.decode).translate_lines_nbest(request.job.lines, nbest=1)
    return libre_response(request, results)["translatedText"]


def force_html(
    translator: Translator, docs: list[str], refs: list[str], layer: int, shift: bool, kind: str | None
) -> list[str]:
    """Each document "translated" into its reference: the reference in place of the search's hypothesis, aligned
    as tmt aligns a hypothesis (`transformer_mt.decode.align`, decoder ``layer``), then placed as a request's.
    ``shift``: a candidate, not tmt's alignment: target token t aligned by the attention of the step that reads
    it (query t + 1) rather than the one that predicts it (Chen et al., 2020)."""
    request = request_of(translator, docs, kind)
    model, bpe, skip = translator.model, translator.bpe, len(translator.source_prefix)
    sources = [translator.encode(i, line) for i, line in enumerate(request.job.lines)]
    targets = [bpe.encode(normalize(r), out_type=int) for r in refs]
    layer = layer or model.cfg.decoder_layers
    if shift:
        found = []
        for s, t, w in zip(sources, targets, piece_attention(model, sources, [[*t, EOS] for t in targets], layer, skip),
                           strict=True):  # fmt: skip
            src_words = word_index([bpe.id_to_piece(x) for x in s[skip : skip + w.shape[1]]])
            found.append(format_alignment(word_matrix(w[1:], src_words, word_index(map(bpe.id_to_piece, t))), "hard"))
    elif layer == model.cfg.decoder_layers:  # as the server aligns: by the checkpoint's aligner when it has one
        found = translator.with_decode(request.job.decode).align(sources, targets)
    else:
        found = alignments(model, bpe, sources, targets, layer, request.job.decode["alignment"], skip)
    results = [[Translation(ref, 0.0, 0.0, links)] for ref, links in zip(refs, found, strict=True)]
    return libre_response(request, results)["translatedText"]


def gold_alignments(
    data: Path, src: list[str], tgt: list[str], runs: int
) -> tuple[list[set[tuple[int, int]]], list[set[int]]]:
    """eflomal's links of each (src, tgt) pair, trained with Multi30k train, both directions, grow-diag-final-and,
    the links most of ``runs`` agree on (`eflomal_links`); and each pair's *unambiguous* source words: linked,
    and to the same target words by both directions of every run, so that no run's gold could say otherwise."""
    train_src = (data / "train.en").read_text(encoding="utf-8").splitlines()
    train_tgt = (data / "train.de").read_text(encoding="utf-8").splitlines()
    votes: list[Counter[tuple[int, int]]] = [Counter() for _ in src]
    seen: list[dict[int, set[frozenset[tuple[int, int]]]]] = [{} for _ in src]
    for run in eflomal_samples(train_src + src, train_tgt + tgt, runs):
        for line, count, views, (fwd, rev) in zip(src, votes, seen, run[len(train_src) :], strict=True):
            links = grow_diag_final_and(fwd, rev)
            count.update(links)
            for i in range(len(line.split())):
                for view in (links, fwd, rev):
                    views.setdefault(i, set()).add(frozenset(p for p in view if p[0] == i))
    gold = [{link for link, n in count.items() if 2 * n > runs} for count in votes]
    return gold, [{i for i, v in views.items() if len(v) == 1 and all(v)} for views in seen]


def gold_agreement(data: Path, src: list[str], ref: list[str], runs: int) -> None:
    """How often a second gold, made as the first (other eflomal samples), gives each tagged line's tag the first
    one's span, over tags around every gold-linked word and around unambiguous ones: eflomal's own agreement,
    the ceiling of any aligner's measured against one gold."""
    (first, sure), (second, _) = gold_alignments(data, src, ref, runs), gold_alignments(data, src, ref, runs)
    for name, words in (("every gold-linked word", None), ("unambiguous words", sure)):
        rng = random.Random(48)
        same = total = 0
        for k, (line, a, b) in enumerate(zip(src, first, second, strict=True)):
            tagged = tag_line(line, a if words is None else {p for p in a if p[0] in words[k]}, k, rng)
            if tagged is None:
                continue
            want = [sorted({j for i, j in links if i in tagged[1]}) for links in (a, b)]
            total += 1
            same += bool(want[1]) and (want[0][0], want[0][-1]) == (want[1][0], want[1][-1])
        print(f"tags around {name}: two golds of {runs} eflomal run(s) each give a tag the same span on {same} "
              f"of {total} lines ({same / max(total, 1):.1%})")  # fmt: skip


def tag_line(line: str, links: set[tuple[int, int]], k: int, rng: random.Random) -> tuple[str, range] | None:
    """``line`` with 1-2 adjacent words, each linked by ``links``, wrapped in the k-th of `TAGS`, and the words'
    indices; None when no word is linked."""
    words = line.split()
    linked = sorted({i for i, _ in links if i < len(words)})
    if not linked:
        return None
    first = rng.choice(linked)
    width = 2 if first + 1 in linked and rng.random() < 0.5 else 1
    span = range(first, first + width)
    inner = " ".join(words[i] for i in span).replace("&", "&amp;").replace("<", "&lt;")
    escape = [w.replace("&", "&amp;").replace("<", "&lt;") for w in words]
    doc = " ".join([*escape[:first], TAGS[k % len(TAGS)].format(inner), *escape[first + width :]])
    return doc, span


def tags(document: str) -> Counter:
    soup = BeautifulSoup(document, "html.parser")
    return Counter((t.name, tuple(sorted(t.attrs.items()))) for t in soup.find_all(True))


def report(
    name: str, docs: list[str], outs: list[str], spans: list[range], gold: list[set[tuple[int, int]]], texts: list[str]
) -> None:
    """Tags lost or duplicated, and how often the tag wraps the gold words, over the lines whose output text is
    ``texts`` (the reference when forced: a line where the model went past it is counted apart)."""
    broken = sum(tags(out) != tags(doc) for doc, out in zip(docs, outs, strict=True))
    right = overlap = other = empty = 0
    for out, span, links, text in zip(outs, spans, gold, texts, strict=True):
        segment = split(out)[0]
        if segment.text != " ".join(text.split()):
            other += 1
            continue
        want = sorted({j for i, j in links if i in span})
        got = [j for j, chain in enumerate(segment.chains) if 0 in chain]
        if not want:
            empty += 1
            continue
        right += got == list(range(want[0], want[-1] + 1))
        overlap += bool(set(got) & set(want))
    scored = len(outs) - other - empty
    print(f"{name}: {len(outs)} lines, tags lost or duplicated on {broken}; output not the expected text on "
          f"{other}, no gold link to the target on {empty}; of the {scored} scored, tag around the right words "
          f"{right} ({right / max(scored, 1):.1%}), overlapping them {overlap} ({overlap / max(scored, 1):.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
