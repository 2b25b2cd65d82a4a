"""`tmt quickstart`: the whole pipeline on the embedded toy corpus, in minutes on a CPU.

synth -> prepare -> train -> average -> translate -> evaluate, each stage the
same function its own `tmt` command calls, so the quickstart exercises exactly
what a real run uses. Settings come from ``configs/toy.yaml``; only the paths
are moved under the work directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from transformer_mt.config import Config, load_config

TOY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "toy.yaml"
EXAMPLES = 3


def quickstart_config(workdir: Path, config: Path = TOY_CONFIG, overrides: tuple[str, ...] = ()) -> Config:
    """The toy config with every path moved under ``workdir``."""
    if not config.is_file():
        raise typer.BadParameter(
            f"{config} not found: run `tmt quickstart` from a source checkout installed with `pip install -e .`"
        )
    corpus, w = workdir / "corpus", workdir
    paths = [
        f"data.train={corpus / 'train'}",
        f"data.valid={corpus / 'valid'}",
        f"data.test={corpus / 'test'}",
        f"data.dir={w / 'prepared'}",
        f"train.save_dir={w / 'run'}",
    ]
    return load_config(config, [*paths, *overrides])


def _stage(number: int, title: str) -> None:
    typer.secho(f"\n[{number}/5] {title}", bold=True, err=True)


def run_quickstart(workdir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """Run every stage and print a short report; returns the scores."""
    from transformer_mt.data.prepare import prepare_data
    from transformer_mt.decode.translate import Translator
    from transformer_mt.evaluate import format_scores, score_files
    from transformer_mt.train.average import average_checkpoints, last_checkpoints
    from transformer_mt.train.trainer import train_model

    start = time.monotonic()
    cfg = quickstart_config(workdir, overrides=overrides)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(cfg.train.save_dir)

    _stage(1, "generate the toy corpus and prepare it (BPE, binarize)")
    prepare_data(cfg)

    _stage(2, f"train a {cfg.model.encoder_layers}+{cfg.model.decoder_layers}-layer Transformer (d_model {cfg.model.d_model})")
    train_model(cfg)

    _stage(3, f"average the last {cfg.train.average_last} checkpoints")
    averaged = run_dir / "average.pt"
    average_checkpoints(last_checkpoints(run_dir, cfg.train.average_last), averaged)

    _stage(4, f"translate the test set (beam {cfg.decode.beam_size}, length penalty {cfg.decode.len_penalty})")
    src_file = Path(f"{cfg.data.test}.{cfg.data.src_lang}")
    ref_file = Path(f"{cfg.data.test}.{cfg.data.tgt_lang}")
    hyp_file = run_dir / f"test.hyp.{cfg.data.tgt_lang}"
    sources = src_file.read_text(encoding="utf-8").splitlines()
    translator = Translator.from_checkpoints([averaged], device="cpu")
    hypotheses = translator.translate_lines(sources)
    hyp_file.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")

    _stage(5, "score: sacreBLEU and the paper's tokenized BLEU")
    scores = score_files(hyp_file, ref_file)
    (run_dir / "test.scores.json").write_text(json.dumps(scores, indent=2), encoding="utf-8")

    references = ref_file.read_text(encoding="utf-8").splitlines()
    _report(scores, format_scores(scores), sources, references, hypotheses, workdir, averaged, time.monotonic() - start)
    return scores


def _report(scores, formatted, sources, references, hypotheses, workdir, averaged, seconds) -> None:
    lines = ["", "=" * 72, f"quickstart finished in {seconds / 60:.1f} minutes", "", formatted, "", "examples:"]
    for src, ref, hyp in list(zip(sources, references, hypotheses))[:EXAMPLES]:
        lines += [f"  source     {src}", f"  reference  {ref}", f"  tmt        {hyp}", ""]
    lines += [
        "files:",
        f"  corpus        {workdir / 'corpus'}",
        f"  prepared data {workdir / 'prepared'}",
        f"  run           {averaged.parent}  (checkpoints, metrics.jsonl, config.yaml)",
        f"  averaged      {averaged}",
        "",
        "next: translate your own text with",
        f"  echo 'the old man sees the red car .' | tmt translate -c {averaged}",
    ]
    typer.echo("\n".join(lines))
