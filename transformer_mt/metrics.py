"""The scores of `tmt score`, `tmt evaluate` and training's validation: sacreBLEU, chrF, TER and the paper's
tokenized, compound-split BLEU.

Two BLEU figures, because they answer different questions:

- **sacreBLEU** (13a tokenization, cased, one reference) on detokenized
  output: the standard, comparable figure, reported with its signature.
- **The paper's BLEU**: what tensor2tensor's ``get_ende_bleu.sh`` computed for
  the paper's tables. Hypotheses and references are passed through Moses'
  ``replace-unicode-punctuation.perl`` and ``tokenizer.perl -l <lang>``
  (`sacremoses`, same rules), hyphenated compounds are split with
  ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`` (German targets, as for the paper's
  en-de table), and BLEU is computed on the resulting tokens exactly as
  ``multi-bleu.perl`` does (sacreBLEU with ``tokenize='none'`` and no
  smoothing). It is usually higher than sacreBLEU on the same output, because
  splitting compounds and punctuation creates many easy matches.

Scoring only: no model, no translation. It sits below `data/`, `model/` and
`decode/` in the layering (docs/architecture.md), so that training's
validation and any later stage can score without importing the
`tmt evaluate` command (`transformer_mt.evaluate`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_mt.data.clean import read_lines as _read_utf8_lines
from transformer_mt.errors import UserError
from transformer_mt.files import atomic_write_lines

_COMPOUND = re.compile(r"(\S)-(\S)")


class EvaluateError(UserError):
    """Input problems a user can fix; the message names the files and the fix.

    Raised by the scoring here (an unreadable, empty or mismatched file) and by the
    `tmt evaluate` command (`transformer_mt.evaluate`), which scores through it: one class for both.
    """


# -- the paper's metric


def compound_split(line: str) -> str:
    """tensor2tensor's ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``: same regex, same non-overlapping scan."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def moses_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """replace-unicode-punctuation.perl, then tokenizer.perl -l ``lang`` (default escaping, no -a), via sacremoses."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    punct = MosesPunctNormalizer(lang=lang)
    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(punct.replace_unicode_punct(line), return_str=True, escape=True) for line in lines]


def paper_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str, split_compounds: bool) -> dict[str, Any]:
    """Tokenized, case-sensitive BLEU (multi-bleu.perl equivalent) after Moses tokenization and compound splitting."""
    from sacrebleu.metrics import BLEU

    hyp_tok, ref_tok = moses_tokenize(hyps, lang), moses_tokenize(refs, lang)
    if split_compounds:
        hyp_tok, ref_tok = [compound_split(h) for h in hyp_tok], [compound_split(r) for r in ref_tok]
    return bleu_details(BLEU(tokenize="none", force=True, smooth_method="none").corpus_score(hyp_tok, [ref_tok]))


def bleu_details(score: Any) -> dict[str, Any]:
    """The parts of a sacreBLEU BLEUScore worth saving: score, n-gram precisions (%), brevity penalty, lengths."""
    return {
        "score": round(score.score, 4),
        "precisions": [round(p, 4) for p in score.precisions],
        "bp": round(score.bp, 6),
        "hyp_len": score.sys_len,
        "ref_len": score.ref_len,
    }


# -- scoring files


def read_lines(path: Path, role: str) -> list[str]:
    """Lines of a UTF-8 file, split on '\\n' only; a bad byte is an error naming the file and line.

    An empty file is refused: a corpus score of no sentences does not
    exist (sacreBLEU fails on it), and it is almost always the wrong file.
    """
    try:
        lines = list(_read_utf8_lines(path))
    except OSError as err:
        raise EvaluateError(f"{path}: cannot read the {role} file ({err.strerror})") from None
    if not lines:
        raise EvaluateError(f"{path}: the {role} file is empty; nothing to score (is it the right file?)")
    return lines


def corpus_sacrebleu(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """sacreBLEU (13a, cased, one reference) of detokenized ``hyps`` against raw ``refs``, with its signature.

    The figure of `tmt evaluate` and `tmt score`, and of the validation BLEU that training logs.
    """
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    return {**bleu_details(bleu.corpus_score(list(hyps), [list(refs)])), "signature": str(bleu.get_signature())}


def score_lines(hyps: Sequence[str], refs: Sequence[str], lang: str = "de") -> dict[str, Any]:
    """sacreBLEU (13a, cased), chrF and TER with signatures, and the paper's BLEU; compounds split for German.

    TER is sacreBLEU's (Snover et al. 2006, tercom's rules): edits, shifts
    included, per reference word, in percent; lower is better.
    """
    from sacrebleu.metrics import CHRF, TER

    chrf, ter = CHRF(), TER()
    split = lang == "de"
    return {
        "sentences": len(hyps),
        "sacrebleu": corpus_sacrebleu(hyps, refs),
        "chrf": {"score": round(chrf.corpus_score(list(hyps), [list(refs)]).score, 4),
                 "signature": str(chrf.get_signature())},
        "ter": {"score": round(ter.corpus_score(list(hyps), [list(refs)]).score, 4),
                "signature": str(ter.get_signature())},
        "paper_bleu": {
            **paper_bleu(hyps, refs, lang, split),
            "metric": f"tokenized BLEU (Moses -l {lang}), case-sensitive"
            + (", compound splitting ##AT##-##AT##" if split else "")
            + ", multi-bleu.perl equivalent (tensor2tensor get_ende_bleu.sh)",
        },
    }  # fmt: skip


def score_files(hyp: str | Path, ref: str | Path, lang: str = "de") -> dict[str, Any]:
    """Score detokenized hypotheses against raw references (one sentence per line, same line count)."""
    hyp, ref = Path(hyp), Path(ref)
    hyps, refs = read_lines(hyp, "hypothesis"), read_lines(ref, "reference")
    if len(hyps) != len(refs):
        raise EvaluateError(
            f"{hyp} has {len(hyps)} lines but {ref} has {len(refs)}; each hypothesis line must translate the "
            "reference line with the same number (was the output of another test set, or cut short?)"
        )
    return {"hyp": str(hyp), "ref": str(ref), **score_lines(hyps, refs, lang)}


def write_scores(path: Path, scores: dict[str, Any]) -> None:
    """``scores`` as indented JSON, written whole or not at all: what `tmt report` reads back."""
    atomic_write_lines(path, [json.dumps(scores, indent=2)])


def format_scores(scores: dict[str, Any]) -> str:
    """A few aligned lines for people; scores.json holds the same and more."""
    s, c, p = scores["sacrebleu"], scores["chrf"], scores["paper_bleu"]
    precisions = "/".join(f"{x:.1f}" for x in s["precisions"])
    return "\n".join(
        [
            f"sacreBLEU   {s['score']:6.2f}  {precisions} BP {s['bp']:.3f}  {s['signature']}",
            f"chrF2       {c['score']:6.2f}  {c['signature']}",
            *(
                [f"TER         {scores['ter']['score']:6.2f}  {scores['ter']['signature']} (lower is better)"]
                if "ter" in scores
                else []
            ),
            f"paper BLEU  {p['score']:6.2f}  {p['metric']}; the metric of the paper's tables",
        ]
    )
