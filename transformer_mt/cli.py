"""The `tmt` command line: one thin command per pipeline stage.

Each command parses its arguments, loads the config and calls one function of
the stage's module. Stage modules are imported inside the commands so that
`tmt --help` answers at once and a broken optional dependency of one stage
never stops another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from transformer_mt.config import Config, ConfigError, load_config

app = typer.Typer(
    name="tmt",
    help=(
        "Train and evaluate the Transformer of 'Attention Is All You Need' as the paper did.\n\n"
        "The pipeline, one command per stage:\n\n"
        "  tmt quickstart                     the whole pipeline on the embedded toy corpus\n\n"
        "  tmt download wmt14 --pair en-de    fetch WMT14 parallel text\n\n"
        "  tmt prepare configs/base.yaml      clean, learn BPE, binarize\n\n"
        "  tmt train configs/base.yaml        train (resumes automatically)\n\n"
        "  tmt average runs/X --last 5        average the last checkpoints\n\n"
        "  tmt translate -c avg.pt < in.txt   beam search, line by line\n\n"
        "  tmt evaluate newstest2014 -c avg.pt  sacreBLEU and the paper's BLEU"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigArg = Annotated[
    Path, typer.Argument(help="YAML config, e.g. configs/base.yaml (see configs/).", show_default=False)
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.max_updates=2000 (repeatable)."),
]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a user-facing error and return the Exit to raise."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def load(config: Path, overrides: list[str] | None, show: bool = True) -> Config:
    """Load and print the resolved config, turning config mistakes into clear exits."""
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as err:
        raise fail(str(err)) from None
    if show:
        typer.echo(f"# resolved config ({config}{' + --set' if overrides else ''})", err=True)
        typer.echo(cfg.to_yaml(), err=True)
    return cfg


@app.command()
def synth(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for train/valid/test files.")] = Path(
        "toy/corpus"
    ),
    pairs: Annotated[int, typer.Option(help="Training sentence pairs.")] = 50_000,
    valid: Annotated[int, typer.Option(help="Validation sentence pairs.")] = 1000,
    test: Annotated[int, typer.Option(help="Test sentence pairs.")] = 1000,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same corpus.")] = 1,
) -> None:
    """Generate the embedded toy English -> German-like corpus.

    A small grammar with gendered articles that agree in case, capitalized and
    compound nouns, numbers and verb-final subordinate clauses: a model has to
    learn reordering and agreement, not word-by-word substitution. Writes
    OUT/{train,valid,test}.{en,de}.
    """
    from transformer_mt.data.synthetic import write_corpus

    counts = write_corpus(out, pairs=pairs, valid=valid, test=test, seed=seed)
    for split, n in counts.items():
        typer.echo(f"{out}/{split}.en|de: {n} pairs")


@app.command()
def prepare(
    config: ConfigArg,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Redo every step even if the outputs are up to date.")] = False,
) -> None:
    """Clean the parallel text, learn the joint BPE vocabulary and binarize every split.

    Reads data.train/valid/test (+ .src_lang/.tgt_lang), writes data.dir.
    Re-running with unchanged inputs and config does nothing.
    """
    from transformer_mt.data.prepare import PrepareError, prepare_data

    cfg = load(config, set_)
    try:
        prepare_data(cfg, force=force)
    except PrepareError as err:
        raise fail(str(err)) from None


@app.command("data-stats")
def data_stats(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print sentence and token counts, length percentiles and padding at train.max_tokens."""
    from transformer_mt.data.prepare import PrepareError
    from transformer_mt.data.stats import format_stats

    cfg = load(config, set_, show=False)
    try:
        typer.echo(format_stats(cfg))
    except PrepareError as err:
        raise fail(str(err)) from None


@app.command()
def train(
    config: ConfigArg,
    set_: SetOpt = None,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", help="Launch this many processes with torchrun (DDP) on this host.")
    ] = 0,
) -> None:
    """Train the model; resumes from the newest checkpoint in train.save_dir.

    Prepares the data first when data.dir holds nothing up to date. For several
    GPUs: `tmt train CONFIG --nproc-per-node 8`, or run torchrun yourself:
    `torchrun --nproc-per-node 8 -m transformer_mt train CONFIG`.
    """
    from transformer_mt.train.distributed import launch_torchrun
    from transformer_mt.train.trainer import TrainError, train_model

    if nproc_per_node > 0:
        raise typer.Exit(launch_torchrun(nproc_per_node, ["train", str(config), *_set_args(set_)]))
    cfg = load(config, set_)
    try:
        train_model(cfg)
    except (TrainError, ConfigError) as err:
        raise fail(str(err)) from None


def _set_args(overrides: list[str] | None) -> list[str]:
    return [arg for o in overrides or [] for arg in ("--set", o)]


@app.command()
def average(
    run_dir: Annotated[Path | None, typer.Argument(help="Run directory holding checkpoints.")] = None,
    last: Annotated[int, typer.Option("--last", help="Average the newest K checkpoints (by update).")] = 5,
    inputs: Annotated[
        list[Path] | None, typer.Option("--inputs", "-i", help="Average exactly these checkpoint files instead.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file (default RUN_DIR/average.pt).")
    ] = None,
) -> None:
    """Average the parameters of several checkpoints (the paper: base last 5, big last 20)."""
    from transformer_mt.train.average import AverageError, average_checkpoints, last_checkpoints

    try:
        if inputs:
            paths = list(inputs)
        elif run_dir is not None:
            paths = last_checkpoints(run_dir, last)
        else:
            raise fail("give a RUN_DIR (with --last K) or --inputs a.pt b.pt ...")
        out = output or (run_dir / "average.pt" if run_dir else Path("average.pt"))
        average_checkpoints(paths, out)
    except AverageError as err:
        raise fail(str(err)) from None
    typer.echo(f"averaged {len(paths)} checkpoints -> {out}")


@app.command()
def translate(
    checkpoint: Annotated[
        list[Path], typer.Option("--checkpoint", "-c", help="Checkpoint; several are averaged on the fly.")
    ],
    input: Annotated[
        Path | None, typer.Option("--input", "-i", help="Raw text, one sentence per line (default stdin).")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Where translations go (default stdout).")
    ] = None,
    beam: Annotated[int | None, typer.Option("--beam", "-b", help="Beam size (paper: 4); 1 is greedy.")] = None,
    lenpen: Annotated[float | None, typer.Option("--lenpen", help="Length penalty alpha (paper: 0.6).")] = None,
    nbest: Annotated[
        int | None, typer.Option("--nbest", help="Write the K best hypotheses per line, with scores.")
    ] = None,
    batch_tokens: Annotated[int | None, typer.Option("--batch-tokens", help="Source tokens per batch.")] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available).")
    ] = None,
) -> None:
    """Translate raw text line by line with beam search.

    BPE and normalization happen inside, using the BPE model stored in the
    checkpoint. The output has exactly one line per input line, in input order;
    an empty input line gives an empty output line.
    """
    from transformer_mt.decode.translate import TranslateError, translate_file

    try:
        translate_file(
            checkpoint, input, output, beam=beam, lenpen=lenpen, nbest=nbest, batch_tokens=batch_tokens, device=device
        )
    except TranslateError as err:
        raise fail(str(err)) from None


@app.command()
def evaluate(
    testset: Annotated[
        str | None, typer.Argument(help="newstest2013, newstest2014, ... (fetched via sacreBLEU).")
    ] = None,
    checkpoint: Annotated[
        list[Path], typer.Option("--checkpoint", "-c", help="Checkpoint(s) to translate with.")
    ] = ...,  # type: ignore[assignment]
    src: Annotated[Path | None, typer.Option("--src", help="Local source file instead of a named test set.")] = None,
    ref: Annotated[Path | None, typer.Option("--ref", help="Local reference file instead of a named test set.")] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Directory for hypotheses and scores.json.")
    ] = None,
    beam: Annotated[int | None, typer.Option("--beam", "-b", help="Beam size (paper: 4).")] = None,
    lenpen: Annotated[float | None, typer.Option("--lenpen", help="Length penalty alpha (paper: 0.6).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, ... (default: cuda if available).")] = None,
) -> None:
    """Translate a test set and score it: sacreBLEU (13a, cased) with signature, chrF, and the paper's tokenized compound-split BLEU."""
    from transformer_mt.evaluate import EvaluateError, evaluate_checkpoint

    try:
        evaluate_checkpoint(
            checkpoint, testset=testset, src=src, ref=ref, output=output, beam=beam, lenpen=lenpen, device=device
        )
    except EvaluateError as err:
        raise fail(str(err)) from None


@app.command()
def score(
    hyp: Annotated[Path, typer.Option("--hyp", help="Detokenized hypotheses, one per line.")],
    ref: Annotated[Path, typer.Option("--ref", help="Raw references, one per line.")],
) -> None:
    """Score existing output: sacreBLEU with signature, chrF, and the paper's tokenized compound-split BLEU."""
    from transformer_mt.evaluate import EvaluateError, format_scores, score_files

    try:
        typer.echo(format_scores(score_files(hyp, ref)))
    except EvaluateError as err:
        raise fail(str(err)) from None


@app.command()
def download(
    dataset: Annotated[str, typer.Argument(help="Only 'wmt14' for now.")],
    pair: Annotated[str, typer.Option("--pair", help="en-de or en-fr.")] = "en-de",
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for train.*, newstest2013.*, newstest2014.*.")
    ] = Path("data/wmt14_en_de"),
    source: Annotated[
        str, typer.Option("--source", help="hf (Hugging Face datasets, default) or statmt (WMT archives).")
    ] = "hf",
    from_dir: Annotated[
        Path | None, typer.Option("--from", help="Use parallel files already on disk instead of the network.")
    ] = None,
) -> None:
    """Fetch WMT14 parallel text as plain files (train, newstest2013 dev, newstest2014 test)."""
    from transformer_mt.data.download import DownloadError, download_wmt14

    if dataset != "wmt14":
        raise fail(f"unknown dataset {dataset!r}; known: wmt14")
    try:
        download_wmt14(pair=pair, out=out, source=source, from_dir=from_dir)
    except DownloadError as err:
        raise fail(str(err)) from None


@app.command()
def quickstart(
    workdir: Annotated[Path, typer.Option("--workdir", "-w", help="Where every file of the run goes.")] = Path(
        "quickstart"
    ),
) -> None:
    """Run the whole pipeline on the embedded toy corpus in a few minutes on a CPU.

    synth -> prepare -> train -> average -> translate -> evaluate, ending with a
    report: BLEU both ways, example translations and where the files are.
    """
    from transformer_mt.quickstart import run_quickstart

    run_quickstart(workdir)


if __name__ == "__main__":
    app()
