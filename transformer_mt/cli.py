"""The `tmt` command line: one thin command per pipeline stage.

Each command parses its arguments, loads the config and calls one function of
the stage's module. Stage modules are imported inside the commands so that
`tmt --help` answers at once and a broken optional dependency of one stage
never stops another.
"""

from __future__ import annotations

import signal
import sys
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from transformer_mt.config import Config, load_config
from transformer_mt.cpus import prepare_openmp
from transformer_mt.errors import (
    SIGNAL_EXITS,
    Interrupted,
    Terminated,
    UserError,
    stopped_by,
)
from transformer_mt.files import DISK_FULL, no_room_message
from transformer_mt.malloc import keep_freed_memory
from transformer_mt.run_names import AVERAGE_NAME, SCORES_NAME

EMPTY_TRANSLATION = "(empty: the model ends the sentence at once; --target draws a translation of your own)"


class Commands(TyperGroup):
    """The one place a `UserError` of any command ends: ``error: <message>`` on one line of stderr, exit 2.

    Stages raise their mistakes as they find them, deep in a run (a full
    disk at a checkpoint, a bad line in the input); catching them here, once,
    spares each command its own wrapping and keeps every other exception, a
    bug, with its traceback.
    """

    def main(self, *args: object, **kwargs: object) -> object:
        """A signal noted but not told is told here, and the exit status set to it.

        Under `transformer_mt.__main__.main`, the signals raise where they land
        (`errors.stop_on_signals`), and Python's KeyboardInterrupt can land in a
        finalizer and be swallowed, so that the command finishes: its output
        is kept back (`files.atomic_open`), and here it still ends as
        interrupted. A status of 130 or 143 was told already (or meant to be
        quiet: a person's Ctrl-C in interactive translation).
        """
        try:
            return super().main(*args, **kwargs)
        except Terminated:  # while typer parsed the arguments, outside `invoke`
            typer.secho("terminated", err=True)
            raise SystemExit(TERMINATED) from None
        except SystemExit as done:
            if stopped_by() is None or done.code in (INTERRUPTED, TERMINATED):
                raise
            _tell_stopped()
        except Exception:  # an interrupt inside an import can leave a module half loaded, failing the next one
            if stopped_by() is None:
                raise
            _tell_stopped()

    def make_context(self, *args: object, **kwargs: object) -> typer.Context:
        """Typer turns a Ctrl-C while it parses the arguments into a silent exit 130: one line, as everywhere."""
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True)
            raise typer.Exit(INTERRUPTED) from None

    def invoke(self, ctx: typer.Context) -> object:
        try:
            keep_freed_memory()  # every command that computes gains from it (transformer_mt/malloc.py)
            prepare_openmp()  # before any command imports torch: libgomp reads it once (transformer_mt/cpus.py)
            check_working_directory()
            return super().invoke(ctx)
        except UserError as err:
            typer.secho(f"error: {' '.join(str(err).split())}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
        except Interrupted as err:  # Ctrl-C where the work can say what it kept (training: the newest checkpoint)
            typer.secho(" ".join(str(err).split()), err=True)
            raise typer.Exit(INTERRUPTED) from None
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True)
            raise typer.Exit(INTERRUPTED) from None
        except Terminated:  # SIGTERM: unwound as Ctrl-C is, temporary files removed on the way
            typer.secho("terminated", err=True)
            raise typer.Exit(TERMINATED) from None
        except BrokenPipeError:  # the reader of stdout is gone (`| head`): stop quietly, as a shell tool does
            quiet_stdout()
            raise typer.Exit(BROKEN_PIPE) from None
        except OSError as err:  # a path of the user's (below a file, not writable, a full disk): theirs to fix
            if err.filename is None and err.errno not in DISK_FULL:
                raise
            typer.secho(f"error: {os_error_message(err)}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's first sentence whole, wrapped to the terminal: click's listing cuts it at the width."""
        commands = [c for c in map(partial(self.get_command, ctx), self.list_commands(ctx)) if c and not c.hidden]
        rows = [(c.name or "", c.get_short_help_str(sys.maxsize)) for c in commands]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _tell_stopped() -> None:
    signum = stopped_by()
    typer.secho("interrupted" if signum == signal.SIGINT else "terminated", err=True)
    raise SystemExit(SIGNAL_EXITS[signum]) from None


INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
TERMINATED = 143  # 128 + SIGTERM
BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool stopped by a closed pipe


def check_working_directory() -> None:
    """A UserError when the directory tmt runs in is gone (deleted under a shell that stayed in it): every relative
    path would fail later, some libraries (oneMKL) abort the process on it."""
    import os

    try:
        os.getcwd()
    except FileNotFoundError:
        raise UserError(
            "the current directory no longer exists (it was deleted or moved); cd to an existing directory and run "
            "tmt again"
        ) from None


def require_stdout(what: str, fix: str) -> None:
    """A UserError, before any work, when standard output was closed (``>&-``): Python then drops every print, and
    the command would end with status 0 and its output nowhere."""
    import sys

    if sys.stdout is None:
        raise UserError(f"standard output is closed, so {what} have nowhere to go; {fix}")


def sigterm_kills() -> None:
    """SIGTERM stops a training as it always has, at once, not unwound as `Terminated`: torchrun sends it to every
    rank when one fails, and a rank that unwound could wait on the others. Ctrl-C saves a checkpoint (trainer.py)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the exit's flush of what is still buffered fails no more (Python's
    recipe for SIGPIPE); the reader is gone, nothing more can reach it."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):  # stdout closed or not a real file: nothing is left to flush
        pass


def os_error_message(err: OSError) -> str:
    """One line for an OSError about a path: which path, what the system said, and what to check.

    A full disk (or a file size limit, a quota) names the file where a writer
    of ours wrote it (`files.naming`); elsewhere it names none, and still
    ends in one line: no room is no bug of tmt's.
    """
    if err.errno in DISK_FULL:
        return no_room_message(err.filename, err, "choose an output path on another disk")
    where = f"{err.filename}" + (f" -> {err.filename2}" if err.filename2 else "")
    if isinstance(err, FileExistsError | NotADirectoryError) and err.filename:
        # a directory wanted where a file is (-o FILE/out.png): the system's "File exists" names no cause
        path = Path(err.filename)
        file = next((p for p in (path, *path.parents) if p.is_file()), None)
        if file is not None:
            return f"{file} is a file, not a directory; choose an output path in a directory"
    return (
        f"{where}: {err.strerror or err}; check that every directory on the path exists and is yours to write, "
        "and that the disk has room"
    )


app = typer.Typer(
    cls=Commands,
    name="tmt",
    help=(
        "Train and evaluate the Transformer of 'Attention Is All You Need' as the paper did.\n\n"
        "The pipeline, one command per stage:\n\n"
        "  tmt quickstart                     the whole pipeline on the embedded toy corpus\n\n"
        "  tmt init --train data/train ...    a config for your own parallel text\n\n"
        "  tmt download wmt14 --pair en-de    fetch WMT14 parallel text\n\n"
        "  tmt prepare configs/base.yaml      clean, learn BPE, binarize\n\n"
        "  tmt train configs/base.yaml        train (resumes automatically)\n\n"
        "  tmt average runs/X --last 5        average the last checkpoints\n\n"
        "  tmt translate -c avg.pt < in.txt   beam search, line by line\n\n"
        "  tmt evaluate newstest2014 -c avg.pt  sacreBLEU and the paper's BLEU\n\n"
        "  tmt serve -c avg.pt --port 8000    HTTP and WebSocket API, a demo page\n\n"
        "  tmt export ctranslate2 -c avg.pt -o DIR  a CTranslate2 model directory\n\n"
        "  tmt export spm -c avg.pt -o spm.model    its BPE model, to prepare new data (bpe.model)\n\n"
        "The paper's tables and figures:\n\n"
        "  tmt report RUN... -o report.md     Tables 2 and 3, yours beside the paper's\n\n"
        "  tmt plot RUN -o curves.png         loss, learning rate, BLEU curves\n\n"
        "  tmt attention -c avg.pt -t TEXT    attention per head (Figures 3-5)"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help, which wraps every text at any width; rich's tables cut it with "…"
)


def _print_version(value: bool) -> None:
    if value:
        from transformer_mt import __version__

        typer.echo(f"tmt {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print tmt's version and exit."),
    ] = False,
) -> None:
    # the app's own options: --version acts in its callback, before any command runs
    pass


ConfigArg = Annotated[
    Path,
    typer.Argument(
        help="YAML config: a file (e.g. one `tmt init` wrote), or tmt:NAME for one shipped with tmt: tmt:base.yaml, "
        "tmt:big.yaml (the paper's), tmt:multi30k.yaml, tmt:toy.yaml, tmt:table3/... Paths inside a config, base: "
        "included, are relative to the directory tmt runs in.",
        show_default=False,
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.max_updates=2000 (repeatable)."),
]


class Quantize(str, Enum):
    """Values of `decode.quantize`, for the --quantize flag."""

    none = "none"
    int8 = "int8"


QuantizeOpt = Annotated[
    Quantize | None,
    typer.Option(
        "--quantize",
        help="int8: int8 Linear layers (each input row scaled on its own), CPU only, 1.3-1.6x as fast as fp32; a "
        "deviation from the paper's fp32 model (BLEU change: benchmarks/README.md). Sets decode.quantize "
        "(default: the checkpoint's, none).",
    ),
]


class Engine(str, Enum):
    """Who runs the beam search of translate/evaluate."""

    pytorch = "pytorch"
    ctranslate2 = "ctranslate2"


EngineOpt = Annotated[
    Engine,
    typer.Option(
        "--engine",
        help="pytorch: tmt's model and beam search on checkpoints. ctranslate2: CTranslate2 on a directory of "
        "`tmt export ctranslate2` (-c DIR; pip install ctranslate2), same text handling, CTranslate2's search "
        "(docs/decoding.md).",
    ),
]


CombineOpt = Annotated[
    bool,
    typer.Option(
        "--ensemble/--average",
        help="How several -c combine. --average (the default): one model whose "
        "weights are their mean, what `tmt average` writes; the paper's way with the last checkpoints of one run, "
        "at one model's cost. --ensemble: every model decodes and each beam step takes the mean of their "
        "log-probabilities; for separately trained models (other seeds or configs; their weights cannot be "
        "averaged) that share one BPE vocabulary, at M models' cost.",
    ),
]


def decode_overrides(set_: list[str] | None, quantize: Quantize | None, **flags: int | float | str | None) -> list[str]:
    """The --set texts of translate/evaluate/serve, then the decoding flags as the decode.* keys they set (applied
    last: a flag wins over --set), so that the checkpoint's config is changed and validated in one place."""
    from transformer_mt.decode.load import decode_flags

    return [*(set_ or []), *decode_flags(**flags, quantize=None if quantize is None else quantize.value)]


def load(config: Path, overrides: list[str] | None, verbose: bool = False) -> Config:
    """Load and check the config; print it resolved only when asked (`train` saves it in its run directory)."""
    cfg = load_config(config, overrides or [])
    if verbose:
        typer.echo(f"# resolved config ({config}{' + --set' if overrides else ''})", err=True)
        typer.echo(cfg.to_yaml(), err=True)
    return cfg


VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Print the resolved config (every key, after base: and --set) first.")
]
ThreadsOpt = Annotated[
    int,
    typer.Option(
        "--threads",
        min=0,
        help="CPU threads for torch (and CTranslate2). 0: the CPUs this process may use (its affinity mask and "
        "cgroup CPU quota), unless TMT_NUM_THREADS or OMP_NUM_THREADS says otherwise; --verbose says which and why.",
    ),
]
ThreadsVerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Say how many CPU threads are used, and why, on stderr.")
]


def threads_for(requested: int, verbose: bool) -> str:
    """Give torch the thread count of a decoding command (`transformer_mt.cpus.use_threads`); say it if asked.
    Returns why that many."""
    from transformer_mt.cpus import use_threads

    threads = use_threads(requested)
    if verbose:
        typer.echo(f"threads: {threads.why}", err=True)
    return threads.why


LenpenOpt = Annotated[float | None, typer.Option("--lenpen", help="Length penalty alpha (paper: 0.6).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available).")]


@app.command()
def synth(
    out: Annotated[Path, typer.Option("--out-dir", "--out", "-o", help="Directory for train/valid/test files.")] = Path(
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


class Preset(str, Enum):
    """Values of `tmt init --preset`."""

    small = "small"
    base = "base"
    big = "big"


InitDirectionsOpt = Annotated[
    str,
    typer.Option(
        "--directions",
        help="Several directions in one model, instead of --src/--tgt: e.g. en-de,de-en,en-fr over multi-way "
        "parallel files, one per language (PREFIX.en, PREFIX.de, PREFIX.fr, line N the same sentence in each).",
    ),
]
InitTrainOpt = Annotated[
    str, typer.Option("--train", help="Prefix of the training files: --train data/corpus reads data/corpus.SRC/.TGT.")
]


@app.command()
def init(
    train: InitTrainOpt,
    valid: Annotated[str, typer.Option("--valid", help="Prefix of the validation files (checkpoint choice, BLEU).")],
    src: Annotated[str, typer.Option("--src", help="Source language: the source files' suffix, e.g. en.")] = "",
    tgt: Annotated[str, typer.Option("--tgt", help="Target language: the target files' suffix, e.g. de.")] = "",
    directions: InitDirectionsOpt = "",
    test: Annotated[
        str, typer.Option("--test", help="Prefix of the test files (tmt evaluate test); none if omitted.")
    ] = "",
    preset: Annotated[
        Preset | None,
        typer.Option(
            "--preset",
            help="small: tmt:multi30k.yaml's model (d_model 256, 3+3 layers), for up to ~100k pairs and CPUs; base or "
            "big: the paper's. Default: small below 100k pairs, else base.",
            show_default=False,
        ),
    ] = None,
    minutes: Annotated[
        float,
        typer.Option(
            "--minutes", help="A time budget (train.max_minutes) instead of the update budget chosen from the corpus."
        ),
    ] = 0.0,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="The config to write (default: SRC-TGT.yaml).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
) -> None:
    """Write a complete, commented config for your own parallel text.

    Checks that every file exists and that both sides of each split have the
    same number of lines, counts the corpus, and chooses from the counts: the
    model (--preset), the BPE vocabulary size, data.max_ratio, and an update
    budget of some epochs with a schedule that fits it (or --minutes). Every
    key of every section is written, with its documentation or the reason it
    was chosen; nothing is inherited, so the file works from any tmt install.
    The run directory and prepared data are runs/NAME and prepared/NAME
    (NAME: the output file's name). Paths stay as you give them: relative to
    the directory you run tmt in.

    Example: tmt init --train data/train --valid data/dev --test data/test --src en --tgt de -o en-de.yaml;
    then tmt train en-de.yaml and tmt evaluate test -c runs/en-de. Several directions of one model:
    tmt init --train data/train --valid data/dev --directions en-de,de-en,en-fr,fr-en -o multi.yaml
    """
    from transformer_mt.files import check_output_file
    from transformer_mt.init_config import init_directions, summary, write_config

    ways = init_directions(src, tgt, directions)
    out = output or Path("multilingual.yaml" if ways else f"{src}-{tgt}.yaml")
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to overwrite it, or -o another file")
    check_output_file(out, example="en-de.yaml")
    chosen = None if preset is None else preset.value
    given = {"--train": train, "--valid": valid, "--test": test, "--src": src, "--tgt": tgt, "--directions": directions}
    given |= {"--preset": chosen, "--minutes": f"{minutes:g}" if minutes else None, "-o": str(out)}
    command = " ".join(["tmt init", *(f"{flag} {value}" for flag, value in given.items() if value)])
    choices = write_config(train, valid, test, src, tgt, out, chosen, minutes, command, directions=ways)
    typer.echo(summary(choices, out))


@app.command()
def prepare(
    config: ConfigArg,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Redo every step even if the outputs are up to date.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Clean the parallel text, learn the joint BPE vocabulary and binarize every split.

    Reads data.train/valid/test + .src_lang/.tgt_lang (e.g. corpus/train.en and
    corpus/train.de); normalizes every line (NFC, controls removed, whitespace
    collapsed); drops training pairs with an empty side, more than data.max_len
    words or a length ratio above data.max_ratio (valid/test: empty sides only);
    learns a joint sentencepiece BPE of bpe.vocab_size pieces on a sample of
    bpe.sample_sentences sentences (or, with bpe.model set, copies that
    sentencepiece model and ignores the other bpe keys: new data in a
    checkpoint's vocabulary, see `tmt export spm`); encodes with data.workers
    processes; writes data.dir, manifest.json last. Re-running with unchanged
    inputs, config and bpe.model file does nothing. See docs/data.md.
    """
    from transformer_mt.data.prepare import prepare_data

    prepare_data(load(config, set_, verbose), force=force)


@app.command("data-stats")
def data_stats(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print sentence and token counts, length percentiles and padding at train.max_tokens."""
    from transformer_mt.data.stats import format_stats

    typer.echo(format_stats(load(config, set_)))


@app.command()
def train(
    config: ConfigArg,
    set_: SetOpt = None,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", help="Launch this many processes with torchrun (DDP) on this host.")
    ] = 0,
    threads: Annotated[
        int,
        typer.Option(
            "--threads",
            min=0,
            help="CPU threads for torch, per process (train.num_threads). 0: the CPUs this process may use (affinity "
            "mask, cgroup CPU quota; shared by --nproc-per-node processes), unless TMT_NUM_THREADS or OMP_NUM_THREADS "
            "says otherwise. The log's first line says how many and why.",
        ),
    ] = 0,
    verbose: VerboseOpt = False,
) -> None:
    """Train the model; resumes from the newest checkpoint in train.save_dir.

    Prepares the data first when data.dir holds nothing up to date. Stops at
    train.max_updates, max_epochs or max_minutes, whichever comes first; run
    the same command again (with a higher limit) to continue exactly where it
    stopped. Tokens per update = train.max_tokens x train.update_freq x GPUs
    (the paper: about 25k), so on 8 GPUs use --set train.update_freq=1.

    Writes to train.save_dir: checkpoint_u<update>.pt, checkpoint_best.pt,
    metrics.jsonl, config.yaml, and .lock: a second `tmt train` on the same
    save_dir is refused while this one runs. For several GPUs on this host:
    `tmt train CONFIG --nproc-per-node 8`; on several hosts run torchrun
    yourself: `torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d
    --rdzv-endpoint HOST:29500 -m transformer_mt train CONFIG` (docs/training.md).

    Fine-tuning: `tmt train CONFIG --set train.init_from=runs/base/average.pt
    --set train.save_dir=runs/tuned` starts a new run from that checkpoint's
    weights, with a fresh optimizer and the schedule from update 0; the
    vocabulary (the same spm.model in data.dir) and the model's shape must
    be the checkpoint's. On another corpus, prepare it with the checkpoint's
    BPE model: `tmt export spm -c runs/base/average.pt -o spm.model`, then
    --set bpe.model=spm.model with a data.dir of its own. A run that resumes
    ignores train.init_from.
    """
    import os

    from transformer_mt.train.distributed import launch_torchrun
    from transformer_mt.train.trainer import train_model

    sigterm_kills()
    set_ = [*(set_ or []), f"train.num_threads={threads}"] if threads else set_
    if nproc_per_node > 0:
        args = ["train", str(config), *_set_args(set_), *(["--verbose"] if verbose else [])]
        raise typer.Exit(launch_torchrun(nproc_per_node, args))
    main = os.environ.get("RANK", "0") == "0"
    cfg = load(config, set_, verbose and main)
    if main:
        given = f"{config}{f' + {len(set_)} --set' if set_ else ''}"
        typer.echo(
            f"resolved config ({given}): {Path(cfg.train.save_dir) / 'config.yaml'}, --verbose prints it", err=True
        )
    train_model(cfg)


def _set_args(overrides: list[str] | None) -> list[str]:
    return [arg for o in overrides or [] for arg in ("--set", o)]


@app.command()
def average(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help="A run directory (its newest checkpoints, see --last), or the checkpoint files to average.",
            metavar="RUN_DIR|CHECKPOINT",
            show_default=False,
        ),
    ],
    last: Annotated[
        int | None,
        typer.Option(
            "--last", help="Average the newest K readable checkpoints by update (default: train.average_last)."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Output file (default: RUN_DIR/average.pt; ./average.pt for checkpoint files)."
        ),
    ] = None,
) -> None:
    """Average the parameters of several checkpoints (the paper: base last 5, big last 20).

    The paper wrote a checkpoint every 10 minutes and averaged the newest ones
    (parameters summed in float64). The output is a checkpoint `tmt translate`
    and `tmt evaluate` load like any other; it carries the config and BPE
    model of the newest input.

    Examples: tmt average runs/base --last 5 (writes runs/base/average.pt);
    tmt average runs/base/checkpoint_u0090000.pt runs/base/checkpoint_u0100000.pt -o avg.pt
    """
    from transformer_mt.files import check_output_file
    from transformer_mt.train.average import average_checkpoints, default_last, last_checkpoints

    run_dir = inputs[0] if len(inputs) == 1 and not inputs[0].is_file() else None
    if run_dir is None and last is not None:
        raise UserError(f"--last {last} picks checkpoints of a run directory; give one directory, not files")
    out = output or (run_dir / AVERAGE_NAME if run_dir else Path(AVERAGE_NAME))
    check_output_file(out, example=AVERAGE_NAME)
    paths = inputs if run_dir is None else last_checkpoints(run_dir, default_last(run_dir) if last is None else last)
    average_checkpoints(paths, out)
    typer.echo(f"averaged {len(paths)} checkpoints ({', '.join(map(str, paths))}) -> {out}")


TranslateCheckpointOpt = Annotated[
    list[Path],
    typer.Option(
        "--checkpoint",
        "-c",
        help="Checkpoint of `tmt train` or `tmt average`; repeat -c to combine several: averaged on the fly "
        "by default (the model `tmt average` would write, with the newest input's config and BPE model), "
        "decoded together with --ensemble (the first one's decoding settings).",
    ),
]
TranslateInputOpt = Annotated[
    Path | None, typer.Option("--input", "-i", help="Raw text, one sentence per line (default stdin).")
]
TranslateOutputOpt = Annotated[
    Path | None, typer.Option("--output", "-o", help="Where translations go (default stdout).")
]
TranslateBeamOpt = Annotated[int | None, typer.Option("--beam", "-b", help="Beam size (paper: 4); 1 is greedy.")]
NbestOpt = Annotated[
    int | None,
    typer.Option(
        "--nbest",
        help="Write the K best hypotheses per input line as 'index<TAB>score<TAB>text' "
        "(0-based line index, length-normalized log-probability, best first); K <= beam. With --sample: K "
        "samples, in the order drawn.",
    ),
]
BatchTokensOpt = Annotated[
    int | None,
    typer.Option("--batch-tokens", help="Padded source tokens per batch (default: decode.batch_tokens)."),
]
TranslateSetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Change the checkpoint's config before the model is built: decode.* keys or model.max_positions "
        "(sinusoidal positions only), e.g. --set decode.max_len_b=100 (repeatable).",
    ),
]
SampleOpt = Annotated[
    str | None,
    typer.Option(
        "--sample",
        help="Draw each token instead of beam search: topk:K from the K most probable tokens, topp:P from the "
        "fewest most probable tokens holding probability P (e.g. topk:10, topp:0.9). Beam 1 (refuses --beam > 1); "
        "--nbest K gives K samples per line. Reproducible: a line's sample depends on --seed and the line only, "
        "not on its batch or the rest of the file (decode.sampling).",
        show_default=False,
    ),
]
TemperatureOpt = Annotated[
    float | None,
    typer.Option(
        "--temperature",
        help="With --sample: divide the log-probabilities by T before drawing; < 1 sharper, > 1 more varied "
        "(default 1; decode.sampling_temperature).",
        show_default=False,
    ),
]
SeedOpt = Annotated[
    int | None,
    typer.Option(
        "--seed",
        help="With --sample: the seed, hashed with each line's tokens and the sample's number; the same seed "
        "and line give the same sample (default 1; decode.seed).",
        show_default=False,
    ),
]
PrefixFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--prefix-file",
        help="Target prefixes, one per input line (an empty line: none): each translation starts with its "
        "line's prefix and the search continues from it; the prefix's tokens count in the score. As many lines "
        "as the input.",
        show_default=False,
    ),
]
AlignmentOpt = Annotated[
    str | None,
    typer.Option(
        "--alignment",
        help="Add each translation's word alignment after a tab (also on --nbest rows), from the decoder's "
        "attention over the source in decode.alignment_layer (default: the top layer): hard = Pharaoh "
        "'i-j' pairs (0-based source word i, target word j); soft = per target word, the source words' "
        "probabilities, comma-separated, words separated by spaces.",
        show_default=False,
    ),
]
WindowLinesOpt = Annotated[
    int,
    typer.Option(
        "--window-lines",
        help="Read, translate and write a file or pipe N lines at a time, so that memory holds N lines whatever "
        "the input's length; each window is batched by length (the same output for any N).",
    ),
]
BufferLinesOpt = Annotated[
    int | None,
    typer.Option(
        "--buffer-lines",
        help="Translate N lines at a time as they are read and print their translations at once, flushed, "
        "for a program that writes a line and waits for its translation (default at a terminal: 1; files and "
        "pipes are otherwise read in --window-lines windows batched by length, the fastest). Prints to stdout: "
        "not with -o.",
        show_default=False,
    ),
]
ConstraintsOpt = Annotated[
    bool,
    typer.Option(
        "--constraints",
        help="Lexically constrained decoding: each input line is the source, then tab-separated target phrases "
        "its translation must contain, in any order, each as written (fairseq's format: "
        "'A dog runs.<TAB>Hund<TAB>rennt'); a line without a tab is translated as usual. Phrases are encoded "
        "as words after a space. Dynamic beam allocation (docs/decoding.md); not with --engine ctranslate2.",
    ),
]


SrcLangOpt = Annotated[
    str | None,
    typer.Option(
        "--src-lang",
        help="The language of the input, for a model of several directions (data.directions), e.g. fr; needed "
        "only when several of its sources translate into --tgt-lang.",
        show_default=False,
    ),
]
TgtLangOpt = Annotated[
    str | None,
    typer.Option(
        "--tgt-lang",
        help="The language to translate into, for a model of several directions (data.directions), e.g. de; a "
        "pair of its languages it was never trained on is translated with a warning (zero-shot).",
        show_default=False,
    ),
]
PivotOpt = Annotated[
    str | None,
    typer.Option(
        "--pivot",
        help="Translate into this language first, then from it into --tgt-lang, with the same model: for a pair "
        "it was never trained on (de->fr through en), whose zero-shot output is often in the wrong language. "
        "Not with --alignment. tmt evaluate writes eval_<name>.<src>-<pivot>-<tgt>.",
        show_default=False,
    ),
]


@app.command(context_settings={"allow_extra_args": True})  # a file given without -i: named in the error
def translate(
    ctx: typer.Context,
    checkpoint: TranslateCheckpointOpt,
    input: TranslateInputOpt = None,
    output: TranslateOutputOpt = None,
    beam: TranslateBeamOpt = None,
    lenpen: LenpenOpt = None,
    nbest: NbestOpt = None,
    batch_tokens: BatchTokensOpt = None,
    device: DeviceOpt = None,
    set_: TranslateSetOpt = None,
    quantize: QuantizeOpt = None,
    engine: EngineOpt = Engine.pytorch,
    ensemble: CombineOpt = False,
    sample: SampleOpt = None,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    prefix_file: PrefixFileOpt = None,
    alignment: AlignmentOpt = None,
    window_lines: WindowLinesOpt = 10_000,
    buffer_lines: BufferLinesOpt = None,
    constraints: ConstraintsOpt = False,
    src_lang: SrcLangOpt = None,
    tgt_lang: TgtLangOpt = None,
    pivot: PivotOpt = None,
    threads: ThreadsOpt = 0,
    verbose: ThreadsVerboseOpt = False,
) -> None:
    """Translate raw text line by line with beam search.

    Normalization and BPE happen inside, using the BPE model stored in the checkpoint; the output is
    detokenized text. The output has exactly one line per input line, in input order (K lines with --nbest K);
    an empty input line gives an empty output line. Decoding settings default to the checkpoint's `decode`
    section (the paper: beam 4, length penalty 0.6, max length source + 50, early stopping); the flags override
    them. A line longer than the model's max_positions is translated after truncation, with a warning.

    Input from a file or a pipe is read, batched by length, translated and
    written --window-lines lines at a time (memory stays bounded; -o FILE
    appears complete or not at all); typed at a terminal (or with
    --buffer-lines N) each line (N lines) is translated as soon as it is read.

    Examples: tmt translate -c runs/base/average.pt -i newstest2014.en -o out.de;
    an ensemble of two runs: tmt translate -c run1/average.pt -c run2/average.pt --ensemble < in.en;
    a line in, a line out: tmt translate -c avg.pt --buffer-lines 1;
    with constraints: printf 'A dog runs.\\tHund\\n' | tmt translate -c avg.pt --constraints;
    a model of several directions: tmt translate -c avg.pt --src-lang fr --tgt-lang de < in.fr (--pivot en: via en)
    (CTranslate2: tmt export ctranslate2 -c runs/base/average.pt -o ct2; tmt translate --engine ctranslate2 -c ct2 ...)
    """
    _check_translate_args(ctx.args, checkpoint, constraints, engine, ensemble, prefix_file is not None)
    threads_for(threads, verbose)
    overrides = decode_overrides(
        set_, quantize, beam=beam, lenpen=lenpen, nbest=nbest, batch_tokens=batch_tokens, sample=sample,
        temperature=temperature, seed=seed, alignment=alignment,
    )  # fmt: skip
    settings = dict(
        device=device, overrides=overrides, engine=engine.value, ensemble=ensemble, prefix_file=prefix_file,
        constraints=constraints, languages=(src_lang, tgt_lang), pivot=pivot,
    )  # fmt: skip
    _translate_lines(checkpoint, input, output, window_lines, buffer_lines, settings)


CorpusInputOpt = Annotated[
    Path,
    typer.Option("--input", "-i", help="Text in the model's source language, one sentence per line, no empty lines."),
]
CorpusPrefixOpt = Annotated[
    Path,
    typer.Option(
        "--output", "-o",
        help="The corpus prefix: writes PREFIX.SRC (the input) and PREFIX.TGT (its translations), the model's "
        "languages as suffixes, for a config's data.train or data.corpora; PREFIX.parts/ holds the windows done "
        "until the end.",
    ),
]  # fmt: skip
CorpusWindowOpt = Annotated[
    int, typer.Option("--window-lines", help="Lines translated and saved at a time: what a kill loses at most.")
]
CorpusForceOpt = Annotated[
    bool, typer.Option("--force", help="Start over: replace the corpus, or windows made with another plan.")
]


@app.command()
def backtranslate(
    checkpoint: TranslateCheckpointOpt,
    input: CorpusInputOpt,
    output: CorpusPrefixOpt,
    beam: TranslateBeamOpt = None,
    sample: SampleOpt = None,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    ensemble: CombineOpt = False,
    window_lines: CorpusWindowOpt = 10_000,
    src_lang: SrcLangOpt = None,
    tgt_lang: TgtLangOpt = None,
    device: DeviceOpt = None,
    set_: TranslateSetOpt = None,
    force: CorpusForceOpt = False,
    threads: ThreadsOpt = 0,
) -> None:
    """Make a parallel corpus of monolingual text and a reverse model's translations of it (back-translation).

    Give text in the language you want to translate INTO and a model that
    translates from it: -c de-en.pt -i captions.de -o synth/bt writes
    synth/bt.de (the text) and synth/bt.en (the translations), a corpus for
    an en->de model (Sennrich et al. 2016; --sample topk:10 --seed 1 for
    sampled back-translation, Edunov et al. 2018). Interrupted, the same
    command resumes at the first window not yet saved, and the corpus equals
    an uninterrupted run's. docs/training.md, "More data from your model".
    """
    _make_corpus(checkpoint, input, output, beam, sample, temperature, seed, ensemble, window_lines,
                 (src_lang, tgt_lang), device, set_, force, threads)  # fmt: skip


@app.command()
def distill(
    checkpoint: TranslateCheckpointOpt,
    input: CorpusInputOpt,
    output: CorpusPrefixOpt,
    beam: TranslateBeamOpt = None,
    ensemble: CombineOpt = False,
    window_lines: CorpusWindowOpt = 10_000,
    src_lang: SrcLangOpt = None,
    tgt_lang: TgtLangOpt = None,
    device: DeviceOpt = None,
    set_: TranslateSetOpt = None,
    force: CorpusForceOpt = False,
    threads: ThreadsOpt = 0,
) -> None:
    """Make a parallel corpus of the training sources and a teacher's translations of them (distillation).

    -c teacher.pt (or -c a.pt -c b.pt --ensemble) -i train.en -o synth/kd
    writes synth/kd.en (the sources) and synth/kd.de (the teacher's beam
    search output), the corpus a student is trained on (sequence-level
    knowledge distillation, Kim & Rush 2016). Resumable as backtranslate is.
    docs/training.md, "More data from your model".
    """
    _make_corpus(checkpoint, input, output, beam, None, None, None, ensemble, window_lines, (src_lang, tgt_lang),
                 device, set_, force, threads)  # fmt: skip


def _make_corpus(
    checkpoint: list[Path], input: Path, output: Path, beam: int | None, sample: str | None,
    temperature: float | None, seed: int | None, ensemble: bool, window_lines: int,
    languages: tuple[str | None, str | None], device: str | None, set_: list[str] | None, force: bool, threads: int,
) -> None:  # fmt: skip
    from transformer_mt.synthetic_corpus import make_corpus

    threads_for(threads, False)
    overrides = decode_overrides(set_, None, beam=beam, sample=sample, temperature=temperature, seed=seed)
    src, tgt = make_corpus(checkpoint, input, output, overrides, languages, window_lines, ensemble, device, force)
    typer.echo(f"wrote {src} and {tgt}", err=True)


def _check_translate_args(
    args: list[str], checkpoint: list[Path], constraints: bool, engine: Engine, ensemble: bool, prefixes: bool
) -> None:
    """Refuse what translate cannot do before a model is loaded: a file given without -i (typer takes it as an extra
    argument; the error names the -i it meant) and the choices that cannot combine whatever the checkpoint says
    (`mode_conflict`: constraints with CTranslate2 or prefixes, an ensemble of exports)."""
    from transformer_mt.config import DecodeMode
    from transformer_mt.decode.translate import check_mode

    if args:
        raise UserError(
            f"tmt translate reads the file given with -i (or stdin), not a file named after the options: "
            f"tmt translate -c {checkpoint[0] if checkpoint else 'CHECKPOINT'} -i {args[0]}"
        )
    check_mode(DecodeMode(constraints=constraints, prefixes=prefixes, engine=engine.value, ensemble=ensemble))


def _translate_lines(
    checkpoint: list[Path],
    input: Path | None,
    output: Path | None,
    window_lines: int,
    buffer_lines: int | None,
    settings: dict,
) -> None:
    """Check where the translations go, then translate in windows (files, pipes: batched by length, -o written
    whole) or as lines arrive (a terminal, --buffer-lines), so that each kind of input gets the mode that suits it."""
    import sys

    from transformer_mt.decode.lines import translate_file
    from transformer_mt.decode.stream import stream_lines
    from transformer_mt.files import check_output_file

    if output is not None:
        check_output_file(output, example="translations.txt")
    else:
        require_stdout("the translations", "pass -o FILE")
    terminal = input is None and sys.stdin is not None and sys.stdin.isatty()
    stream = stream_lines(buffer_lines, input, output, terminal)
    if stream is None:
        translate_file(checkpoint, input, output, window_lines=window_lines, **settings)
    else:
        _translate_interactive(checkpoint, input, stream, {**settings, "ready": terminal})


def _translate_interactive(checkpoint: list[Path], input: Path | None, stream: int, settings: dict) -> None:
    """Ctrl-C is how a person at a terminal stops: every translation is printed already, so exit 130 quietly."""
    import sys

    from transformer_mt.decode.stream import translate_interactive

    try:
        translate_interactive(checkpoint, input, stream, **settings)
    except KeyboardInterrupt:
        sys.stdout.flush()
        raise typer.Exit(130) from None


@app.command("train-aligner")
def train_aligner(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-c", help="The model to align for (tmt train or average).")
    ],
    source: Annotated[Path, typer.Option("--src", help="Source side of a parallel text: the training corpus's.")],
    target: Annotated[Path, typer.Option("--tgt", help="Its target side, line by line the translation of --src.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The checkpoint to write: -c's, with the aligner.")],
    links: Annotated[
        Path | None,
        typer.Option(
            "--links",
            help="Word links of the text, one Pharaoh line per pair (i-j: source and target word from 0, as "
            "fast_align and eflomal write). Default: eflomal's, both directions, grow-diag-final-and "
            "(pip install 'transformer_mt[align]'), written to OUTPUT.links.",
        ),
    ] = None,
    eflomal_runs: Annotated[
        int,
        typer.Option("--eflomal-runs", min=1, help="Without --links: keep the links most of N eflomal runs agree on."),
    ] = 1,
    epochs: Annotated[int, typer.Option("--epochs", min=1, help="Passes over the text.")] = 4,
    valid_lines: Annotated[
        int, typer.Option("--valid-lines", min=1, help="The last N pairs, held out: the epoch of best link F1 is kept.")
    ] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Sentence pairs per update.")] = 64,
    dim: Annotated[int, typer.Option("--dim", min=8, help="Width of the aligner's vectors, a multiple of 4.")] = 256,
    layers: Annotated[int, typer.Option("--layers", min=0, help="Its target-side self-attention layers.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Initialization and batch order.")] = 1,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --output.")] = False,
    threads: ThreadsOpt = 0,
) -> None:
    """Train a word aligner for a model: better --alignment, and HTML tags where they belong in tmt serve.

    A model's attention is a weak aligner (docs/decoding.md, "Word
    alignments"). This trains a small head on the frozen model's states to
    predict a word aligner's links (Garg et al. 2019's supervision), in
    minutes on a CPU; translations do not change. The output is the
    checkpoint with the head in it: tmt translate --alignment and tmt serve
    (format "html") use it by themselves (--set decode.use_aligner=false:
    the attention again).

    Example: tmt train-aligner -c runs/multi30k_hour/average.pt --src
    ../shared/data/multi30k/train.en --tgt ../shared/data/multi30k/train.de
    -o runs/multi30k_hour/aligned.pt
    """
    from transformer_mt.decode.aligner import AlignerShape
    from transformer_mt.files import check_output_file
    from transformer_mt.train.aligner import train_aligner as run

    check_output_file(output, example="aligned.pt")
    if output.exists() and not force:
        raise UserError(f"{output} already exists; choose another -o or pass --force to replace it")
    threads_for(threads, False)
    figures = run(
        checkpoint, source, target, links, output, eflomal_runs=eflomal_runs, epochs=epochs, valid_lines=valid_lines,
        batch_size=batch_size,
        shape=AlignerShape(dim=dim, layers=layers), seed=seed, report=lambda line: typer.echo(line, err=True),
    )  # fmt: skip
    typer.echo(f"wrote {output}: held-out link F1 {figures['f1']:.3f}", err=True)


@app.command()
def evaluate(
    testset: Annotated[
        str | None,
        typer.Argument(
            help="newstest2013, newstest2014, ... (fetched via sacreBLEU), or test / valid: the checkpoint "
            "config's own data.test / data.valid files."
        ),
    ] = None,
    checkpoint: Annotated[
        list[Path],
        typer.Option("--checkpoint", "-c", help="Checkpoint(s) to translate with; several: see --ensemble/--average."),
    ] = ...,  # type: ignore[assignment]
    src: Annotated[Path | None, typer.Option("--src", help="Local source file instead of a named test set.")] = None,
    ref: Annotated[Path | None, typer.Option("--ref", help="Local reference file instead of a named test set.")] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--out-dir", "--output", "-o", help="Directory for hyp.<lang> and scores.json (default: see below)."
        ),
    ] = None,
    beam: Annotated[int | None, typer.Option("--beam", "-b", help="Beam size (paper: 4).")] = None,
    lenpen: LenpenOpt = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, ... (default: cuda if available).")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            help="Change the checkpoint's config before translating: decode.* keys or model.max_positions "
            "(sinusoidal positions only), e.g. --set decode.len_penalty_form=fairseq (repeatable).",
        ),
    ] = None,
    quantize: QuantizeOpt = None,
    engine: EngineOpt = Engine.pytorch,
    ensemble: CombineOpt = False,
    src_lang: SrcLangOpt = None,
    tgt_lang: TgtLangOpt = None,
    pivot: PivotOpt = None,
    threads: ThreadsOpt = 0,
    verbose: ThreadsVerboseOpt = False,
) -> None:
    """Translate a test set and score it: sacreBLEU (13a, cased) with signature, chrF, TER, and the paper's tokenized compound-split BLEU.

    Named test sets (newstest2013, newstest2014 = the full 3003 lines, newstest2014-filtered = 2737) come
    through sacreBLEU's downloader and cache (directory $SACREBLEU, default ~/.sacrebleu), in the checkpoint's
    language pair. Offline, pass local files: tmt evaluate newstest2014 -c avg.pt --src newstest2014.en --ref
    newstest2014.de. `tmt evaluate test -c CKPT` (or valid) scores the raw files of the split the checkpoint's
    config names, data.test (data.valid) + .src_lang/.tgt_lang, relative to the directory it was trained in. Writes
    hyp.<lang> and scores.json (naming the checkpoint file decoded) to --out-dir (default: eval_<name> beside
    the checkpoint, or in the run directory -c names); an earlier evaluation there is replaced, and stderr names
    it: give each its own -o to keep both. A model of several directions scores each (of a named test set, each it
    holds) into eval_<name>.<src>-<tgt>, then a table; --src-lang/--tgt-lang choose one (needed for --src)."""
    from transformer_mt.evaluate import evaluate_checkpoint

    threads_for(threads, verbose)
    evaluate_checkpoint(
        checkpoint, testset=testset, src=src, ref=ref, output=output, device=device,
        overrides=decode_overrides(set_, quantize, beam=beam, lenpen=lenpen), engine=engine.value, ensemble=ensemble,
        languages=(src_lang, tgt_lang), pivot=pivot,
    )  # fmt: skip


ServeCheckpointOpt = Annotated[
    list[Path],
    typer.Option(
        "--checkpoint",
        "-c",
        help="Checkpoint of `tmt train` or `tmt average`. Several -c of the same directions are averaged; -c of "
        "other directions are served side by side, each answering its own (-c en_de.pt -c de_en.pt). With "
        "--engine ctranslate2, a `tmt export ctranslate2` directory (each its own model).",
    ),
]
HostOpt = Annotated[
    str, typer.Option("--host", help="Address to listen on; 0.0.0.0 for every interface (behind a proxy).")
]
PortOpt = Annotated[int, typer.Option("--port", "-p", help="TCP port to listen on.")]
MaxBatchTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-batch-tokens",
        help="Source tokens the running search holds at most (requests wait to join it beyond), the worker's "
        "rounds gather, and a beam-search batch pads to (decode.batch_tokens; default: the checkpoint's).",
    ),
]
MaxWaitMsOpt = Annotated[
    float,
    typer.Option(
        "--max-wait-ms",
        help="With --engine ctranslate2, which decodes in rounds: how long the worker waits for the requests it "
        "expects to join a round (ms): as many as its last round answered plus those that queued meanwhile. "
        "tmt's own engine lets requests join its running search at the next step, never waiting.",
    ),
]
QueueOpt = Annotated[
    int, typer.Option("--queue", help="Requests that may wait for the worker; beyond, 429 with Retry-After.")
]
MaxLinesOpt = Annotated[int, typer.Option("--max-lines", help="Lines one request may send (413 beyond).")]
MaxCharsOpt = Annotated[
    int, typer.Option("--max-chars", help="Characters one request may send, all lines together (413 beyond).")
]
CorsOriginOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--cors-origin",
        help="An origin (https://example.org) whose pages may call the API from a browser (CORS); repeatable; "
        "'*' for any. Off by default: browsers let only the server's own pages call it.",
        metavar="ORIGIN",
        show_default=False,
    ),
]
ApiKeysOpt = Annotated[
    Path | None,
    typer.Option(
        "--api-keys",
        help="File of API keys, one per line, each with its own requests per minute if given ('KEY 60'; "
        "# comments). Requests but /, /health, /languages, /frontend/settings and /metrics then need an "
        "api_key field (JSON, form or query): 403 without a valid one.",
    ),
]
ReqLimitOpt = Annotated[
    int,
    typer.Option(
        "--req-limit",
        help="Requests per minute per client address (0: no limit), for requests without a key of their own "
        "limit; beyond, 429 with Retry-After.",
    ),
]
LogFormatOpt = Annotated[
    str,
    typer.Option("--log-format", help="The access log on stderr, a line per request: text or json (one object "
                 "per line, for log shippers).", metavar="text|json"),
]  # fmt: skip
ServePivotOpt = Annotated[
    str | None,
    typer.Option(
        "--pivot",
        help="Answer a pair no model was trained on in two legs through this language, each leg by the model "
        "trained on it: -c de_en.pt -c en_fr.pt --pivot en also answers de->fr; a model of several directions "
        "answers its untrained pairs through it instead of zero-shot. /languages lists those pairs.",
        show_default=False,
    ),
]
ServeSetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="decode.* keys or model.max_positions, as in tmt translate (repeatable)."),
]


@app.command()
def serve(
    checkpoint: ServeCheckpointOpt,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    engine: EngineOpt = Engine.pytorch,
    quantize: QuantizeOpt = None,
    max_batch_tokens: MaxBatchTokensOpt = None,
    max_wait_ms: MaxWaitMsOpt = 10.0,
    queue: QueueOpt = 256,
    max_lines: MaxLinesOpt = 256,
    max_chars: MaxCharsOpt = 20_000,
    device: DeviceOpt = None,
    set_: ServeSetOpt = None,
    threads: ThreadsOpt = 0,
    verbose: ThreadsVerboseOpt = False,
    cors_origin: CorsOriginOpt = None,
    api_keys: ApiKeysOpt = None,
    req_limit: ReqLimitOpt = 0,
    log_format: LogFormatOpt = "text",
    pivot: ServePivotOpt = None,
) -> None:
    """Serve a model over HTTP and a WebSocket, with a demo page at /: docs/serving.md.

    POST /translate and /detect take LibreTranslate's requests ({"q": "text"
    or [...], "source": "en", "target": "de", "alternatives": 0, "format":
    "text" or "html"}) as a JSON, form or multipart body or in the query
    string, and POST /translate_file (.txt, .html), so its clients work
    unchanged; GET /frontend/settings; POST /v1/translate is tmt's own ({"sources": [...], "beam",
    "nbest", "len_penalty"}: translation, score and n-best per line); GET
    /languages, GET /health; WS /ws: one line in, its translation out, in
    order; GET /metrics for Prometheus. One worker owns the model; the lines of concurrent requests join
    one running beam search at its next step (continuous batching), and
    each line's translation equals `tmt translate`'s. SIGTERM or
    Ctrl-C answers what is in flight, then exits 0; a second stops at once
    (exit 130, or 143 for SIGTERM). Needs the serve extra:
    pip install "transformer_mt\\[serve]".

    Example: tmt serve -c quickstart/run/average.pt --port 8000, then open http://127.0.0.1:8000/ or
    curl -s localhost:8000/translate -H 'Content-Type: application/json' -d '{"q": "The cat sat.", "source": "en", "target": "de"}'
    """
    from transformer_mt.serve import serve as run_server

    why = threads_for(threads, verbose)
    run_server(
        checkpoint, host=host, port=port, engine=engine.value, device=device,
        overrides=decode_overrides(set_, quantize, batch_tokens=max_batch_tokens), max_wait_ms=max_wait_ms,
        queue_size=queue, max_lines=max_lines, max_chars=max_chars, threads=why, cors_origins=cors_origin or (),
        api_keys=api_keys, req_limit=req_limit, log_format=log_format, pivot=pivot,
    )  # fmt: skip


ExportTargetArg = Annotated[
    str,
    typer.Argument(
        help="ctranslate2: a CTranslate2 model directory. hf: a Hugging Face transformers (Marian) model "
        "directory. spm: the checkpoint's sentencepiece model file.",
        metavar="ctranslate2|hf|spm",
        show_default=False,
    ),
]
ExportCheckpointOpt = Annotated[
    list[Path],
    typer.Option(
        "--checkpoint",
        "-c",
        help="Checkpoint of `tmt train` or `tmt average`; for ctranslate2 and hf, repeat -c to average several.",
    ),
]
ExportOutputOpt = Annotated[
    Path,
    typer.Option(
        "--out-dir", "--output", "-o", help="The model directory to write (ctranslate2, hf), or the file (spm)."
    ),
]
QuantizationOpt = Annotated[
    str,
    typer.Option(
        "--quantization",
        help="Weights as stored for CTranslate2: float32 (as trained), int8 (int8 weights, float32 "
        "activations; for CPUs), int8_float32 (the same), float16 or bfloat16 (for GPUs).",
    ),
]
ExportForceOpt = Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")]


@app.command()
def export(
    target: ExportTargetArg,
    checkpoint: ExportCheckpointOpt,
    output: ExportOutputOpt,
    quantization: QuantizationOpt = "float32",
    force: ExportForceOpt = False,
) -> None:
    """Write a model directory for another engine (CTranslate2, Hugging Face transformers), or a BPE model (spm).

    ctranslate2 (pip install ctranslate2): the directory holds CTranslate2's
    model.bin, config.json and shared_vocabulary.json, the checkpoint's
    sentencepiece model (spm.model, to tokenize input and detokenize output)
    and its tmt config (tmt_config.yaml). It is written beside OUTPUT and
    renamed into place when complete. Translate with it: tmt translate
    --engine ctranslate2 -c OUTPUT, or from Python with
    ctranslate2.Translator(OUTPUT). See docs/decoding.md.

    hf (pip install safetensors protobuf; transformers to load it): a
    directory MarianMTModel.from_pretrained and MarianTokenizer.from_pretrained
    load without tmt: config.json, generation_config.json, model.safetensors,
    source.spm/target.spm (tmt's text normalization built in), vocab.json,
    tokenizer_config.json and a README.md model card with the scores found
    beside the checkpoint. The same logits as tmt; what generate cannot
    express of tmt's decoding is printed (docs/decoding.md).

    spm writes the sentencepiece model the checkpoint was trained with
    (one -c), byte for byte, to the file OUTPUT: give it as bpe.model and
    `tmt prepare` encodes a new corpus with the checkpoint's vocabulary, so
    that train.init_from can fine-tune on it (docs/training.md). An OUTPUT
    that holds the same model is left as it is.

    Examples: tmt export ctranslate2 -c runs/base/average.pt -o runs/base/ct2 --quantization int8;
    tmt export hf -c runs/base/average.pt -o runs/base/hf; tmt export spm -c runs/base/average.pt -o runs/base/spm.model
    """
    if target == "spm":
        _export_spm(checkpoint, output, quantization, force)
    elif target == "ctranslate2":
        _export_ctranslate2(checkpoint, output, quantization, force)
    elif target == "hf":
        _export_hf(checkpoint, output, quantization, force)
    else:
        raise UserError(f"unknown export target {target!r}; known: ctranslate2, hf, spm")


def _export_spm(checkpoint: list[Path], output: Path, quantization: str, force: bool) -> None:
    from transformer_mt.export import export_spm

    if len(checkpoint) != 1:
        raise UserError(f"tmt export spm takes one -c (got {len(checkpoint)}): the checkpoint whose BPE model to write")
    if quantization != "float32":
        raise UserError("--quantization applies to tmt export ctranslate2 only; tmt export spm copies a BPE model")
    size = export_spm(checkpoint[0], output, force=force)
    typer.echo(f"sentencepiece model of {checkpoint[0]} ({size:,} bytes) -> {output}; prepare with bpe.model={output}")


def _export_ctranslate2(checkpoint: list[Path], output: Path, quantization: str, force: bool) -> None:
    from transformer_mt.export import QUANTIZATIONS, export_ctranslate2

    if quantization not in QUANTIZATIONS:
        raise UserError(f"--quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    out = export_ctranslate2(checkpoint, output, quantization=quantization, force=force)
    typer.echo(f"CTranslate2 model ({quantization}) -> {out}")


def _export_hf(checkpoint: list[Path], output: Path, quantization: str, force: bool) -> None:
    from transformer_mt.export.hf import export_hf

    if quantization != "float32":
        raise UserError("--quantization applies to tmt export ctranslate2 only; tmt export hf writes float32 weights")
    out, gaps = export_hf(checkpoint, output, force=force)
    typer.echo(f"Hugging Face Marian model -> {out} (MarianMTModel / MarianTokenizer.from_pretrained)")
    for gap in gaps:
        typer.echo(f"note: generate differs from tmt's decoding in the {gap}")


@app.command()
def score(
    hyp: Annotated[Path, typer.Option("--hyp", help="Detokenized hypotheses, one per line.")],
    ref: Annotated[Path, typer.Option("--ref", help="Raw references, one per line.")],
    lang: Annotated[
        str, typer.Option("--lang", help="Target language for Moses tokenization; 'de' also splits compounds.")
    ] = "de",
    out_dir: Annotated[
        Path | None,
        typer.Option("--out-dir", "-o", help="Also write the scores to DIR/scores.json, as tmt evaluate does."),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the scores as JSON to this file.")] = None,
) -> None:
    """Score existing output: sacreBLEU with signature, chrF, TER, and the paper's tokenized compound-split BLEU.

    The paper's figure is tensor2tensor's get_ende_bleu.sh: Moses punctuation
    replacement and tokenization, ##AT##-##AT## compound splitting, multi-bleu.
    The scores print to stdout; --out-dir and --json write them as the
    scores.json of tmt evaluate (without its decoding settings).
    """
    from transformer_mt.files import check_output_file
    from transformer_mt.metrics import format_scores, score_files, write_scores

    if json_out is not None:
        check_output_file(json_out, "--json", SCORES_NAME)
    elif out_dir is None:
        require_stdout("the scores", "pass --json FILE or --out-dir DIR")
    scores = score_files(hyp, ref, lang)
    for path in (json_out, out_dir / SCORES_NAME if out_dir else None):
        if path is not None:
            write_scores(path, scores)
    typer.echo(format_scores(scores))


@app.command()
def report(
    run_dirs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Run directories (train.save_dir of `tmt train`), any number; none: the paper alone.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="The Markdown file to write.")] = Path("report.md"),
    plot: Annotated[
        bool,
        typer.Option("--plot/--no-plot", help="Also draw Table 3 as a chart, OUTPUT with .png (needs matplotlib)."),
    ] = True,
) -> None:
    """The paper's Table 2 and Table 3 with your runs beside them, as Markdown (and a PNG chart).

    Every figure of the paper's two tables is on a line marked 'paper'; under
    it come the runs whose config trains that row (model, dropout, label
    smoothing, language pair: matched by config, not by name), or 'not run'.
    For each run: BLEU in both metrics, each labelled (the paper's tokenized
    BLEU and sacreBLEU; newstest2014 for Table 2, newstest2013 for Table 3,
    from the eval directories `tmt evaluate` wrote inside the run directory:
    `tmt evaluate newstest2014`, or `tmt evaluate test` when the config's
    data.test is newstest2014),
    dev perplexity, parameters, training cost (updates x target tokens x FLOPs
    per token, beside the paper's FLOPs), wall time and device. Runs of no row
    (the quickstart's, say) get a table of their own.

    Examples: tmt report runs/table3/* runs/wmt14_en_de_base -o report.md;
    tmt report quickstart/run -o quickstart/report.md
    """
    from transformer_mt.plots import PlotError, report_figure
    from transformer_mt.report import table3_points, write_report
    from transformer_mt.runs import read_run

    runs = [read_run(d) for d in run_dirs or []]
    write_report(runs, output)
    typer.echo(f"report -> {output}")
    if plot:
        try:
            report_figure(table3_points(runs), output.with_suffix(".png"))
            typer.echo(f"chart -> {output.with_suffix('.png')}")
        except PlotError as err:
            typer.echo(f"no chart: {err}", err=True)


@app.command()
def plot(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="One run directory (train.save_dir of `tmt train`), or several to compare.",
            metavar="RUN_DIR",
            show_default=False,
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The PNG file to write.")] = Path("curves.png"),
) -> None:
    """Draw training curves from metrics.jsonl: loss, learning rate, validation BLEU; one run or several compared.

    Top row against updates, bottom row against wall-clock minutes (resumes
    included): training loss (label-smoothed, per target token, averaged
    over each train.log_every window), validation loss and NLL, the learning
    rate, and validation sacreBLEU where the run logged it
    (train.valid_bleu_sentences). Several run directories draw one color
    per run, labelled with its path, on the same axes: two recipes, or two
    seeds of one (their validation NLL, comparable across label smoothing).
    Needs matplotlib (pip install matplotlib).

    Example: tmt plot quickstart/run -o curves.png

    Example: tmt plot runs/race_tmt_60min_s1 runs/race_hour_60min_s1 -o recipes.png
    """
    from transformer_mt.plots import curves_figure
    from transformer_mt.runs import read_run

    curves_figure([read_run(run_dir) for run_dir in run_dirs], output)
    typer.echo(f"curves -> {output}")


class AttentionKind(str, Enum):
    """Which attention of the model `tmt attention` draws."""

    encoder = "encoder"
    decoder = "decoder"
    cross = "cross"


@app.command()
def attention(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-c", help="Checkpoint of `tmt train` or `tmt average`.")],
    text: Annotated[str, typer.Option("--text", "-t", help="The source sentence, raw text.")],
    kind: Annotated[
        AttentionKind,
        typer.Option(
            "--kind",
            help="encoder: encoder self-attention (the paper's Figures 3-5); decoder: the decoder's masked "
            "self-attention; cross: the decoder's attention over the source (rows: the target token predicted).",
        ),
    ] = AttentionKind.encoder,
    layer: Annotated[
        int | None, typer.Option("--layer", "-l", help="1-based layer (default: the one below the top, as 5 of 6).")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option("--target", help="The target sentence (decoder, cross); default: the model's own translation."),
    ] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="The PNG file to write.")] = Path("attention.png"),
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, ...")] = "cpu",
) -> None:
    """Draw one layer's attention weights for one sentence, a heatmap per head, as the paper's Figures 3-5.

    The sentence is normalized and BPE-encoded as `tmt translate` does; rows
    are the tokens attending (queries), columns the tokens attended to (keys),
    darker is more weight, and each row sums to 1. The weights come from an
    explicit softmax(Q K^T / sqrt(d_k)) pass that gives the same outputs as
    the fused kernel training and decoding use. Needs matplotlib (pip install
    matplotlib).

    Examples: tmt attention -c quickstart/run/average.pt --text "The old man sees the red car." -o enc.png;
    the same with --kind cross to see which source tokens each output token reads.
    """
    from transformer_mt.attention_maps import sentence_attention
    from transformer_mt.plots import attention_figure, require_matplotlib

    require_matplotlib()
    found = sentence_attention(checkpoint, text, kind.value, layer, target, device)
    attention_figure(found.panel, output)
    if target is None and kind.value != "encoder":  # the model's own translation was drawn: say what it was
        typer.echo(f"translation: {found.target or EMPTY_TRANSLATION}")
    typer.echo(f"attention -> {output}")


@app.command()
def download(
    dataset: Annotated[str, typer.Argument(help="Only 'wmt14' for now.")],
    pair: Annotated[str, typer.Option("--pair", help="en-de or en-fr.")] = "en-de",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out-dir",
            "--out",
            "-o",
            help="Directory for train.*, newstest2013.*, newstest2014.* (default data/wmt14_en_de|fr).",
        ),
    ] = None,
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="hf: the Hugging Face wmt/wmt14 dataset, streamed (default). "
            "statmt: the original WMT archives (about 1.7 GB for en-de, 6.6 GB for en-fr), checksummed and resumable.",
        ),
    ] = "hf",
    from_dir: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="Use aligned files already on disk: DIR/train.en + train.de (or .fr), and newstest2013.*, "
            "newstest2014.* if present; line counts are checked, files copied.",
        ),
    ] = None,
    train_from: Annotated[
        str | None,
        typer.Option(
            "--train-from",
            help="With --from: copy DIR/NAME.* as the training files when DIR has no train.*, e.g. newstest2013 "
            "as a stand-in corpus to try the pipeline (far too small to reproduce the paper). NAME is a file "
            "prefix inside DIR, not a path.",
        ),
    ] = None,
) -> None:
    """Fetch WMT14 parallel text as plain files (train, newstest2013 dev, newstest2014 test).

    Writes OUT/train.{en,xx}, OUT/newstest2013.{en,xx}, OUT/newstest2014.{en,xx}: UTF-8, one sentence
    per line, aligned. Training pairs with an empty side are dropped (and counted); line breaks and tabs
    inside a sentence become spaces. Dev and test sets come as sacreBLEU has them (newstest2014: the full
    3003 lines). Re-running skips every file already complete; an interrupted run leaves no file that
    looks complete. Without network: --from DIR (see docs/reproducing.md).

    Examples: `tmt download wmt14 --pair en-de` (Hugging Face, into data/wmt14_en_de);
    `tmt download wmt14 --pair en-fr --source statmt`;
    `tmt download wmt14 --from /data/wmt14_en_de --train-from newstest2013` (a stand-in corpus to try the pipeline).
    """
    from transformer_mt.data.download import download_wmt14, format_summary

    if dataset != "wmt14":
        raise UserError(f"unknown dataset {dataset!r}; known: wmt14")
    out = out or Path(f"data/wmt14_{pair.replace('-', '_')}")
    rows = download_wmt14(pair=pair, out=out, source=source, from_dir=from_dir, train_from=train_from)
    typer.echo(format_summary(rows, out))


@app.command()
def quickstart(
    workdir: Annotated[Path, typer.Option("--workdir", "-w", help="Where every file of the run goes.")] = Path(
        "quickstart"
    ),
    set_: SetOpt = None,
) -> None:
    """Run the whole pipeline on the embedded toy corpus in a few minutes on a CPU.

    synth -> prepare -> train -> average -> translate -> evaluate, ending with a
    report: BLEU both ways, example translations and where the files are.
    """
    from transformer_mt.quickstart import run_quickstart

    run_quickstart(workdir, tuple(set_ or ()))


if __name__ == "__main__":
    app()
