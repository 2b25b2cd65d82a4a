"""`tmt quickstart`: the whole pipeline on the embedded toy corpus, in minutes on a CPU.

synth -> prepare -> train -> average -> translate and score, each stage the
same function its own `tmt` command calls, so the quickstart exercises exactly
what a real run uses. Settings come from the shipped ``tmt:toy.yaml``; only the paths
are moved under the work directory.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import typer

from transformer_mt.config import Config, load_config
from transformer_mt.data.clean import read_lines
from transformer_mt.data.raw_files import raw_file
from transformer_mt.run_names import AVERAGE_NAME, EVAL_PREFIX

TOY_CONFIG = "tmt:toy.yaml"
EXAMPLES = 3


def quickstart_config(workdir: Path, config: str | Path = TOY_CONFIG, overrides: tuple[str, ...] = ()) -> Config:
    """The toy config (shipped with tmt, so no checkout is needed) with every path moved under ``workdir``."""
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
    typer.secho(f"\n[{number}/4] {title}", bold=True, err=True)


def run_quickstart(workdir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """Run every stage and print a short report; returns the scores."""
    from transformer_mt.data.prepare import prepare_data
    from transformer_mt.evaluate import evaluate_checkpoint
    from transformer_mt.train.average import average_checkpoints, last_checkpoints
    from transformer_mt.train.trainer import train_model

    start = time.monotonic()
    cfg = quickstart_config(workdir, overrides=overrides)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(cfg.train.save_dir)

    _stage(1, "generate the toy corpus and prepare it (BPE, binarize)")
    prepare_data(cfg)

    _stage(
        2,
        f"train a {cfg.model.encoder_layers}+{cfg.model.decoder_layers}-layer Transformer (d_model {cfg.model.d_model})",
    )
    train_model(cfg)

    _stage(3, f"average the last {cfg.train.average_last} checkpoints")
    averaged = run_dir / AVERAGE_NAME
    average_checkpoints(last_checkpoints(run_dir, cfg.train.average_last), averaged)

    d = cfg.decode
    _stage(4, f"translate the test set (beam {d.beam_size}, length penalty {d.len_penalty}) and score it")
    src_file = raw_file(cfg.data.test, cfg.data.src_lang)
    ref_file = raw_file(cfg.data.test, cfg.data.tgt_lang)
    eval_dir = run_dir / f"{EVAL_PREFIX}test"
    scores = evaluate_checkpoint(
        [averaged], testset="toy-test", src=src_file, ref=ref_file, output=eval_dir, device="cpu"
    )

    examples = [_head(f, EXAMPLES) for f in (src_file, ref_file, eval_dir / f"hyp.{cfg.data.tgt_lang}")]
    _report(scores, examples, workdir, averaged, eval_dir, time.monotonic() - start)
    return scores


def _head(path: Path, n: int) -> list[str]:
    return list(itertools.islice(read_lines(path), n))


def _report(
    scores: dict, examples: list[list[str]], workdir: Path, averaged: Path, eval_dir: Path, seconds: float
) -> None:
    bleu, paper, chrf = scores["sacrebleu"]["score"], scores["paper_bleu"]["score"], scores["chrf"]["score"]
    lines = [
        "",
        "=" * 72,
        f"quickstart finished in {seconds / 60:.1f} minutes",
        f"toy test set: sacreBLEU {bleu:.1f}, the paper's tokenized BLEU {paper:.1f}, chrF {chrf:.1f}",
        "",
        "examples:",
    ]
    for src, ref, hyp in zip(*examples, strict=True):
        lines += [f"  source     {src}", f"  reference  {ref}", f"  tmt        {hyp}", ""]
    lines += [
        "files:",
        f"  corpus        {workdir / 'corpus'}",
        f"  prepared data {workdir / 'prepared'}",
        f"  run           {averaged.parent}  (checkpoints, metrics.jsonl, config.yaml)",
        f"  averaged      {averaged}",
        f"  test output   {eval_dir}  (hypotheses, scores.json)",
        "",
        "next: translate your own text with",
        f"  echo 'The old man sees the red car.' | tmt translate -c {averaged}",
        "see what the model attends to, the run's curves, and the run beside the paper's tables:",
        f"  tmt attention -c {averaged} --text 'The old man sees the red car.' --kind cross -o attention.png",
        f"  tmt plot {averaged.parent} -o curves.png",
        f"  tmt report {averaged.parent} -o report.md",
    ]
    typer.echo("\n".join(lines))
