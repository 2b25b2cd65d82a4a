"""More data from a model: back-translated captions for Multi30k en->de, and a distilled int8 student.

Runs the README's commands ("More data from your model"), each stage once:

1. **reverse**: `tmt train configs/multi30k_hour.yaml` with de -> en, for
   ``--reverse-minutes``, then `tmt average`;
2. **backtranslate**: `tmt backtranslate` of Multi30k's German task-2
   captions (shared/data/multi30k_captions, 145k lines, exact repeats
   dropped) with the reverse model (``--bt-sample topk:10``, Edunov et al.
   2018, or ``--bt-beam``);
3. **final**: `tmt train configs/multi30k_hour.yaml` on the real pairs and
   the back-translated corpus (``--variant tagged``: `synthetic: true, tag:
   true`; ``untagged``; ``real``: no synthetic corpus, the ablation's
   baseline; ``--bt-weight``, its ``data.corpora`` weight: 0.2, chosen on
   valid over 1) for ``--final-minutes``, then `tmt average`. The first
   choices (sampled back-translation, weight 1) run as ``backtranslate`` and
   ``final_<variant>``; each other choice is named in its stage, run and
   corpus (``backtranslate_beam4``, ``final_tagged_w0.2``,
   ``final_tagged_beam4_w0.2``), so that it trains a run of its own;
   ``--final-set`` keys (a larger model: ``model.d_model=256``) go to the
   final model and its fine-tuning alone and are named the same way
   (``final_tagged_w0.2_d_model256``), where ``--set`` goes to every
   training, unnamed;
   **finetune** (``--finetune-minutes``, 10 by default, chosen on valid;
   0 for none): the final model trained on the real pairs alone from its
   weights (`train.init_from`, its vocabulary through `tmt export spm`,
   peak ``--finetune-lr``), as a run of its own
   (``final_tagged_w0.2_ft10_lr0.0005``) that the scores, the teacher and
   the pipeline's minutes then take for the final model;
4. **distill** and **student**: `tmt distill` of the training sources with
   the final model as teacher, `tmt train configs/multi30k_student.yaml`
   on them for ``--student-minutes``, `tmt average`; decoded with int8.
   ``--student-data`` puts a second corpus beside the distilled pairs (one
   of them an untagged synthetic `data.corpora` entry): ``kd+captions`` the
   teacher's translations of the English task-2 captions (stage
   **distill_captions**, 145k lines: five times the distilled pairs, as the
   Bergamot students distil monolingual source text too), ``kd+real`` the
   real pairs. Each choice trains its own student (``student``,
   ``student_kd_captions``, ``student_kd_real``); a final model other than
   ``final_tagged`` ends the names of its distilled corpora, stages and
   students with its own (``student_tagged_w0.2``).

Scores: sacreBLEU (13a, cased) of valid and test2016 from each averaged
model. Speed: test2016 translated in this process by the teacher (fp32 and
int8) and the int8 student, interleaved rounds, the best of each; beam 4.
Results: OUT/seedN/result.json (``test2016``, ``valid``, ``minutes`` per stage
and ``total``, ``student_test2016``, ``student_speedup``: student int8 over
teacher fp32 sentences per second) and a markdown table on stdout.

    python benchmarks/more_data.py --seed 1 --out runs/more_data
    python benchmarks/more_data.py --seed 1 --out runs/more_data --variant untagged   # the ablation, same budget

A run cut short goes on with the same command: training resumes from its
newest checkpoint, back-translation and distillation at the window they
reached, and a finished stage is not run again. Run it from the repository
root on an otherwise idle machine (the budgets are wall clock).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from transformer_mt.data.clean import read_lines
from transformer_mt.decode.translate import Translator
from transformer_mt.files import atomic_write_lines
from transformer_mt.metrics import corpus_sacrebleu

DATA = Path("../shared/data/multi30k")
CAPTIONS = Path("../shared/data/multi30k_captions")
RECIPE, STUDENT = "configs/multi30k_hour.yaml", "configs/multi30k_student.yaml"


def tmt(*args: str) -> None:
    """Run one tmt command as a user would, its progress on this terminal; stop the benchmark if it fails."""
    done = subprocess.run([sys.executable, "-m", "transformer_mt", *args], check=False)
    if done.returncode != 0:
        sys.exit(f"tmt {' '.join(args)} failed ({done.returncode})")


def sets(*pairs: str) -> list[str]:
    return [x for pair in pairs for x in ("--set", pair)]


class Stages:
    """The pipeline's stages over one output directory, each timed (minutes of this call) and skipped once done."""

    def __init__(self, out: Path, seed: int, captions: int, extra: list[str]) -> None:
        self.out, self.seed, self.captions_lines, self.extra = out, seed, captions, extra
        self.record = out / "minutes.json"  # summed over the calls that ran each stage: a resumed run counts whole
        self.minutes = json.loads(self.record.read_text(encoding="utf-8")) if self.record.is_file() else {}

    def timed(self, name: str, run: Any) -> Any:
        start = time.monotonic()
        try:
            return run()
        finally:
            self.minutes[name] = round(self.minutes.get(name, 0) + (time.monotonic() - start) / 60, 1)
            self.out.mkdir(parents=True, exist_ok=True)
            self.record.write_text(json.dumps(self.minutes, indent=1) + "\n", encoding="utf-8")

    def train(self, name: str, config: str, minutes: float, *keys: str) -> Path:
        """``tmt train`` (or resume) into OUT/name, then `tmt average`; the averaged checkpoint."""
        run = self.out / name
        if not (run / "average.pt").is_file():
            keys = (f"train.save_dir={run}", f"train.seed={self.seed}", f"train.max_minutes={minutes}", *keys,
                    *self.extra)  # fmt: skip
            self.timed(name, lambda: tmt("train", config, *sets(*keys)))
            tmt("average", str(run))
        return run / "average.pt"

    def captions(self, lang: str = "de") -> Path:
        """The ``lang`` captions, files 1 to 5 in order, each sentence once (the corpus repeats some verbatim)."""
        path = self.out / f"captions.{lang}"
        if not path.is_file():
            lines = [line for i in range(1, 6) for line in read_lines(CAPTIONS / f"train.{i}.{lang}")]
            kept = list(dict.fromkeys(line for line in lines if line.strip()))
            atomic_write_lines(path, kept[: self.captions_lines or None])
        return path

    def corpus(self, command: str, checkpoint: Path, text: Path, prefix: Path, *flags: str, stage: str = "") -> Path:
        """``tmt backtranslate`` / ``tmt distill`` into ``prefix`` (resumed at its window), timed as ``stage``
        (default: the command); the prefix."""
        if not Path(f"{prefix}.en").is_file() or not Path(f"{prefix}.de").is_file():
            run = [command, "-c", str(checkpoint), "-i", str(text), "-o", str(prefix), *flags]
            self.timed(stage or command, lambda: tmt(*run))
        return prefix


def bleu(checkpoint: Path, split: str, out: Path, quantize: str = "") -> float:
    """sacreBLEU of ``split`` (valid, test) translated by ``checkpoint`` (kept in ``out``)."""
    hyp = out / f"{split}{'.' + quantize if quantize else ''}.de"
    if not hyp.is_file():
        tmt("translate", "-c", str(checkpoint), "-i", str(DATA / f"{split}.en"), "-o", str(hyp),
            *(["--quantize", quantize] if quantize else []))  # fmt: skip
    return round(corpus_sacrebleu(list(read_lines(hyp)), list(read_lines(DATA / f"{split}.de")))["score"], 2)


def speeds(models: dict[str, tuple[Path, str]], rounds: int = 3) -> dict[str, float]:
    """Sentences per second on test2016 of each (checkpoint, quantize), loading excluded; rounds interleaved, the
    best round of each, so that what else the machine does weighs on all alike."""
    lines = list(read_lines(DATA / "test.en"))
    loaded = {}
    for name, (checkpoint, quantize) in models.items():
        loaded[name] = Translator.from_checkpoints([checkpoint], "cpu", [f"decode.quantize={quantize or 'none'}"])
        loaded[name].show_progress = False
    best = dict.fromkeys(models, 0.0)
    for _ in range(rounds):
        for name, translator in loaded.items():
            start = time.perf_counter()
            translator.translate_lines(lines)
            best[name] = max(best[name], round(len(lines) / (time.perf_counter() - start), 1))
    return best


def scores(checkpoint: Path) -> dict[str, float]:
    """``valid`` and ``test2016`` sacreBLEU of ``checkpoint``, its translations kept beside it."""
    return {
        "valid": bleu(checkpoint, "valid", checkpoint.parent),
        "test2016": bleu(checkpoint, "test", checkpoint.parent),
    }


def int8_megabytes(checkpoint: Path) -> float:
    """The size of the model as it ships for CPU decoding: `tmt export ctranslate2 --quantization int8`'s directory
    (its int8 weights, vocabulary and sentencepiece model)."""
    exported = checkpoint.parent / "ct2_int8"
    if not exported.is_dir():
        tmt("export", "ctranslate2", "-c", str(checkpoint), "-o", str(exported), "--quantization", "int8")
    return round(sum(p.stat().st_size for p in exported.rglob("*") if p.is_file()) / 2**20, 1)


def bt_name(sample: str, beam: int) -> str:
    """The back-translation's stage and corpus name: ``backtranslate`` for the first choice (``--bt-sample
    topk:10``), else one that names the search, so that each choice keeps a corpus of its own."""
    if sample == "topk:10":
        return "backtranslate"
    return f"backtranslate_{sample.replace(':', '')}" if sample else f"backtranslate_beam{beam}"


def final_name(variant: str, bt: str, weight: float, *keys: str) -> str:
    """The final model's run and prepared directory: ``final_<variant>`` for the first choices (sampled
    back-translation, weight 1), with the other choices appended, so that each trains a run of its own:
    ``--final-set`` keys by their last part and value (``model.d_model=256``: ``d_model256``)."""
    named = [re.sub(r"[^\w.-]", "", key.split("=")[0].split(".")[-1] + key.partition("=")[2]) for key in keys]
    synthetic = [] if variant == "real" else [
        *([bt.removeprefix("backtranslate_")] if bt != "backtranslate" else []),
        *([f"w{weight:g}"] if weight != 1.0 else []),
    ]  # fmt: skip
    return "_".join(["final", variant, *synthetic, *named])


def final_keys(out: Path, name: str, variant: str, bt: Path | None, weight: float) -> list[str]:
    """The final model's data keys: its own prepared directory (in ``out``: its corpus is this seed's), and the
    synthetic corpus of ``variant``."""
    keys = [f"data.dir={out}/prepared_{name.removeprefix('final_')}"]
    if variant != "real":
        keys.append(synthetic_corpus(bt, variant == "tagged", weight))
    return keys


def finetune(stages: Stages, out: Path, final: Path, minutes: float, lr: float, *model: str) -> tuple[str, Path]:
    """The final model ``final`` fine-tuned on the real pairs alone for ``minutes`` at peak ``lr``, as users do:
    `tmt export spm` of its vocabulary, `tmt train` from its weights (``model``: its ``--final-set`` keys, which
    the weights need); the run's name and averaged checkpoint."""
    name = f"{final.parent.name}_ft{minutes:g}_lr{lr:g}"
    vocabulary = out / f"{name}.spm.model"
    if not vocabulary.is_file():
        tmt("export", "spm", "-c", str(final), "-o", str(vocabulary))
    keys = (f"data.dir={out}/prepared_{name.removeprefix('final_')}", f"bpe.model={vocabulary}",
            f"train.init_from={final}", f"train.lr={lr}", *model)  # fmt: skip
    return name, stages.train(name, RECIPE, minutes, *keys)


def synthetic_corpus(train: Path | None, tag: bool, weight: float = 1.0) -> str:
    """The ``data.corpora`` key of one en-de synthetic corpus beside the training set."""
    return f"data.corpora=[{{direction: en-de, train: {train}, synthetic: true, tag: {str(tag).lower()}, weight: {weight}}}]"


def student_data(data: str) -> str:
    """``--student-data`` as a file name: ``kd``, ``kd_captions``, ``kd_real`` (its prepared directory's suffix)."""
    return data.replace("+", "_")


def student_name(data: str, teacher: str = "") -> str:
    """The name of ``--student-data``'s run: kd (the first choice) keeps ``student``; ``teacher`` (`teacher_suffix`)
    ends it."""
    return ("student" if data == "kd" else f"student_{student_data(data)}") + teacher


def teacher_suffix(final: str) -> str:
    """What ends the names of the distilled corpora and students of the final model ``final``: nothing for the
    first one (``final_tagged``), else its choices (``_tagged_w0.2``), so that no teacher reuses another's."""
    return "" if final == "final_tagged" else "_" + final.removeprefix("final_")


def student_keys(out: Path, data: str, kd: Path, captions: Path | None, teacher: str = "") -> list[str]:
    """The student's data keys for ``--student-data``: its own prepared directory, and the distilled pairs as its
    training set (beside them the distilled captions as an untagged synthetic corpus), or as such a corpus beside
    the real pairs (kd+real)."""
    keys = [f"data.dir={out}/prepared_{student_data(data)}{teacher}"]
    if data != "kd+real":
        keys.append(f"data.train={kd}")
    beside = {"kd+real": kd, "kd+captions": captions}.get(data)
    if beside is not None:
        keys.append(synthetic_corpus(beside, tag=False))
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/more_data"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variant", choices=["tagged", "untagged", "real"], default="tagged")
    parser.add_argument("--reverse-minutes", type=float, default=25)
    parser.add_argument("--final-minutes", type=float, default=100)
    parser.add_argument("--student-minutes", type=float, default=60)
    parser.add_argument("--bt-sample", default="topk:10", help="sampled back-translation ('' for beam search)")
    parser.add_argument("--bt-beam", type=int, default=4, help="the beam without --bt-sample")
    parser.add_argument(
        "--bt-weight",
        type=float,
        default=0.2,
        help="the synthetic corpus's data.corpora weight (0.2, chosen on valid: half of a Multi30k epoch)",
    )
    parser.add_argument(
        "--finetune-minutes",
        type=float,
        default=None,
        help="then fine-tune the final model on the real pairs (default 10, 0: off; none for --variant real)",
    )
    parser.add_argument("--finetune-lr", type=float, default=5e-4, help="the fine-tuning's peak learning rate")
    parser.add_argument("--no-student", action="store_true", help="stop after the final model")
    parser.add_argument(
        "--student-data",
        choices=["kd", "kd+captions", "kd+real"],
        default="kd",
        help="the distilled pairs alone, or beside the distilled English captions or the real pairs",
    )
    parser.add_argument(
        "--captions-lines", type=int, default=0, help="back-translate (and distil) only the first N captions (0: all)"
    )
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a --set for every training")
    parser.add_argument(
        "--final-set",
        dest="final_sets",
        action="append",
        default=[],
        help="a --set for the final model and its fine-tuning only, named in their runs (model.d_model=256: "
        "final_tagged_w0.2_d_model256)",
    )
    args = parser.parse_args()
    if args.finetune_minutes and args.variant == "real":
        parser.error("--finetune-minutes fine-tunes on the real pairs, which --variant real trains on already")
    if args.finetune_minutes is None:
        args.finetune_minutes = 0 if args.variant == "real" else 10
    out = args.out / f"seed{args.seed}"
    stages = Stages(out, args.seed, args.captions_lines, args.sets)
    bt, bt_stage = None, bt_name(args.bt_sample, args.bt_beam)
    final_stage = final_name(args.variant, bt_stage, args.bt_weight, *args.final_sets)
    pipeline = [final_stage] if args.variant == "real" else ["reverse", bt_stage, final_stage]  # what it cost
    if args.variant != "real":
        reverse = stages.train("reverse", RECIPE, args.reverse_minutes, "data.src_lang=de", "data.tgt_lang=en",
                               "data.dir=prepared/multi30k_de_en")  # fmt: skip
        how = (
            ["--sample", args.bt_sample, "--seed", str(args.seed)] if args.bt_sample else ["--beam", str(args.bt_beam)]
        )
        bt = stages.corpus("backtranslate", reverse, stages.captions(), out / "synth" / bt_stage.replace(
            "backtranslate", "bt"), *how, stage=bt_stage)  # fmt: skip
    keys = final_keys(out, final_stage, args.variant, bt, args.bt_weight)
    final = stages.train(final_stage, RECIPE, args.final_minutes, *keys, *args.final_sets)
    result: dict[str, Any] = {"variant": args.variant, "seed": args.seed}
    if args.finetune_minutes:
        result["before_finetune"] = scores(final)
        final_stage, final = finetune(stages, out, final, args.finetune_minutes, args.finetune_lr, *args.final_sets)
        pipeline.append(final_stage)
    result |= {"final": final_stage, **scores(final)}
    if not args.no_student:
        teacher = teacher_suffix(final_stage)
        kd = stages.corpus(
            "distill", final, DATA / "train.en", out / "synth" / f"kd{teacher}", stage=f"distill{teacher}"
        )
        captions = None
        if args.student_data == "kd+captions":
            captions = stages.corpus("distill", final, stages.captions("en"), out / "synth" / f"kd_captions{teacher}",
                                     stage=f"distill_captions{teacher}")  # fmt: skip
        keys = student_keys(out, args.student_data, kd, captions, teacher)
        student = stages.train(student_name(args.student_data, teacher), STUDENT, args.student_minutes, *keys)
        result["student_data"] = args.student_data
        result["student_valid"] = bleu(student, "valid", student.parent, "int8")
        result["student_test2016"] = bleu(student, "test", student.parent, "int8")
        found = speeds({"teacher": (final, ""), "teacher_int8": (final, "int8"), "student_int8": (student, "int8")})
        result["sentences_per_s"] = found
        result["student_speedup"] = round(found["student_int8"] / found["teacher"], 2)
        result["student_int8_mb"] = int8_megabytes(student)
    pipeline = [stage for stage in pipeline if stage in stages.minutes]
    result["minutes"] = {**stages.minutes, "total": round(sum(stages.minutes[s] for s in pipeline), 1)}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(
        "| "
        + " | ".join(result)
        + " |\n|"
        + "---|" * len(result)
        + "\n| "
        + " | ".join(map(str, result.values()))
        + " |"
    )


if __name__ == "__main__":
    main()
