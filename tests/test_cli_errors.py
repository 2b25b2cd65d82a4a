"""A user's mistake ends every command the same way: `error: <message>` on one line of stderr, exit 2, no traceback.

The commands run as a user runs them, in a process of their own, so that
what reaches the terminal is checked whole; a bug keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_user_error, tmt
from typer.testing import CliRunner

from transformer_mt import attention_maps, checkpoint, config, evaluate, export, plots, runs
from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.data import bpe, clean, dataset, download_files, prepare, testsets
from transformer_mt.decode import ctranslate2_engine, translate
from transformer_mt.errors import UserError
from transformer_mt.model import positions, quantize
from transformer_mt.train import average, distributed, step
from transformer_mt.train.trainer import train_model


@pytest.mark.parametrize(
    "error",
    [
        config.ConfigError, prepare.PrepareError, step.TrainError, average.AverageError, evaluate.EvaluateError,
        translate.TranslateError, checkpoint.CheckpointError, download_files.DownloadError, clean.InputError,
        bpe.BpeError, testsets.TestsetError, runs.RunError, export.ExportError, quantize.QuantizeError,
        plots.PlotError, attention_maps.AttentionError, ctranslate2_engine.CTranslate2Error,
        dataset.DatasetError, distributed.DistributedError, positions.PositionError,
    ],
)  # fmt: skip
def test_every_stage_error_is_a_user_error(error: type[Exception]) -> None:
    assert issubclass(error, UserError)


def test_a_config_mistake_is_one_line_and_exit_2(tmp_path: Path) -> None:
    assert_user_error(tmt("prepare", str(tmp_path / "missing.yaml")), "missing.yaml")


def test_quickstart_reports_a_stage_error_without_a_traceback(tmp_path: Path) -> None:
    """A corpus the quickstart did not write (here, not UTF-8) stops `prepare`, inside the quickstart."""
    corpus = tmp_path / "qs" / "corpus"
    corpus.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.en").write_bytes(b"one\ntwo\n")
        (corpus / f"{split}.de").write_bytes(b"eins\nzwei\n")
    (corpus / "train.en").write_bytes(b"one\ncaf\xe9\n")
    done = tmt("quickstart", "--workdir", str(tmp_path / "qs"))
    assert_user_error(done, "train.en, line 2: not valid UTF-8")


def test_a_bug_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("transformer_mt.metrics.score_files", broken)
    hyp = tmp_path / "h.txt"
    hyp.write_text("a\n")
    result = CliRunner().invoke(app, ["score", "--hyp", str(hyp), "--ref", str(hyp)])
    assert isinstance(result.exception, ZeroDivisionError)
    assert result.exit_code == 1


# -- each of these was a traceback, a wrong value accepted, or a misleading message


@pytest.fixture(scope="module")
def ckpt(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight checkpoint on the toy vocabulary, with short outputs: decoding it takes a moment."""
    from helpers import write_checkpoint

    decode = dataclasses.replace(prepared_toy.decode, max_len_a=0.5, max_len_b=3, beam_size=2)
    path = tmp_path_factory.mktemp("cli") / "ckpt.pt"
    write_checkpoint(dataclasses.replace(prepared_toy, decode=decode), path, seed=0)
    return path


def invoke(*args: str, stdin: str | None = None) -> str:
    """``tmt ARGS`` in this process; asserts a user error (exit 2, no exception left) and returns what it printed."""
    result = CliRunner().invoke(app, list(args), input=stdin)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    return " ".join(result.output.split())


def test_translate_with_stdin_closed(ckpt: Path) -> None:
    done = tmt("translate", "-c", str(ckpt), close_stdin=True)
    assert_user_error(done, "standard input is closed; pass -i FILE")


def test_translate_output_a_directory_fails_before_any_model_loads(tmp_path: Path) -> None:
    src = tmp_path / "in.en"
    src.write_text("a sentence\n")
    out = invoke("translate", "-c", str(tmp_path / "not_read.pt"), "-i", str(src), "-o", str(tmp_path))
    assert f"-o {tmp_path} is a directory" in out and "not_read.pt" not in out


def test_average_output_a_directory_says_so_and_not_disk_space(ckpt: Path, tmp_path: Path) -> None:
    out = invoke("average", str(ckpt), str(ckpt), "-o", str(tmp_path))
    assert f"-o {tmp_path} is a directory" in out and "disk" not in out


def test_a_device_torch_does_not_know(ckpt: Path) -> None:
    out = invoke("translate", "-c", str(ckpt), "--device", "tpu", stdin="a\n")
    assert "--device tpu: not a device torch knows; use cpu, cuda or cuda:N" in out


def test_cuda_where_torch_has_none(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only build, on any machine
    out = invoke("translate", "-c", str(ckpt), "--device", "cuda", stdin="a\n")
    assert "--device cuda: this machine has no CUDA GPU that torch can use; use --device cpu" in out


def test_score_and_evaluate_refuse_empty_files(ckpt: Path, tmp_path: Path) -> None:
    empty, one = tmp_path / "empty.txt", tmp_path / "one.txt"
    empty.write_text("")
    one.write_text("a line\n")
    assert "empty.txt: the hypothesis file is empty" in invoke("score", "--hyp", str(empty), "--ref", str(one))
    out = invoke("evaluate", "-c", str(ckpt), "--src", str(empty), "--ref", str(one), "-o", str(tmp_path / "e"))
    assert "empty.txt: the source file is empty" in out


def test_a_crafted_checkpoint_never_suggests_an_unsafe_load(tmp_path: Path) -> None:
    path = tmp_path / "crafted.pt"
    path.write_bytes(pickle.dumps({"model": {}}, protocol=2))  # a plain pickle, not torch's zip
    out = invoke("translate", "-c", str(path), stdin="a\n")
    assert "crafted.pt: not a readable checkpoint" in out and "weights_only" not in out


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, where every write fails as on a full disk")
def test_a_full_disk_when_the_run_starts(prepared_toy: Config, tmp_path: Path) -> None:
    """metrics.jsonl on a device where the OS refuses every write with ENOSPC, as a full disk does."""
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    (save_dir / "metrics.jsonl").symlink_to("/dev/full")
    cfg = dataclasses.replace(prepared_toy, train=dataclasses.replace(prepared_toy.train, save_dir=str(save_dir)))
    with pytest.raises(UserError, match=r"metrics\.jsonl: cannot write \(No space left on device\); free space"):
        train_model(cfg)


def test_ctrl_c_in_interactive_translation_exits_130_quietly(ckpt: Path) -> None:
    """The translation of each line is out before Ctrl-C; then no traceback, the shell's status for SIGINT.

    The child gets SIGINT's default disposition, as a command at a terminal has: a test run started in the
    background of a non-interactive shell inherits SIGINT ignored, and the child would then never see it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", "translate", "-c", str(ckpt), "--buffer-lines", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        proc.stdin.write(b"The old man sees the red car.\n")
        proc.stdin.flush()
        first = proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert first.endswith(b"\n") and rest == b""
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode()


@pytest.mark.parametrize(
    "command",
    [
        ["translate", "-c", "{ck}", "-i", "{text}", "-o", "{below}/out.de"],
        ["evaluate", "-c", "{ck}", "--src", "{text}", "--ref", "{text}", "-o", "{below}/eval"],
        ["score", "--hyp", "{text}", "--ref", "{text}", "-o", "{below}/scored"],
        ["average", "{ck}", "{ck}", "-o", "{below}/avg.pt"],
        ["export", "spm", "-c", "{ck}", "-o", "{below}/spm.model"],
        ["export", "hf", "-c", "{ck}", "-o", "{below}/hf"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
@pytest.mark.slow
def test_an_output_below_a_regular_file_is_one_line(command: list[str], toy_ckpt: Path, tmp_path: Path) -> None:
    """-o below a regular file: refused before any work, one line, exit 2, nothing written."""
    below = tmp_path / "a_file"
    below.write_text("not a directory\n")
    text = tmp_path / "in.en"
    text.write_text("a b c\n")
    args = [part.format(ck=toy_ckpt, text=text, below=below) for part in command]
    result = subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(below) in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert below.read_text() == "not a directory\n"


@pytest.mark.parametrize(
    "command",
    [
        ["report", "{run}", "-o", "{below}/report.md"],
        ["plot", "{run}", "-o", "{below}/deeper/curves.png"],
        ["attention", "-c", "{run}", "--text", "a b c", "-o", "{below}/attention.png"],
    ],
    ids=lambda c: c[0],
)
@pytest.mark.slow
def test_a_directory_wanted_where_a_file_is_names_that_file(command: list[str], toy_run: Path, tmp_path: Path) -> None:
    """report, plot and attention make their output's directory: below a regular file, the message names the file
    (before: the system's bare "File exists")."""
    pytest.importorskip("matplotlib")
    below = tmp_path / "a_file"
    below.write_text("not a directory\n")
    args = [part.format(run=toy_run, below=below) for part in command]
    result = subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert f"error: {below} is a file, not a directory; choose an output path in a directory" in result.stderr
    assert "Traceback" not in result.stderr and below.read_text() == "not a directory\n"


def test_a_closed_stdout_is_one_line(toy_ckpt: Path, tmp_path: Path) -> None:
    text = tmp_path / "in.en"
    text.write_text("a b c\n")
    cmd = f"{sys.executable} -m transformer_mt translate -c {toy_ckpt} -i {text} >&-"
    result = subprocess.run(["bash", "-c", cmd], capture_output=False, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 2 and "standard output is closed" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_reader_that_stops_early_ends_translate_quietly_with_141(toy_ckpt: Path, tmp_path: Path) -> None:
    """`tmt translate | head -1` (here `| true`, gone before the first line is written): the shell's status for
    a tool stopped by a closed pipe, no message, no traceback, and no translating on for nobody."""
    text = tmp_path / "in.en"
    text.write_text("a b c\n" * 50)
    cmd = f"{sys.executable} -m transformer_mt translate -c {toy_ckpt} -i {text} --window-lines 5 | true"
    result = subprocess.run(
        ["bash", "-c", f"{cmd}; exit ${{PIPESTATUS[0]}}"], stderr=subprocess.PIPE, text=True, timeout=120
    )
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "error" not in result.stderr, result.stderr


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero, a file of no line end")
def test_translate_of_a_file_without_line_ends_is_one_line(toy_ckpt: Path, tmp_path: Path) -> None:
    """-i /dev/zero: refused at the first 1 MiB of its first line, naming it, nothing written to -o."""
    out = tmp_path / "out.de"
    assert_user_error(
        tmt("translate", "-c", str(toy_ckpt), "-i", "/dev/zero", "-o", str(out)), "/dev/zero, line 1: longer than"
    )
    assert list(tmp_path.iterdir()) == []


def test_translate_refuses_a_position_table_past_memory(toy_ckpt: Path) -> None:
    """--set model.max_positions=10^8 was a traceback allocating a 51 GB table; now config.validate's bound."""
    out = invoke("translate", "-c", str(toy_ckpt), "--set", "model.max_positions=100000000", stdin="a\n")
    assert "model.max_positions must be at most 65536, got 100000000" in out


def test_a_torchrun_variable_not_an_integer_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(distributed.DistributedError, match=r"WORLD_SIZE='two' is not an integer"):
        distributed.setup("cpu")


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("CUDA out of memory"), MemoryError(), RuntimeError("can't allocate memory")]
)
def test_out_of_memory_while_translating_suggests_smaller_batches(
    toy_ckpt: Path, tmp_path: Path, error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(translate.Translator, "search", explode)
    out = tmp_path / "out.de"
    src = tmp_path / "in.en"
    src.write_text("a b c\n")
    text = invoke("translate", "-c", str(toy_ckpt), "-i", str(src), "-o", str(out), "--batch-tokens", "600")
    assert "out of memory translating a batch of 1 sentences" in text and "try --batch-tokens 300" in text
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_score_with_stdout_closed_is_one_line(tmp_path: Path) -> None:
    """Python drops what is printed to a closed stdout: score ended 0 with its scores nowhere."""
    (tmp_path / "h.txt").write_text("a b c\n")
    cmd = f"{sys.executable} -m transformer_mt score --hyp h.txt --ref h.txt"
    result = subprocess.run(["bash", "-c", f"{cmd} >&-"], cwd=tmp_path, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: standard output is closed, so the scores have nowhere to go; pass --json FILE or --out-dir DIR"
    ]
    kept = subprocess.run(["bash", "-c", f"{cmd} --json s.json >&-"], cwd=tmp_path, timeout=120)
    assert kept.returncode == 0 and json.loads((tmp_path / "s.json").read_text())["chrf"]["score"] == 100.0


def test_a_deleted_working_directory_is_one_line(toy_ckpt: Path, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    cmd = f"cd {gone} && rmdir {gone} && echo 'a b' | {sys.executable} -m transformer_mt translate -c {toy_ckpt}"
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.stdout == ""
    assert_user_error(done, "the current directory no longer exists", "cd to an existing directory")
