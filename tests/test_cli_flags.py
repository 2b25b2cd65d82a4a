"""Flags mean the same in every command: -i the input file, -o where the output goes, -c a checkpoint file.

`-o` names a file where a command writes one file (`--output`) and a
directory where it writes several (`--out-dir`); the long name says which.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from transformer_mt.cli import app

DIRECTORY_OUTPUTS = {"synth", "evaluate", "export", "download", "score"}  # score: --out-dir; --json is its file


def _options(command: click.Command) -> dict[str, list[str]]:
    """Each short flag of ``command`` and the names of the option it belongs to."""
    return {opt: list(p.opts) for p in command.params for opt in p.opts if not opt.startswith("--")}


@pytest.fixture(scope="module")
def commands() -> dict[str, click.Command]:
    return typer.main.get_command(app).commands


def test_o_is_output_for_a_file_and_out_dir_for_a_directory(commands: dict[str, click.Command]) -> None:
    with_o = {name: _options(c)["-o"] for name, c in commands.items() if "-o" in _options(c)}
    assert set(with_o) >= {"translate", "average", "evaluate", "score", "export", "report", "plot", "attention"}
    for name, names in with_o.items():
        expected = "--out-dir" if name in DIRECTORY_OUTPUTS else "--output"
        assert names[0] == expected, f"tmt {name}: -o is {names}"


def test_i_is_the_input_file_of_the_commands_that_translate_a_file_only(commands: dict[str, click.Command]) -> None:
    translating = ["translate", "backtranslate", "distill"]
    assert [name for name, c in commands.items() if "-i" in _options(c)] == translating
    for name in translating:
        assert _options(commands[name])["-i"] == ["--input", "-i"]


def test_score_writes_scores_json_as_evaluate_does(tmp_path: Path) -> None:
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text("Der alte Mann sieht das rote Auto .\nEin Hund .\n", encoding="utf-8")
    ref.write_text("Der alte Mann sieht das rote Auto .\nEine Katze .\n", encoding="utf-8")
    args = ["score", "--hyp", str(hyp), "--ref", str(ref), "-o", str(tmp_path / "out"), "--json", str(tmp_path / "s")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "out" / "scores.json").read_text())
    assert written == json.loads((tmp_path / "s").read_text())
    assert {"sentences", "sacrebleu", "chrf", "paper_bleu"} <= written.keys() and written["sentences"] == 2
    assert f"sacreBLEU   {written['sacrebleu']['score']:6.2f}" in result.output


def test_a_run_directory_given_as_checkpoint_decodes_with_its_average(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    result = CliRunner().invoke(app, ["translate", "-c", str(run)], input="a\n")
    assert result.exit_code == 2 and f"tmt average {run}" in result.output  # nothing to name yet
    for name in ("checkpoint_best.pt", "average.pt"):
        (run / name).write_bytes(b"")
    result = CliRunner().invoke(app, ["translate", "-c", str(run)], input="a\n")
    message = " ".join(result.output.split())
    assert f"{run} is a run directory: decoding with {run / 'average.pt'}" in message  # said, then tried
    assert f"{run / 'average.pt'}: not a readable checkpoint" in message


@pytest.mark.parametrize("name", ["translate", "evaluate"])
def test_help_says_what_repeated_c_does(commands: dict[str, click.Command], name: str) -> None:
    """Weight averaging (the default) and ensembling are both named flags, and --help says which one -c -c does."""
    (combine,) = [p for p in commands[name].params if "--ensemble" in p.opts]
    assert combine.secondary_opts == ["--average"] and combine.default is False
    assert "--average (the default" in combine.help and "mean of their log-probabilities" in combine.help
    (checkpoint,) = [p for p in commands[name].params if "-c" in p.opts]
    assert "--ensemble" in checkpoint.help  # -c itself points at the choice


@pytest.mark.parametrize("command", ["prepare", "train"])
def test_the_resolved_config_prints_only_with_verbose(command: str, tmp_path: Path, monkeypatch) -> None:
    """About 75 lines before every run, even before an error, buried what mattered; the run directory keeps it."""
    monkeypatch.chdir(tmp_path)  # data.train of tmt:base.yaml is missing here: the command stops after loading
    quiet = CliRunner().invoke(app, [command, "tmt:base.yaml"])
    loud = CliRunner().invoke(app, [command, "tmt:base.yaml", "--verbose"])
    assert quiet.exit_code == loud.exit_code == 2
    assert "# resolved config" not in quiet.output and "d_model: 512" not in quiet.output
    assert "# resolved config (tmt:base.yaml)" in loud.output and "  d_model: 512\n" in loud.output


def test_version_prints_the_packages_version_and_runs_no_command() -> None:
    import re

    from transformer_mt import __version__

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^version = "(.+)"$', pyproject, re.M).group(1)
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"tmt {__version__}\n" and __version__ == declared


def test_help_wraps_at_80_columns_and_cuts_nothing(commands: dict[str, click.Command]) -> None:
    """At 80 columns every help text is whole, wrapped onto more lines: no "…" where a text was cut, every line
    within the width, each option's and each command's text all there (compared without the wrapping's spaces)."""

    def help_of(*args: str) -> str:
        result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert "…" not in result.output
        assert max(map(len, result.output.splitlines())) <= 80, result.output
        return "".join(result.output.split())

    top = help_of()
    for name, command in commands.items():
        assert "".join(command.get_short_help_str(10**6).split()) in top, name
        text = help_of(name)
        for param in command.params:
            if getattr(param, "help", None):
                assert "".join(param.help.split()) in text, f"tmt {name} {param.opts}"
    assert "".join(commands["translate"].params[0].opts) != ""  # the loop above saw options
