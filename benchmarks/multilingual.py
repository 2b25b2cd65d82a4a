"""One model for several directions against one model per direction, and its zero-shot directions.

Runs what a user runs: `tmt train` of configs/multi30k_multilingual.yaml (six
directions en<->de, en<->fr, en<->cs on Multi30k's 4-way parallel data, 120
minutes on 2 cores), `tmt average`, then `tmt translate --src-lang --tgt-lang`
of the valid and test2016 sources of every direction, scored with sacreBLEU
(13a, cased). Beside it:

- **Zero-shot**: every pair of the model's languages that no direction
  trained (de-fr, fr-de, de-cs, cs-de, fr-cs, cs-fr), with the share of
  output lines in the wrong language by a real language identifier
  (py3langid, restricted to the model's languages; ``pip install
  py3langid``), and BLEU beside pivoting through the language most
  directions share (English) with the same model.
- ``--pivot-minutes``: zero-resource instead of zero-shot. For each
  untrained pair X-Y, X's training sentences beside the model's own
  translation of their English side into Y (`tmt distill --src-lang en
  --tgt-lang Y` of the training English, one per target language), no X-Y
  text used; the model then trains on them as directions of their own beside
  its six (`train.init_from`, its vocabulary through `tmt export spm`, peak
  ``--pivot-lr``) for that many minutes, and every direction is scored
  again, the formerly untrained ones with their wrong-language share.
- ``--baselines [DIRECTION ...]``: one model per direction (every direction
  of the config, or those named), configs/multi30k_hour.yaml's one-hour
  recipe with its data.src_lang and data.tgt_lang set, each averaged and
  scored the same way. With ``--no-multilingual`` a call trains the
  baselines alone, so that six CPU hours can be split over several sittings.

Select on the valid columns; test2016 is the figure to report.

    python benchmarks/multilingual.py --seed 1 --out runs/bench_multilingual
    python benchmarks/multilingual.py --seed 1 --out runs/bench_multilingual --baselines
    python benchmarks/multilingual.py --seed 1 --out runs/bench_multilingual --no-multilingual --baselines en-fr
    python benchmarks/multilingual.py --updates 11000 --out ...   # a budget of updates, not of the clock

A run cut short goes on with the same command: `tmt train` resumes each run
from its newest checkpoint, and a finished run is not trained again.
Results: OUT/seedN/multilingual.json (each call adds its parts to what earlier
calls wrote there) and markdown tables on stdout. Run it from the
repository root on an otherwise idle machine (the budget is wall clock).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from transformer_mt.config import load_config
from transformer_mt.data.clean import read_lines
from transformer_mt.data.directions import Direction, directions, languages, prefix, sources, targets
from transformer_mt.data.raw_files import raw_file
from transformer_mt.metrics import corpus_sacrebleu
from transformer_mt.runs import read_run
from transformer_mt.serve.detect import LanguageDetector

MULTI = "configs/multi30k_multilingual.yaml"
BILINGUAL = "configs/multi30k_hour.yaml"


def tmt(*args: str) -> None:
    """Run one tmt command as a user would, its progress on this terminal; stop the benchmark if it fails."""
    done = subprocess.run([sys.executable, "-m", "transformer_mt", *args], check=False)
    if done.returncode != 0:
        sys.exit(f"tmt {' '.join(args)} failed ({done.returncode})")


def sets(*keys: str) -> list[str]:
    """``key=value`` overrides as `tmt train`'s ``--set`` options."""
    return [x for key in keys for x in ("--set", key)]


def budget(args: argparse.Namespace) -> list[str]:
    """The --set overrides of the budget: the config's minutes, --minutes, or --updates alone."""
    if args.updates:
        return sets(f"train.max_updates={args.updates}", f"train.max_minutes={args.minutes or 0}")
    return sets(f"train.max_minutes={args.minutes}") if args.minutes else []


def train_and_average(config: str, run: Path, extra: list[str], args: argparse.Namespace) -> tuple[Path, float]:
    """Train (or resume, or find finished) ``run`` and average its last checkpoints; returns the average and the
    run's training minutes (its own record, resumes included: a call that finds it finished reports them too)."""
    tmt("train", config, *sets(f"train.save_dir={run}", f"train.seed={args.seed}"), *budget(args), *extra)
    tmt("average", str(run))
    return run / "average.pt", read_run(run).minutes or 0.0


def translate(checkpoint: Path, source: Path, out: Path, way: Direction, pivot: str | None = None) -> list[str]:
    """``source`` translated from way.src into way.tgt by ``checkpoint`` (kept in ``out``), through ``pivot``
    when given (`tmt translate --pivot`); its lines."""
    if not out.is_file():
        through = ["--pivot", pivot] if pivot else []
        tmt("translate", "-c", str(checkpoint), "-i", str(source), "-o", str(out), "--src-lang", way.src,
            "--tgt-lang", way.tgt, *through)  # fmt: skip
    return list(read_lines(out))


def bleu(hyps: list[str], prefix: str, lang: str) -> float:
    return round(corpus_sacrebleu(hyps, list(read_lines(raw_file(prefix, lang))))["score"], 2)


def wrong_language(hyps: list[str], expected: str, langs: list[str]) -> float:
    """The share of non-empty lines that py3langid, choosing among ``langs`` (tmt serve's `LanguageDetector`),
    does not find in ``expected``."""
    detector = LanguageDetector(langs)
    lines = [h for h in hyps if h.strip()]
    return round(sum(detector.detect(h)["language"] != expected for h in lines) / max(1, len(lines)), 4)


def score_model(checkpoint: Path, ways: list[Direction], out: Path, cfg: Any) -> dict[str, dict[str, float]]:
    """Valid and test BLEU of each direction of ``ways``."""
    scores = {}
    for way in ways:
        scores[way.name] = {}
        for split in ("valid", "test"):
            at = prefix(cfg.data, way, split)
            hyps = translate(checkpoint, raw_file(at, way.src), out / f"{split}.{way.name}.{way.tgt}", way)
            scores[way.name][split] = bleu(hyps, at, way.tgt)
    return scores


def untrained(cfg: Any) -> tuple[str, list[Direction]]:
    """The pivot (the language most trained directions share: English) and each pair of the model's languages
    that no direction trains and that does not involve the pivot."""
    trained = directions(cfg.data)
    langs = languages(cfg.data)
    pivot = max(langs, key=lambda lang: sum(lang in (w.src, w.tgt) for w in trained))
    ways = [Direction(src, tgt) for src, tgt in itertools.permutations(langs, 2)]
    known = [w for w in ways if w.src in sources(cfg.data) and w.tgt in targets(cfg.data)]
    return pivot, [w for w in known if w not in trained and pivot not in (w.src, w.tgt)]


def zero_shot(checkpoint: Path, cfg: Any, out: Path) -> dict[str, dict[str, float]]:
    """Each untrained pair: valid and test BLEU direct, test BLEU through the pivot, and the direct output's
    wrong-language rate on each (``wrong_language_valid``: what a choice between models reads)."""
    pivot, ways = untrained(cfg)
    langs = languages(cfg.data)
    result = {}
    for way in ways:
        row = result[way.name] = {}
        splits = (("valid", cfg.data.valid, "wrong_language_valid"), ("test", cfg.data.test, "wrong_language"))
        for split, at, wrong in splits:  # multi-way parallel files
            direct = translate(checkpoint, raw_file(at, way.src), out / f"{split}.{way.name}.{way.tgt}", way)
            row[split], row[wrong] = bleu(direct, at, way.tgt), wrong_language(direct, way.tgt, langs)
        test = cfg.data.test
        pivoted = translate(checkpoint, raw_file(test, way.src), out / f"test.{way.src}-{pivot}-{way.tgt}.{way.tgt}",
                            way, pivot)  # fmt: skip
        row["pivot_test"] = bleu(pivoted, test, way.tgt)
    return result


def pivot_corpora(checkpoint: Path, cfg: Any, out: Path) -> tuple[list[str], float]:
    """Training pairs for each untrained pair X-Y without any X-Y text: X's training sentences beside the model's
    translation of their pivot (English) side into Y (`tmt distill`, one per target language, shared by its
    pairs); the ``data.corpora`` entries that train them as directions of their own, and the distillations'
    minutes (summed over the calls that ran them)."""
    pivot, ways = untrained(cfg)
    record = out / "minutes.json"  # each distillation's minutes, kept for the calls that find it done
    minutes = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
    entries = []
    for way in ways:
        into = out / f"{pivot}_{way.tgt}"
        if not raw_file(str(into), way.tgt).is_file():
            start = time.monotonic()
            tmt("distill", "-c", str(checkpoint), "-i", str(raw_file(cfg.data.train, pivot)), "-o", str(into),
                "--src-lang", pivot, "--tgt-lang", way.tgt)  # fmt: skip
            minutes[into.name] = round(minutes.get(into.name, 0) + (time.monotonic() - start) / 60, 1)
            record.write_text(json.dumps(minutes, indent=1) + "\n", encoding="utf-8")
        pairs = out / f"pivot_{way.src}_{way.tgt}"
        for lang, text in ((way.src, raw_file(cfg.data.train, way.src)), (way.tgt, raw_file(str(into), way.tgt))):
            shutil.copyfile(text, raw_file(str(pairs), lang))
        entries.append(f"{{direction: {way.name}, train: {pairs}}}")
    return entries, round(sum(minutes.values()), 1)


def pivot_trained(checkpoint: Path, cfg: Any, out: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The model ``checkpoint`` trained on, beside its own directions, `pivot_corpora` for --pivot-minutes (its
    weights, vocabulary and schedule at peak --pivot-lr): every direction's scores, and the formerly untrained
    pairs' wrong-language rates."""
    run = out / f"pivot{args.pivot_minutes:g}_lr{args.pivot_lr:g}"
    vocabulary = out / "multi.spm.model"
    if not vocabulary.is_file():
        tmt("export", "spm", "-c", str(checkpoint), "-o", str(vocabulary))
    entries, distill = pivot_corpora(checkpoint, cfg, out / "synth")
    corpora = f"data.corpora=[{', '.join(entries)}]"
    keys = [corpora, f"data.dir={out}/prepared_pivot", f"bpe.model={vocabulary}", f"train.init_from={checkpoint}",
            f"train.lr={args.pivot_lr}", f"train.max_minutes={args.pivot_minutes}"]  # fmt: skip
    trained, minutes = train_and_average(args.config, run, [*extra, *sets(*keys)], args)
    tuned = load_config(args.config, [*args.sets, *keys])
    scores = score_model(trained, directions(tuned.data), run, tuned)
    for way in untrained(cfg)[1]:
        hyps = list(read_lines(run / f"test.{way.name}.{way.tgt}"))
        scores[way.name]["wrong_language"] = wrong_language(hyps, way.tgt, languages(cfg.data))
    return {"minutes": {"distill": distill, "train": round(minutes, 1)}, "scores": scores}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| direction | multilingual valid | test2016 | bilingual valid | test2016 | Δ test |",
        "|---|---|---|---|---|---|",
    ]
    multi, bilingual = report.get("multilingual", {}), report.get("bilingual", {})
    for name in [*multi, *(b for b in bilingual if b not in multi)]:
        s, b = multi.get(name), bilingual.get(name)
        row = [s["valid"], s["test"]] if s else ["", ""]
        row += [b["valid"], b["test"]] if b else ["", ""]
        row.append(round(s["test"] - b["test"], 2) if s and b else "")
        lines.append(f"| {name} | " + " | ".join(map(str, row)) + " |")
    if "zero_shot" in report:
        lines += ["", "| zero-shot | valid | wrong language | test2016 | through the pivot | wrong language |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, z in report["zero_shot"].items():
            valid = [z.get("valid", ""), f"{z['wrong_language_valid']:.1%}" if "wrong_language_valid" in z else ""]
            row = [*valid, z["test"], z["pivot_test"], f"{z['wrong_language']:.1%}"]
            lines.append(f"| {name} | " + " | ".join(map(str, row)) + " |")
    if "pivot_trained" in report:
        lines += ["", "| trained on pivot-made pairs too | valid | test2016 | wrong language |", "|---|---|---|---|"]
        for name, t in report["pivot_trained"]["scores"].items():
            wrong = f"{t['wrong_language']:.1%}" if "wrong_language" in t else ""
            lines.append(f"| {name} | {t['valid']} | {t['test']} | {wrong} |")
    return "\n".join(lines)


def chosen(names: list[str], cfg: Any) -> list[Direction]:
    """The config's directions that ``names`` names (all of them for an empty list); exit naming the valid ones
    on an unknown name."""
    ways = directions(cfg.data)
    unknown = [n for n in names if n not in [w.name for w in ways]]
    if unknown:
        sys.exit(f"--baselines: {', '.join(unknown)} is not a direction of the config; choose among "
                 f"{', '.join(w.name for w in ways)}")  # fmt: skip
    return [w for w in ways if not names or w.name in names]


def baselines(ways: list[Direction], out: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """One model per direction of ``ways`` (--bilingual's recipe), each trained, averaged and scored: their
    scores and minutes."""
    scores, minutes = {}, {}
    for way in ways:
        run = out / f"bi_{way.src}_{way.tgt}"
        pair = [
            f"data.src_lang={way.src}",
            f"data.tgt_lang={way.tgt}",
            f"data.dir=prepared/multi30k_{way.src}_{way.tgt}",
        ]
        checkpoint, spent = train_and_average(args.bilingual, run, [*sets(*pair), *extra], args)
        minutes[way.name] = round(spent, 1)
        scores |= score_model(checkpoint, [way], run, load_config(args.bilingual, [*pair, *args.sets]))
    return {"bilingual": scores, "minutes": minutes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_multilingual"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--config", default=MULTI, help="the multilingual config (default: %(default)s)")
    parser.add_argument("--bilingual", default=BILINGUAL, help="the one-direction recipe of --baselines")
    parser.add_argument("--minutes", type=float, default=0.0, help="each training's budget (default: the config's)")
    parser.add_argument("--updates", type=int, default=0, help="a budget of updates instead of the clock")
    parser.add_argument(
        "--baselines",
        nargs="*",
        metavar="DIRECTION",
        help="also train one model per direction: every direction of the config, or those named (e.g. en-fr)",
    )
    parser.add_argument(
        "--no-multilingual", action="store_true", help="skip the multilingual model (with --baselines: those alone)"
    )
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a --set for every training")
    parser.add_argument(
        "--pivot-minutes",
        type=float,
        default=0.0,
        help="then train the model on, beside its directions, pairs for each untrained one made through English "
        "(zero-resource) for this many minutes (0: off)",
    )
    parser.add_argument("--pivot-lr", type=float, default=5e-4, help="that training's peak learning rate")
    args = parser.parse_args()
    extra = sets(*args.sets)
    cfg = load_config(args.config, args.sets)
    out = args.out / f"seed{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    result = out / "multilingual.json"
    report: dict[str, Any] = json.loads(result.read_text(encoding="utf-8")) if result.is_file() else {}
    report |= {"config": args.config, "seed": args.seed}
    report.setdefault("minutes", {})
    if not args.no_multilingual:
        checkpoint, minutes = train_and_average(args.config, out / "multi", extra, args)
        report["minutes"]["multilingual"] = round(minutes, 1)
        report["multilingual"] = score_model(checkpoint, directions(cfg.data), out / "multi", cfg)
        report["zero_shot"] = zero_shot(checkpoint, cfg, out / "multi")
        if args.pivot_minutes:
            report["pivot_trained"] = pivot_trained(checkpoint, cfg, out / "multi", args, extra)
    if args.baselines is not None:
        done = baselines(chosen(args.baselines, cfg), out, args, extra)
        report["minutes"] |= done["minutes"]
        report["bilingual"] = report.get("bilingual", {}) | done["bilingual"]
    result.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(markdown(report))


if __name__ == "__main__":
    main()
