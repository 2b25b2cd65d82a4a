"""Training a word aligner for a trained model (`tmt train-aligner`): `transformer_mt.decode.aligner`'s head, the
model frozen, supervised by a word aligner's links.

The links are Pharaoh ``i-j`` lines (0-based source word i, target word j,
over the text's whitespace words), one per sentence pair: fast_align's,
eflomal's or a human's. Without a links file they are made here with
eflomal (PyPI, the ``align`` extra; Östling & Tiedemann 2016), in both
directions and symmetrized with grow-diag-final-and (`grow_diag_final_and`,
Koehn's usual symmetrization), written beside the output. The last
``valid_lines`` pairs are held out: the epoch of the best link F1 on them
is kept.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_mt.data.bpe import EOS
from transformer_mt.decode.align import format_pharaoh, parse_pharaoh, text_span, word_index
from transformer_mt.decode.aligner import Aligner, AlignerShape, model_states
from transformer_mt.errors import UserError
from transformer_mt.model.transformer import Transformer


class AlignerDataError(UserError):
    """A links file that does not fit its text, or eflomal missing: the message names the file, the line and the
    fix."""


def read_links(path: Path, sources: Sequence[str], targets: Sequence[str]) -> list[set[tuple[int, int]]]:
    """The (source word, target word) links of each line of ``path``, checked against the text's word counts."""
    from transformer_mt.data.clean import read_lines

    lines = list(read_lines(path))
    if len(lines) != len(sources):
        raise AlignerDataError(
            f"{path}: {len(lines)} lines of links for {len(sources)} sentence pairs; give one Pharaoh line "
            "(i-j pairs, 0-based source-target word indices) per pair, in the text's order"
        )
    found = []
    for n, (line, src, tgt) in enumerate(zip(lines, sources, targets, strict=True), 1):
        links = set()
        n_src, n_tgt = len(src.split()), len(tgt.split())
        for pair in line.split():
            i, dash, j = pair.partition("-")
            if not (dash and i.isdigit() and j.isdigit()):
                raise AlignerDataError(
                    f"{path}, line {n}: {pair[:40]!r} is not a link; a link is i-j, a source and a target word "
                    "index from 0 (Pharaoh format, as fast_align and eflomal write)"
                )
            if int(i) >= n_src or int(j) >= n_tgt:
                raise AlignerDataError(
                    f"{path}, line {n}: link {pair} but the pair has {n_src} source and {n_tgt} target words; "
                    "are the links of this text, counted over whitespace-separated words from 0?"
                )
            links.add((int(i), int(j)))
        found.append(links)
    return found


def eflomal_links(sources: Sequence[str], targets: Sequence[str], runs: int = 1) -> list[set[tuple[int, int]]]:
    """eflomal's links of each pair, both directions, symmetrized with `grow_diag_final_and`; with several
    ``runs``, the links that most of them agree on. eflomal samples: two runs on the same text differ on a few
    percent of links, and a majority of runs is steadier than any one of them."""
    votes: list[Counter[tuple[int, int]]] = [Counter() for _ in sources]
    for run in eflomal_samples(sources, targets, runs):
        for count, (fwd, rev) in zip(votes, run, strict=True):
            count.update(grow_diag_final_and(fwd, rev))
    return [{link for link, n in count.items() if 2 * n > runs} for count in votes]


def eflomal_samples(
    sources: Sequence[str], targets: Sequence[str], runs: int
) -> Iterator[list[tuple[set[tuple[int, int]], set[tuple[int, int]]]]]:
    """Each of ``runs`` independent eflomal alignments of the pairs: per pair, its (forward, reverse) links."""
    try:
        import eflomal
    except ImportError:
        raise AlignerDataError(
            "making the links needs eflomal: pip install 'transformer_mt[align]', or give --links FILE "
            "(Pharaoh i-j lines from any word aligner)"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        fwd, rev = Path(tmp, "fwd"), Path(tmp, "rev")
        for _ in range(runs):
            eflomal.Aligner().align(
                [line + "\n" for line in sources], [line + "\n" for line in targets],
                links_filename_fwd=str(fwd), links_filename_rev=str(rev), quiet=True,
            )  # fmt: skip
            pairs = zip(fwd.read_text().splitlines(), rev.read_text().splitlines(), strict=True)
            yield [(parse_pharaoh(f), parse_pharaoh(r)) for f, r in pairs]


def grow_diag_final_and(fwd: set[tuple[int, int]], rev: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Koehn's symmetrization of two directions' links: the intersection, grown by neighbouring links of the
    union (diagonals too) that align a word not yet aligned, then the union's links whose words are both still
    unaligned."""
    union, links = fwd | rev, set(fwd & rev)
    grown = True
    while grown:
        grown = False
        for i, j in sorted(links):
            for di in (-1, 0, 1):
                for dj in (-1, 0, 1):
                    new = (i + di, j + dj)
                    if new in union and new not in links and _unaligned(links, *new, both=False):
                        links.add(new)
                        grown = True
    for link in sorted(union - links):
        if _unaligned(links, *link, both=True):
            links.add(link)
    return links


def _unaligned(links: set[tuple[int, int]], i: int, j: int, both: bool) -> bool:
    """Whether source word i and (``both``) / or target word j have no link in ``links`` yet."""
    src_free = all(a != i for a, _ in links)
    tgt_free = all(b != j for _, b in links)
    return (src_free and tgt_free) if both else (src_free or tgt_free)


@dataclass(frozen=True)
class Example:
    """One sentence pair to learn from: source ids (+ EOS, after ``skip`` tag ids), target ids, the number of
    words of each side and the linked (source word, target word) pairs."""

    source: list[int]
    target: list[int]
    words: tuple[int, int]
    links: frozenset[tuple[int, int]]


def example(
    source: list[int], target: list[int], word_pairs: set[tuple[int, int]], bpe: spm.SentencePieceProcessor, skip: int
) -> Example | None:
    """The `Example` of one pair whose word links are ``word_pairs`` (source word, target word); None when a link
    is past the tokens' words (the text's whitespace words must be what the links count) or a side is empty."""
    start, end = text_span(source, skip)
    src_words = word_index([bpe.id_to_piece(t) for t in source[start:end]])
    tgt_words = word_index([bpe.id_to_piece(t) for t in target])
    if not src_words or not tgt_words:
        return None
    n_src, n_tgt = src_words[-1] + 1, tgt_words[-1] + 1
    if any(i >= n_src or j >= n_tgt for i, j in word_pairs):
        return None
    return Example(source, target, (n_src, n_tgt), frozenset(word_pairs))


def _labels(batch: Sequence[Example], shape: torch.Size) -> tuple[Tensor, Tensor]:
    """Targets (B, Wt, Ws) of ``batch`` (1 where linked) and the mask of the word pairs that are real."""
    labels, counted = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    for b, e in enumerate(batch):
        counted[b, : e.words[1], : e.words[0]] = True
        for i, j in e.links:
            labels[b, j, i] = 1.0
    return labels, counted


def batches(examples: Sequence[Example], size: int, rng: random.Random) -> Iterator[list[Example]]:
    """``examples`` in batches of about ``size`` sentences of similar length, in a random order."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].target), rng.random()))
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(chunks)
    for chunk in chunks:
        yield [examples[i] for i in chunk]


def loss_of(
    model: Transformer, aligner: Aligner, bpe: spm.SentencePieceProcessor, batch: Sequence[Example], skip: int
) -> tuple[Tensor, Tensor]:
    """The mean binary cross-entropy of ``batch``'s word pairs, and (pairs, true positives, predicted, gold) at
    probability 0.5 for the link F1."""
    states = model_states(model, bpe, [e.source for e in batch], [e.target for e in batch], skip)
    logits = aligner(states)
    labels, counted = (x.to(logits.device) for x in _labels(batch, logits.shape))
    loss = F.binary_cross_entropy_with_logits(logits[counted], labels[counted])
    predicted, gold = (logits[counted] > 0).float(), labels[counted]
    counts = torch.stack([counted.sum().float(), (predicted * gold).sum(), predicted.sum(), gold.sum()])
    return loss, counts.detach().cpu()


def f1(counts: Tensor) -> float:
    """The link F1 of summed `loss_of` counts."""
    _, hit, predicted, gold = counts.tolist()
    return 2 * hit / max(predicted + gold, 1.0)


def train(
    model: Transformer,
    bpe: spm.SentencePieceProcessor,
    train_set: Sequence[Example],
    valid_set: Sequence[Example],
    shape: AlignerShape,
    *,
    epochs: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 1,
    skip: int = 0,
    report: Callable[[str], None] = print,
    step_done: Callable[[], None] = lambda: None,
) -> tuple[Aligner, dict[str, float]]:
    """An `Aligner` for the frozen ``model`` trained on ``train_set`` (Adam, a linear decay to 0), the epoch of the
    best validation F1 kept; that F1 and loss."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model.eval().requires_grad_(False)
    aligner = Aligner(model.cfg.d_model, shape).to(model.embed.weight.device)
    optimizer = torch.optim.Adam(aligner.parameters(), lr=lr)
    steps = epochs * math.ceil(len(train_set) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / max(steps, 1)))
    best: tuple[float, dict[str, Tensor], dict[str, float]] = (-1.0, {}, {})
    for epoch in range(1, epochs + 1):
        started = time.monotonic()
        aligner.train()
        for batch in batches(train_set, batch_size, rng):
            loss, _ = loss_of(model, aligner, bpe, batch, skip)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step_done()
        figures = evaluate(model, aligner, bpe, valid_set, batch_size, skip)
        report(
            f"epoch {epoch}: valid loss {figures['loss']:.4f}, link F1 {figures['f1']:.4f} "
            f"({time.monotonic() - started:.0f} s)"
        )
        if figures["f1"] > best[0]:
            best = (figures["f1"], {k: v.detach().clone() for k, v in aligner.state_dict().items()}, figures)
    aligner.load_state_dict(best[1])
    return aligner.eval(), best[2]


@torch.no_grad()
def evaluate(
    model: Transformer,
    aligner: Aligner,
    bpe: spm.SentencePieceProcessor,
    examples: Sequence[Example],
    batch_size: int,
    skip: int,
) -> dict[str, float]:
    """Validation loss (per counted pair) and link F1 of ``aligner`` on ``examples``."""
    aligner.eval()
    total, counts = 0.0, torch.zeros(4)
    for batch in batches(examples, batch_size, random.Random(0)):
        loss, c = loss_of(model, aligner, bpe, batch, skip)
        total += loss.item() * c[0].item()
        counts += c
    return {"loss": total / max(counts[0].item(), 1.0), "f1": f1(counts)}


def _text_and_links(
    sources_file: Path,
    targets_file: Path,
    links_file: Path | None,
    out: Path,
    runs: int,
    report: Callable[[str], None],
) -> tuple[list[str], list[str], list[set[tuple[int, int]]]]:
    """The pairs' two sides and their links: ``links_file``'s, or the majority of ``runs`` of eflomal's (then
    kept in OUT.links)."""
    from transformer_mt.data.clean import read_lines
    from transformer_mt.files import atomic_write_text

    sources, targets = list(read_lines(sources_file)), list(read_lines(targets_file))
    if len(sources) != len(targets):
        raise AlignerDataError(
            f"{sources_file} has {len(sources)} lines and {targets_file} {len(targets)}; give the two sides of "
            "one parallel text, line N of one the translation of line N of the other"
        )
    if links_file is not None:
        links = read_links(links_file, sources, targets)
    else:
        report(f"aligning {len(sources):,} pairs with eflomal ({runs} run(s), both directions, grow-diag-final-and)")
        links = eflomal_links(sources, targets, runs)
        atomic_write_text(Path(f"{out}.links"), "".join(format_pharaoh(p) + "\n" for p in links))
    return sources, targets, links


def _examples(
    bpe: spm.SentencePieceProcessor,
    limit: int,
    sources: Sequence[str],
    targets: Sequence[str],
    links: Sequence[set[tuple[int, int]]],
) -> list[Example]:
    """The `Example` of each pair that has one (`example`), its sides encoded as training encodes them and cut to
    ``limit`` tokens."""
    from transformer_mt.data.clean import normalize

    examples = []
    for src, tgt, pairs in zip(sources, targets, links, strict=True):
        source = bpe.encode(normalize(src), out_type=int)[:limit]
        target = bpe.encode(normalize(tgt), out_type=int)[:limit]
        found = example([*source, EOS], target, pairs, bpe, 0) if source and target else None
        if found is not None:
            examples.append(found)
    return examples


def train_aligner(
    checkpoint: Path,
    sources_file: Path,
    targets_file: Path,
    links_file: Path | None,
    out: Path,
    *,
    eflomal_runs: int = 1,
    epochs: int = 4,
    valid_lines: int = 1000,
    batch_size: int = 64,
    shape: AlignerShape | None = None,
    seed: int = 1,
    report: Callable[[str], None] = print,
) -> dict[str, float]:
    """Train a word aligner for ``checkpoint``'s model on the pairs of ``sources_file`` and ``targets_file``,
    supervised by ``links_file`` (None: eflomal's links, written to OUT.links); write the checkpoint with it
    (atomically) to ``out``. The validation figures of the epoch kept."""
    from tqdm import tqdm

    from transformer_mt.checkpoint.io import read_checkpoint, write_checkpoint
    from transformer_mt.data.directions import multilingual
    from transformer_mt.decode.aligner import to_entry
    from transformer_mt.decode.load import load_checkpoint

    shape = shape or AlignerShape()
    if shape.dim % shape.heads:
        raise AlignerDataError(f"--dim {shape.dim}: the aligner's {shape.heads} attention heads need a multiple")
    sources, targets, links = _text_and_links(sources_file, targets_file, links_file, out, eflomal_runs, report)
    ck = read_checkpoint(checkpoint)
    ck.training = None  # the written checkpoint is a model to translate with, not a run to resume
    loaded = load_checkpoint(ck, checkpoint, "cpu")
    if multilingual(loaded.config.data):
        raise AlignerDataError(
            f"{checkpoint}: a model of several directions; tmt train-aligner trains for one-pair models only"
        )
    bpe = loaded.bpe
    examples = _examples(bpe, loaded.config.model.max_positions - 1, sources, targets, links)
    if len(examples) < 2 * max(valid_lines, 1):
        raise AlignerDataError(
            f"{sources_file}: {len(examples)} usable sentence pairs, too few to train an aligner and hold "
            f"{valid_lines} out; give more pairs (the training corpus) or a smaller --valid-lines"
        )
    skipped = len(sources) - len(examples)
    report(f"{len(examples):,} pairs ({skipped:,} skipped: empty, or words the links do not count); "
           f"{valid_lines:,} held out")  # fmt: skip
    steps = epochs * math.ceil((len(examples) - valid_lines) / batch_size)
    with tqdm(total=steps, desc="aligner", unit="batch", leave=False, dynamic_ncols=True) as bar:
        aligner, figures = train(
            loaded.model, bpe, examples[:-valid_lines], examples[-valid_lines:], shape, epochs=epochs,
            batch_size=batch_size, seed=seed,
            report=lambda line: tqdm.write(line), step_done=lambda: bar.update(1),
        )  # fmt: skip
    ck.aligner = to_entry(aligner, figures)
    write_checkpoint(out, ck)
    return figures
