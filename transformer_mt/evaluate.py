"""`tmt evaluate`: translate a test set with a checkpoint and score it (`transformer_mt.metrics`).

The test set is a named one (sacreBLEU's), the checkpoint config's own
``test``/``valid`` split, or local ``--src``/``--ref`` files. The scores are
`transformer_mt.metrics.score_files`'s (sacreBLEU, chrF, TER and the paper's
BLEU), with the decoding settings, in ``scores.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformer_mt.checkpoint import decoded_file
from transformer_mt.config import DataConfig, DecodeConfig
from transformer_mt.data.directions import Direction, choose, directions, multilingual, prefix, prefix_key
from transformer_mt.data.raw_files import raw_file
from transformer_mt.data.testsets import TESTSETS, fetch_testset
from transformer_mt.files import atomic_write_lines, check_output_parent
from transformer_mt.metrics import EvaluateError, format_scores, read_lines, score_files, write_scores
from transformer_mt.run_names import EVAL_PREFIX, SCORES_NAME

if TYPE_CHECKING:
    from transformer_mt.decode.translate import Translator

# -- test sets

CONFIG_SPLITS = ("test", "valid")  # `tmt evaluate test|valid`: the raw files of the checkpoint config's data.test|valid


def config_split(name: str, data: DataConfig, checkpoint: Path, way: Direction) -> tuple[Path, Path]:
    """Source and reference of the config's own split ``name`` (test or valid) in direction ``way``:
    ``<prefix>.<src>`` and ``<prefix>.<tgt>``.

    The raw text `tmt prepare` read, not the binarized split: scored as any
    test set is. The prefix is relative to the directory training ran in.
    """
    at = prefix(data, way, name)
    if not at:
        raise EvaluateError(
            f"{checkpoint}: its config has no {name} split (data.{name} is empty); name a test set "
            f"({', '.join(TESTSETS)}) or pass --src and --ref"
        )
    files = raw_file(at, way.src), raw_file(at, way.tgt)
    for path in files:
        if not path.is_file():
            raise EvaluateError(
                f"{path} not found: the config of {checkpoint} has {prefix_key(data, way, name)}={at!r}, a path relative to the "
                "directory it was trained in; run tmt evaluate from there, or pass --src and --ref"
            )
    return files


def _inputs(
    testset: str | None, src: Path | None, ref: Path | None, data: DataConfig, checkpoint: Path, way: Direction
) -> tuple[Path, Path]:
    if src is not None and ref is not None:
        return src, ref
    if testset is None:
        raise EvaluateError(f"name a test set ({', '.join((*TESTSETS, *CONFIG_SPLITS))}) or pass --src and --ref")
    if testset in CONFIG_SPLITS:
        return config_split(testset, data, checkpoint, way)
    return fetch_testset(testset, way.src, way.tgt)


def evaluate_checkpoint(
    checkpoints: Sequence[str | Path],
    testset: str | None = None,
    src: str | Path | None = None,
    ref: str | Path | None = None,
    output: str | Path | None = None,
    device: str | None = None,
    overrides: Sequence[str] = (),
    engine: str = "pytorch",
    ensemble: bool = False,
    languages: tuple[str | None, str | None] = (None, None),
    pivot: str | None = None,
) -> dict[str, Any]:
    """Translate a test set with `Translator` and score it; writes ``hyp.<lang>`` and ``scores.json`` to ``output``.

    ``testset``: a named test set (sacreBLEU's), or ``test``/``valid``, the
    checkpoint config's own split (`config_split`). ``output`` defaults to
    ``eval_<name>`` beside the first checkpoint (inside it when it is a run directory). With ``--src``/``--ref`` a
    test set name, if given, only labels the results. ``overrides`` are
    ``--set`` texts for the checkpoint's config, the decoding flags included (see
    `transformer_mt.decode.load.override_config`); the n-best size is 1. ``engine`` and
    ``ensemble``: see `transformer_mt.decode.translate.load_translator`.

    A model of several directions scores the one ``languages`` (source,
    target) names, or without a target every direction of its config that
    the test set holds (`scored_directions`), each in ``eval_<name>.<src>-<tgt>``
    (``output``/``<src>-<tgt>``); it returns ``{"directions": {name: scores}}``.
    ``pivot``: the one pair ``languages`` names, translated through that
    language (`Translator.toward`), into ``eval_<name>.<src>-<pivot>-<tgt>``.
    """
    from transformer_mt.decode.translate import load_translator

    _check_request(testset, src, ref, output)
    if pivot is not None and languages[1] is None:
        raise EvaluateError("--pivot scores one pair: name its target with --tgt-lang (and its source, --src-lang)")
    translator = load_translator(checkpoints, engine, ensemble, device, [*overrides, "decode.nbest=1"], None)
    request = Request(checkpoints, testset, _path(src), _path(ref), output, engine, ensemble)
    if not multilingual(translator.cfg.data) or languages[1] is not None:
        toward = translator.toward(*languages, pivot=pivot)
        return _evaluate(toward, request, several=multilingual(translator.cfg.data))
    ways = scored_directions(translator.cfg.data, testset, src is not None, languages[0])
    each = {way.name: _evaluate(translator.toward(way.src, way.tgt), request, several=True) for way in ways}
    if len(each) > 1:
        print(direction_table(each), file=sys.stdout)
    return {"directions": each}


@dataclass(frozen=True)
class Request:
    """What `tmt evaluate` was asked to score, the same for every direction of a model of several."""

    checkpoints: Sequence[str | Path]
    testset: str | None
    src: Path | None
    ref: Path | None
    output: str | Path | None
    engine: str
    ensemble: bool


def _evaluate(translator: Translator, r: Request, several: bool) -> dict[str, Any]:
    """Translate and score ``r`` in the translator's direction; ``several``: one direction of several, whose
    output directory and corpus name carry the direction."""
    from transformer_mt.decode.lines import empty_outputs

    data, way, first = translator.cfg.data, translator.direction, Path(r.checkpoints[0])
    assert way is not None  # `Translator.toward` chose it
    src_path, ref_path = _inputs(r.testset, r.src, r.ref, data, first, way)
    sources = _read_parallel(src_path, ref_path)
    name = r.testset or src_path.stem
    corpus = (
        Path(getattr(data, name)).name if r.src is None and name in CONFIG_SPLITS else name
    )  # `tmt report` reads it
    label = way.name if translator.pivot is None else f"{way.src}-{translator.pivot}-{way.tgt}"
    out_dir = _output_dir(r.output, first, name, label if several else None)
    hyp_path = out_dir / f"hyp.{way.tgt}"
    hyps = translator.translate_lines(sources)
    replaced = _earlier(out_dir)
    atomic_write_lines(hyp_path, hyps)
    empty, warning = empty_outputs(sources, hyps)
    scores = {
        "testset": name,
        "corpus": f"{corpus}.{way.name}" if several else corpus,  # the text scored: for test/valid, the config's file
        "src": str(src_path),
        "checkpoints": [str(decoded_file(Path(c))) for c in r.checkpoints],  # the files decoded, not a run directory
        "engine": r.engine,
        "ensemble": r.ensemble and len(r.checkpoints) > 1,  # several checkpoints decoded together, not averaged
        "decode": _decode_settings(translator.cfg.decode),
        **({"direction": way.name} if several else {}),
        **({"pivot": translator.pivot} if translator.pivot else {}),
        **score_files(hyp_path, ref_path, way.tgt),
        "empty_hypotheses": empty,  # non-empty source lines translated to nothing
    }
    write_scores(out_dir / SCORES_NAME, scores)
    _report(scores, out_dir, warning, replaced)
    return scores


def scored_directions(data: DataConfig, testset: str | None, local: bool, src: str | None) -> list[Direction]:
    """The directions of a model of several that one `tmt evaluate` scores: those of its config (from ``src``
    only, when given); of a named test set, those it holds. Local files (``local``) are one direction: a
    DirectionError asks for --tgt-lang."""
    if local:
        choose(data, src, None, "--src/--ref")
    ways = [w for w in directions(data) if src is None or w.src == src]
    if testset in CONFIG_SPLITS or testset is None:
        return ways or [choose(data, src, None)]
    from sacrebleu.dataset import DATASETS

    held = [w for w in ways if w.name in DATASETS[TESTSETS[testset]].langpairs] if testset in TESTSETS else ways
    if not held:
        raise EvaluateError(
            f"{testset} holds none of this model's directions ({', '.join(w.name for w in ways)}); pass --src "
            "and --ref with --src-lang and --tgt-lang"
        )
    return held


def direction_table(each: dict[str, dict[str, Any]]) -> str:
    """Each direction's sacreBLEU and chrF, and their means: the table `tmt evaluate` ends with."""
    rows = [(name, s["sacrebleu"]["score"], s["chrf"]["score"]) for name, s in each.items()]
    lines = ["direction  sacreBLEU  chrF2"]
    lines += [f"{name:9s}  {bleu:9.2f}  {chrf:5.2f}" for name, bleu, chrf in rows]
    lines.append(f"{'mean':9s}  {sum(r[1] for r in rows) / len(rows):9.2f}  {sum(r[2] for r in rows) / len(rows):5.2f}")
    return "\n".join(lines)


def _check_request(
    testset: str | None, src: str | Path | None, ref: str | Path | None, output: str | Path | None
) -> None:
    """The mistakes in the arguments alone, refused before loading any model (which takes seconds to minutes):
    half of --src/--ref, an output directory that cannot be made, an unknown test set name."""
    if (src is None) != (ref is None):
        raise EvaluateError("pass both --src and --ref (local files), or neither (a named test set)")
    if output is not None:
        check_output_parent(Path(output) / SCORES_NAME)
    if testset is not None and src is None and testset not in CONFIG_SPLITS and testset not in TESTSETS:
        raise EvaluateError(  # before loading any model
            f"unknown test set {testset!r}; known: test and valid (the checkpoint config's own data.test and "
            f"data.valid files), {', '.join(TESTSETS)} (downloaded by sacreBLEU); or pass local files with --src "
            "and --ref"
        )


def _read_parallel(src_path: Path, ref_path: Path) -> list[str]:
    """The source lines, once the reference is read too and has as many: checked before translating, so that a
    mismatched pair fails in a second, not after the whole test set is decoded."""
    sources, refs = read_lines(src_path, "source"), read_lines(ref_path, "reference")
    if len(sources) != len(refs):
        raise EvaluateError(
            f"{src_path} has {len(sources)} lines but {ref_path} has {len(refs)}; they must be parallel"
        )
    return sources


def _output_dir(output: str | Path | None, first: Path, name: str, direction: str | None = None) -> Path:
    """``output``, else ``eval_<name>`` beside the first checkpoint, or inside it when it is a run directory:
    where `tmt report` looks for a run's evaluations. One ``direction`` of several: ``output/<direction>``, or
    ``eval_<name>.<direction>``."""
    if output is not None:
        return Path(output) / direction if direction else Path(output)
    where = first if first.is_dir() else first.parent
    return where / f"{EVAL_PREFIX}{name}{'.' + direction if direction else ''}"


def _decode_settings(d: DecodeConfig) -> dict[str, Any]:
    """The decoding settings that change the hypotheses, saved beside the scores so that two evaluations can be
    told apart."""
    return {"beam_size": d.beam_size, "len_penalty": d.len_penalty, "len_penalty_form": d.len_penalty_form,
            "max_len_a": d.max_len_a, "max_len_b": d.max_len_b, "quantize": d.quantize, "stopping": d.stopping}  # fmt: skip


def _earlier(out_dir: Path) -> str | None:
    """What an earlier evaluation left in ``out_dir`` (the default ``eval_<name>`` is the same for every checkpoint
    of a run), named so that replacing it is said: its checkpoints and sacreBLEU; None when there is none."""
    path = out_dir / SCORES_NAME
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        return f"{', '.join(map(str, old['checkpoints']))}, sacreBLEU {float(old['sacrebleu']['score']):.2f}"
    except (OSError, ValueError, TypeError, KeyError):
        return f"{path}, unreadable"


def _report(scores: dict[str, Any], out_dir: Path, warning: str | None, replaced: str | None) -> None:
    """The scores on stdout (what a script reads); where they are, what they replaced and any empty-output warning
    on stderr."""
    print(format_scores(scores), file=sys.stdout)
    print(f"hypotheses and scores: {out_dir}", file=sys.stderr)
    if replaced:
        print(
            f"replaced the earlier evaluation in {out_dir} (of {replaced}); -o DIR keeps each in its own",
            file=sys.stderr,
        )
    if warning:
        print(warning, file=sys.stderr)


def _path(p: str | Path | None) -> Path | None:
    return None if p is None else Path(p)
