"""Lexically constrained decoding on real text: constraint coverage, BLEU change and speed against the ordinary search.

The evaluation of Post & Vilar (2018): constraints drawn from the reference
translation, 1-2 phrases per line, each a random word or a random bigram of
the reference (seeded; punctuation stripped from the words' ends, phrases at
places of their own in the reference). Two sets are drawn:

- ``random``: any reference words, as Post & Vilar did; many of them are in
  the unconstrained translation already;
- ``missing``: only words and bigrams that the unconstrained translation
  lacks, so that every constraint changes the output (lines where none is
  left go without constraints and are not counted).

For each set: coverage (each phrase in its line's output, as text, as whole
words, and as the search counts it on the output encoded again), sacreBLEU of the constrained
lines against the unconstrained translation of the same lines, and
sentences/s against the ordinary search on the same lines, both timed in
this process, taking turns (``--repeats``; medians). A third run decodes
every line with `constrained_search` and no constraints, and counts the lines
that differ from `beam_search`.

    python benchmarks/constrained_decoding.py -c runs/multi30k/average.pt \\
        --src data/multi30k/test.en --ref data/multi30k/test.de --threads 1
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_mt.data.clean import normalize  # noqa: E402
from transformer_mt.decode.constrained import constrained_search, contains_constraints  # noqa: E402
from transformer_mt.decode.search import pad_batch  # noqa: E402
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.decode.translate import Translator  # noqa: E402

PUNCT = ".,;:!?\"'()"


def reference_phrases(ref: str, rng: random.Random, banned: str | None) -> list[str]:
    """1-2 phrases of ``ref`` (random words or bigrams at places of their own); with ``banned`` (an output text),
    only phrases that it does not contain as words."""
    words = [w.strip(PUNCT) for w in ref.split()]
    spans = [(i, 1) for i, w in enumerate(words) if w] + [
        (i, 2) for i in range(len(words) - 1) if words[i] and words[i + 1] and not ref.split()[i].endswith(tuple(PUNCT))
    ]
    if banned is not None:
        padded = f" {' '.join(w.strip(PUNCT) for w in banned.split())} "
        spans = [(i, n) for i, n in spans if f" {' '.join(words[i : i + n])} " not in padded]
    rng.shuffle(spans)
    wanted = rng.randint(1, 2)
    chosen: list[tuple[int, int]] = []
    for i, n in spans:
        if len(chosen) == wanted:
            break
        if all(i + n <= j or j + m <= i for j, m in chosen):
            chosen.append((i, n))
    return [" ".join(words[i : i + n]) for i, n in sorted(chosen)]


def timed(run: Callable[[], list[str]], results: list[float]) -> list[str]:
    """``run()``, its seconds appended to ``results``."""
    start = time.perf_counter()
    out = run()
    results.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", required=True)
    parser.add_argument("--src", required=True, help="source text, one sentence per line")
    parser.add_argument("--ref", required=True, help="reference translations")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lines", type=int, default=0, help="the first N lines only (0: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sources = Path(args.src).read_text(encoding="utf-8").splitlines()
    refs = Path(args.ref).read_text(encoding="utf-8").splitlines()
    if args.lines:
        sources, refs = sources[: args.lines], refs[: args.lines]
    translator = Translator.from_checkpoints([args.checkpoint], "cpu", [f"decode.beam_size={args.beam}"])
    translator.show_progress = False
    d = translator.cfg.decode
    print(
        f"{len(sources)} lines, beam {d.beam_size}, len_penalty {d.len_penalty} ({d.len_penalty_form}), "
        f"no_repeat_ngram {d.no_repeat_ngram}, stopping {d.stopping}, {args.threads} thread(s)"
    )
    plain = translator.translate_lines(sources)
    for name, banned in (("random", None), ("missing", plain)):
        rng = random.Random(args.seed)
        phrases = [reference_phrases(ref, rng, None if banned is None else banned[i]) for i, ref in enumerate(refs)]
        todo = [i for i, p in enumerate(phrases) if p]
        lines = ["\t".join([sources[i], *phrases[i]]) for i in todo]
        subset = [sources[i] for i in todo]
        times: dict[str, list[float]] = {"plain": [], "constrained": []}
        for _ in range(args.repeats):  # taking turns: a busy machine slows both alike
            translator.constraints = True
            constrained = timed(partial(translator.translate_lines, lines), times["constrained"])
            translator.constraints = False
            timed(partial(translator.translate_lines, subset), times["plain"])
        baseline = [plain[i] for i in todo]
        report(name, todo, phrases, constrained, baseline, [refs[i] for i in todo], times, translator)
    same_without_constraints(translator, sources, plain)


def report(
    name: str,
    todo: list[int],
    phrases: list[list[str]],
    constrained: list[str],
    baseline: list[str],
    refs: list[str],
    times: dict[str, list[float]],
    translator: Translator,
) -> None:
    wanted = [phrases[i] for i in todo]
    count = sum(map(len, wanted))
    as_text = sum(out.count(p) >= ps.count(p) for out, ps in zip(constrained, wanted, strict=True) for p in ps)
    as_words = sum(  # whole words: no letter or digit right before or after the phrase
        len(re.findall(rf"(?<!\w){re.escape(p)}(?!\w)", out)) >= ps.count(p)
        for out, ps in zip(constrained, wanted, strict=True)
        for p in ps
    )
    as_tokens = 0  # lines whose output, encoded again, holds all its phrases as the search counts them
    for out, ps in zip(constrained, wanted, strict=True):
        ids = translator.bpe.encode(normalize(out), out_type=int)
        if contains_constraints(ids, [translator.bpe.encode(normalize(p), out_type=int) for p in ps]):
            as_tokens += 1
        else:
            print(f"  encoded again, {out!r} does not hold {ps} as tokens: {translator.bpe.encode(out, out_type=str)}")
    in_plain = sum(p in out for out, ps in zip(baseline, wanted, strict=True) for p in ps)
    bleu_plain = sacrebleu.corpus_bleu(baseline, [refs]).score
    bleu_constrained = sacrebleu.corpus_bleu(constrained, [refs]).score
    t_plain, t_con = statistics.median(times["plain"]), statistics.median(times["constrained"])
    print(f"\n[{name}] {len(todo)} lines, {count} phrases ({in_plain} already in the unconstrained output)")
    print(f"  coverage: {as_text}/{count} phrases as text ({100 * as_text / count:.1f}%), {as_words}/{count} as whole "
          f"words; {as_tokens}/{len(todo)} lines hold all theirs as tokens")  # fmt: skip
    print(f"  sacreBLEU: unconstrained {bleu_plain:.2f} -> constrained {bleu_constrained:.2f} "
          f"({bleu_constrained - bleu_plain:+.2f})")  # fmt: skip
    print(f"  speed: unconstrained {len(todo) / t_plain:.1f} sent/s, constrained {len(todo) / t_con:.1f} sent/s, "
          f"ratio {t_plain / t_con:.2f}x (seconds: {times['plain']} / {times['constrained']})")  # fmt: skip
    changed = sum(a != b for a, b in zip(constrained, baseline, strict=True))
    print(f"  lines changed by their constraints: {changed}/{len(todo)}")


def same_without_constraints(translator: Translator, sources: list[str], plain: list[str]) -> None:
    """`constrained_search` with no constraints on every line, one batch per 64 lines, against `beam_search`."""
    ids = [translator.encode(i, line) for i, line in enumerate(sources)]
    out = []
    for start in range(0, len(ids), 64):
        batch = ids[start : start + 64]
        hyps = constrained_search(
            translator.model, pad_batch(batch), [[]] * len(batch), SearchSettings.of(translator.cfg)
        )
        out += [translator.bpe.decode(h[0].tokens) for h in hyps]
    differ = sum(a != b for a, b in zip(out, plain, strict=True))
    print(f"\nconstrained_search without constraints: {differ}/{len(sources)} lines differ from beam_search")


if __name__ == "__main__":
    main()
