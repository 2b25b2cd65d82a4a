"""Which decoder layer's attention gives the most plausible word alignments (`decode.alignment_layer`).

The model translates the first N lines of a test set with ``--alignment
hard`` read from each decoder layer in turn. Two measures, no gold
alignments needed: for every target word spelt exactly like one source word
(case aside: names, numbers, shared words), whether its link points at that
word; and the mean distance of the links from the diagonal, |i/I - j/J|.

    python benchmarks/alignment_layer.py -c runs/multi30k/average.pt --text ../shared/data/multi30k/test.en
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformer_mt.decode.translate import Translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=300)
    args = parser.parse_args()
    lines = args.text.read_text(encoding="utf-8").splitlines()[: args.lines]
    layers = Translator.from_checkpoints([args.checkpoint], device="cpu").cfg.model.decoder_layers
    for layer in range(1, layers + 1):
        t = Translator.from_checkpoints(
            [args.checkpoint], device="cpu", overrides=["decode.alignment=hard", f"decode.alignment_layer={layer}"]
        )
        t.show_progress = False
        hit = total = 0
        distances = []
        for src, hyps in zip(lines, t.translate_lines_nbest(lines, nbest=1), strict=True):
            best = hyps[0]
            if not best.alignment:
                continue
            source, target = [w.lower() for w in src.split()], best.text.split()
            links = {int(j): int(i) for i, j in (pair.split("-") for pair in best.alignment.split())}
            for j, word in enumerate(target):
                if source.count(word.lower()) == 1:
                    total += 1
                    hit += links.get(j) == source.index(word.lower())
            distances += [abs(i / max(len(source) - 1, 1) - j / max(len(target) - 1, 1)) for j, i in links.items()]
        print(f"layer {layer}: identical words linked {hit}/{total} ({hit / max(total, 1):.1%}); "
              f"mean |i/I - j/J| {sum(distances) / max(len(distances), 1):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
