"""`tmt translate` and `Translator`: line count and order, empty lines, n-best, averaging, bad input.

A random-weight model on the toy BPE vocabulary is enough here: its outputs
differ from sentence to sentence, so a translation put back on the wrong line
is caught by comparing the batched result with one-at-a-time translation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import typer
from helpers import load_state, save_state, write_checkpoint
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.lines import empty_outputs, read_input_lines
from transformer_mt.decode.load import LoadError, decode_flags, override_config
from transformer_mt.decode.translate import TranslateError, Translator, load_translator
from transformer_mt.errors import UserError
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def toy_cfg(prepared_toy: Config) -> Config:
    # Short outputs keep the random model fast: at most half the source length + 4 tokens.
    return dataclasses.replace(
        prepared_toy, decode=dataclasses.replace(prepared_toy.decode, max_len_a=0.5, max_len_b=4, beam_size=3)
    )


@pytest.fixture(scope="module")
def ckpts(toy_cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("ckpt")
    paths = [root / "a.pt", root / "b.pt"]
    for seed, path in enumerate(paths):
        write_checkpoint(toy_cfg, path, seed)
    return paths


@pytest.fixture(scope="module")
def translator(ckpts: list[Path]) -> Translator:
    t = Translator.from_checkpoints(ckpts[:1], device="cpu")
    t.show_progress = False
    return t


@pytest.fixture(scope="module")
def test_lines(toy_cfg: Config) -> list[str]:
    return Path(f"{toy_cfg.data.test}.{toy_cfg.data.src_lang}").read_text(encoding="utf-8").splitlines()[:8]


def test_order_and_empty_lines_kept(translator: Translator, test_lines: list[str]) -> None:
    lines = [test_lines[0], "", *test_lines[1:5], "   \t ", test_lines[5], ""]
    batched = translator.translate_lines(lines)
    assert len(batched) == len(lines)
    assert batched[1] == batched[6] == batched[8] == ""
    one_by_one = [translator.translate_lines([line])[0] for line in lines]
    assert batched == one_by_one
    assert len(set(batched)) > 3  # the outputs really differ, so a shuffled line would be noticed


def test_small_batches_give_same_output(ckpts: list[Path], test_lines: list[str], translator: Translator) -> None:
    small = Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=["decode.batch_tokens=20"])
    small.show_progress = False
    assert small.translate_lines(test_lines) == translator.translate_lines(test_lines)


def test_nbest(translator: Translator, test_lines: list[str]) -> None:
    results = translator.translate_lines_nbest(test_lines[:3] + [""], nbest=3)  # beam 3 (toy_cfg)
    assert [len(r) for r in results] == [3, 3, 3, 3]
    for hyps in results[:3]:
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert all(h.log_prob <= 0 for h in hyps)
    assert results[0][0].text == translator.translate_lines(test_lines[:1])[0]
    assert results[3][0].text == ""
    with pytest.raises(TranslateError, match=r"--nbest \(4\) must be at least 1 and cannot exceed --beam \(3\)"):
        translator.translate_lines_nbest(test_lines[:1], nbest=4)


def test_cli_files_and_nbest_format(ckpts: list[Path], test_lines: list[str], tmp_path: Path, translator) -> None:
    src = tmp_path / "in.en"
    lines = [test_lines[0], "", test_lines[1]]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.de"
    result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), "-i", str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8").split("\n") == [*translator.translate_lines(lines), ""]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind

    result = CliRunner().invoke(
        app, ["translate", "-c", str(ckpts[0]), "--nbest", "2", "--beam", "3"], input=src.read_bytes()
    )
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "1", "2", "2"]
    assert all(len(r) == 3 for r in rows)
    assert float(rows[0][1]) >= float(rows[1][1])
    assert rows[2][2] == rows[3][2] == ""


def test_stdin_without_final_newline_and_unicode_separators(ckpts: list[Path], test_lines: list[str]) -> None:
    text = f"{test_lines[0]}\r\n{test_lines[1]} \u2028 {test_lines[2]}\n\n{test_lines[3]}"
    result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), "--beam", "1"], input=text.encode())
    assert result.exit_code == 0, result.output
    out = result.stdout.split("\n")
    assert len(out) == 5 and out[-1] == ""  # four input lines, four output lines
    assert out[2] == ""


def test_averaging_on_the_fly(ckpts: list[Path], toy_cfg: Config, tmp_path: Path) -> None:
    averaged = Translator.from_checkpoints(ckpts, device="cpu", overrides=["decode.beam_size=2"])
    a = torch.load(ckpts[0], weights_only=True)["model"]
    b = torch.load(ckpts[1], weights_only=True)["model"]
    state = averaged.model.state_dict()
    for key in a:
        assert torch.allclose(state[key], (a[key].double() + b[key].double()).div(2).float(), atol=1e-7), key
    assert averaged.cfg.decode.beam_size == 2  # the flag overrides the checkpoint's decode section
    assert averaged.cfg.decode.len_penalty == toy_cfg.decode.len_penalty


def test_averaging_on_the_fly_equals_tmt_average(ckpts: list[Path], toy_cfg: Config, tmp_path: Path) -> None:
    # The newest input (b.pt, update 1) holds a different decode section: both paths must take it, not the first's.
    newer = dataclasses.replace(toy_cfg, decode=dataclasses.replace(toy_cfg.decode, beam_size=2, len_penalty=1.0))
    write_checkpoint(newer, tmp_path / "b.pt", seed=1)
    inputs = [ckpts[0], tmp_path / "b.pt"]
    result = CliRunner().invoke(app, ["average", str(inputs[0]), str(inputs[1]), "-o", str(tmp_path / "avg.pt")])
    assert result.exit_code == 0, result.output
    assert f"averaged 2 checkpoints ({inputs[0]}, {inputs[1]}) -> {tmp_path / 'avg.pt'}" in result.output
    written = load_state(tmp_path / "avg.pt")
    on_the_fly = Translator.from_checkpoints(inputs, device="cpu")
    from_file = Translator.from_checkpoints([tmp_path / "avg.pt"], device="cpu")
    fly, saved = on_the_fly.model.state_dict(), from_file.model.state_dict()
    assert fly.keys() == saved.keys() == written["model"].keys()
    assert all(torch.equal(fly[k], saved[k]) for k in fly)
    assert on_the_fly.cfg == from_file.cfg and on_the_fly.cfg.decode.beam_size == 2
    assert written["config"] == newer.to_dict()
    on_the_fly.show_progress = from_file.show_progress = False
    lines = ["a short test .", "another line ."]
    assert on_the_fly.translate_lines(lines) == from_file.translate_lines(lines)


def test_averaging_rejects_different_bpe_models(ckpts: list[Path], toy_cfg: Config, tmp_path: Path) -> None:
    state = torch.load(ckpts[1], weights_only=True)
    state["spm_model"] = state["spm_model"][:-1]
    save_state(tmp_path / "other_bpe.pt", state)
    with pytest.raises(UserError, match=r"other_bpe\.pt: a different BPE model"):
        Translator.from_checkpoints([ckpts[0], tmp_path / "other_bpe.pt"], device="cpu")


def test_set_overrides_decode_and_max_positions(ckpts: list[Path]) -> None:
    t = Translator.from_checkpoints(
        ckpts[:1], device="cpu",
        overrides=["decode.beam_size=2", "decode.max_len_b=7", "decode.len_penalty_form=fairseq", "model.max_positions=2048"],
    )  # fmt: skip
    assert (t.cfg.decode.max_len_b, t.cfg.decode.len_penalty_form, t.cfg.decode.beam_size) == (7, "fairseq", 2)
    assert t.cfg.model.max_positions == t.model.positions.max_positions == 2048
    assert t.model.positions.table.shape[0] == 2048
    with pytest.raises(UserError, match=r"--set model.d_model=8: a trained checkpoint only takes decode\.\*"):
        Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=["model.d_model=8"])
    with pytest.raises(UserError, match="unknown key 'decode.beam'"):
        Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=["decode.beam=8"])
    with pytest.raises(UserError, match="decode.nbest"):
        Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=["decode.nbest=0"])


def test_set_cannot_grow_learned_positions(toy_cfg: Config, tmp_path: Path) -> None:
    learned = dataclasses.replace(toy_cfg, model=dataclasses.replace(toy_cfg.model, positions="learned"))
    write_checkpoint(learned, tmp_path / "learned.pt", 0)
    with pytest.raises(UserError, match="learned positions"):
        Translator.from_checkpoints([tmp_path / "learned.pt"], device="cpu", overrides=["model.max_positions=4096"])


def test_cli_set(ckpts: list[Path], test_lines: list[str]) -> None:
    args = ["translate", "-c", str(ckpts[0]), "--beam", "1", "--set", "model.max_positions=4"]
    result = CliRunner().invoke(app, args, input=f"{test_lines[0]}\n".encode())
    assert result.exit_code == 0, result.output
    assert "max_positions (4)" in result.output and "first 3 tokens" in result.output  # the override was applied
    result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), "--set", "train.lr=1"], input=b"a\n")
    assert result.exit_code == 2 and "only takes decode.* keys" in result.output


def test_invalid_utf8_names_the_line(ckpts: list[Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"fine\nalso fine\ncaf\xe9 latin1\n")
    with pytest.raises(UserError, match=r"bad\.en, line 3: not valid UTF-8 \(byte 0xe9 at column 4\)"):
        read_input_lines(bad)
    out = tmp_path / "out.de"
    result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), "-i", str(bad), "-o", str(out)])
    assert result.exit_code == 2 and "line 3" in result.output
    assert not out.exists()


def test_overlong_line_is_truncated_with_warning(ckpts: list[Path], test_lines: list[str], capsys) -> None:
    t = Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=["decode.beam_size=1"])
    t.show_progress = False
    t.cfg = dataclasses.replace(t.cfg, model=dataclasses.replace(t.cfg.model, max_positions=24))
    long_line = " ".join(test_lines[:6])
    out = t.translate_lines([test_lines[0], long_line])
    assert len(out) == 2
    err = capsys.readouterr().err
    assert "line 2:" in err and "first 23 tokens" in err
    assert len(t.encode(1, long_line)) == 24  # 23 tokens + EOS fill the model's positions


def test_bad_flags(ckpts: list[Path]) -> None:
    with pytest.raises(
        UserError, match=r"decode.nbest \(--nbest\) \(3\) .* cannot exceed decode.beam_size \(--beam\) \(2\)"
    ):
        Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=decode_flags(beam=2, nbest=3))
    with pytest.raises(UserError, match="decode.beam_size must be positive, got 0"):
        Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=decode_flags(beam=0))
    with pytest.raises(UserError, match="decode.len_penalty"):
        Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=decode_flags(lenpen=float("nan")))
    for flags in (["--beam", "2", "--nbest", "3"], ["--beam", "0"], ["--lenpen", "nan"], ["--batch-tokens", "0"]):
        result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), *flags], input=b"a\n")
        assert result.exit_code == 2 and result.output.startswith("error: "), (flags, result.output)
        assert "decode." in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_decode_flags_are_overrides() -> None:
    assert decode_flags() == []
    assert decode_flags(beam=2, lenpen=0.5, nbest=1, batch_tokens=100, quantize="int8") == [
        "decode.beam_size=2", "decode.len_penalty=0.5", "decode.nbest=1", "decode.batch_tokens=100",
        "decode.quantize=int8",
    ]  # fmt: skip


def test_smaller_beam_shortens_the_stored_nbest(ckpts: list[Path]) -> None:
    t = Translator.from_checkpoints(ckpts[:1], device="cpu", overrides=decode_flags(beam=4, nbest=3))
    assert (t.cfg.decode.beam_size, t.cfg.decode.nbest) == (4, 3)
    cfg = override_config(t.cfg, decode_flags(beam=2))  # a stored n-best of 3 follows the smaller beam
    assert (cfg.decode.beam_size, cfg.decode.nbest) == (2, 2)


def test_empty_output_rule_warns_above_five_percent() -> None:
    sources = [f"line {i}" for i in range(40)] + ["", " \t "]
    outputs = [f"Zeile {i}" for i in range(40)] + ["", ""]
    assert empty_outputs(sources, outputs) == (0, None)  # empty input lines are neither counted nor a reason
    assert empty_outputs(sources, ["", " ", *outputs[2:]]) == (2, None)  # 2 of 40 = 5%: not above the limit
    empty, warning = empty_outputs(sources, ["", "", "", *outputs[3:]])  # 3 of 40 = 7.5%
    assert empty == 3 and warning is not None
    assert "3 of 40 non-empty input lines (7.5%) got an empty translation" in warning
    assert "undertrained" in warning and "train.warmup" in warning
    assert empty_outputs([], []) == (0, None)


def test_cli_warns_when_translations_come_out_empty(
    ckpts: list[Path], toy_cfg: Config, test_lines: list[str], tmp_path: Path
) -> None:
    silent = tmp_path / "silent.pt"
    write_checkpoint(toy_cfg, silent, seed=0, silent=True)
    text = "".join(line + "\n" for line in [*test_lines[:4], ""]).encode()
    result = CliRunner().invoke(app, ["translate", "-c", str(silent), "--beam", "2", "--nbest", "2"], input=text)
    assert result.exit_code == 0, result.output
    best = result.stdout.splitlines()[::2]  # the best of each line's two hypotheses is empty
    assert [row.split("\t")[2] for row in best] == [""] * 5
    assert "warning: 4 of 4 non-empty input lines (100.0%) got an empty translation" in result.stderr
    result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), "--beam", "1"], input=text)
    assert result.exit_code == 0, result.output
    assert all(result.stdout.splitlines()[:4]) and "empty translation" not in result.stderr


# -- ensembles: several checkpoints decoded together


def test_an_ensemble_of_a_checkpoint_with_itself_translates_as_the_checkpoint(
    ckpts: list[Path], test_lines: list[str], translator: Translator
) -> None:
    same = Translator.from_checkpoints([ckpts[0], ckpts[0]], device="cpu", ensemble=True)
    same.show_progress = False
    assert isinstance(same.model, Ensemble) and len(same.model.models) == 2
    lines = [*test_lines[:5], ""]
    for mine, its in zip(same.translate_lines_nbest(lines, 3), translator.translate_lines_nbest(lines, 3), strict=True):
        assert [t.text for t in mine] == [t.text for t in its]
        assert [t.score for t in mine] == pytest.approx([t.score for t in its], abs=1e-5)


def test_an_ensemble_is_not_the_average(ckpts: list[Path], test_lines: list[str]) -> None:
    """Two random models: the mean of their log-probabilities, one model each, not the model of mean weights."""
    ensemble = Translator.from_checkpoints(ckpts, device="cpu", ensemble=True)
    averaged = Translator.from_checkpoints(ckpts, device="cpu")
    assert isinstance(ensemble.model, Ensemble) and isinstance(averaged.model, Transformer)
    for member, path in zip(ensemble.model.models, ckpts, strict=True):
        saved = torch.load(path, weights_only=True)["model"]
        assert all(torch.equal(member.state_dict()[k], saved[k]) for k in saved)  # each model whole
    ensemble.show_progress = averaged.show_progress = False
    assert ensemble.translate_lines(test_lines) != averaged.translate_lines(test_lines)


def test_an_ensemble_takes_the_first_decode_section_and_the_smallest_max_positions(
    ckpts: list[Path], toy_cfg: Config, tmp_path: Path
) -> None:
    other = dataclasses.replace(
        toy_cfg, decode=dataclasses.replace(toy_cfg.decode, beam_size=2),
        model=dataclasses.replace(toy_cfg.model, max_positions=64, d_ff=48),
    )  # fmt: skip
    write_checkpoint(other, tmp_path / "other.pt", seed=3)
    t = Translator.from_checkpoints([ckpts[0], tmp_path / "other.pt"], device="cpu", ensemble=True)
    assert t.cfg.decode == toy_cfg.decode and t.cfg.model.max_positions == 64
    assert [m.cfg.d_ff for m in t.model.models] == [toy_cfg.model.d_ff, 48]  # each model in its own shape


def test_an_ensemble_refuses_different_vocabularies(ckpts: list[Path], tmp_path: Path) -> None:
    state = torch.load(ckpts[1], weights_only=True)
    state["spm_model"] = state["spm_model"][:-1]
    save_state(tmp_path / "other_bpe.pt", state)
    with pytest.raises(LoadError, match=r"other_bpe\.pt: a different BPE model .* than .*a\.pt; an ensemble"):
        Translator.from_checkpoints([ckpts[0], tmp_path / "other_bpe.pt"], device="cpu", ensemble=True)
    with pytest.raises(TranslateError, match="--ensemble runs tmt's own search"):
        load_translator([tmp_path / "ct2"], "ctranslate2", ensemble=True)


def test_cli_ensemble_and_average_flags(ckpts: list[Path], test_lines: list[str]) -> None:
    text = "".join(line + "\n" for line in [test_lines[0], "", test_lines[1]]).encode()
    both = ["translate", "-c", str(ckpts[0]), "-c", str(ckpts[1]), "--beam", "2"]
    runs = {flag: CliRunner().invoke(app, [*both, *flag], input=text) for flag in [(), ("--average",), ("--ensemble",)]}
    assert all(r.exit_code == 0 for r in runs.values()), [r.output for r in runs.values()]
    expected = {}
    for ensemble in (False, True):
        t = Translator.from_checkpoints(ckpts, device="cpu", overrides=["decode.beam_size=2"], ensemble=ensemble)
        t.show_progress = False
        expected[ensemble] = "".join(line + "\n" for line in t.translate_lines([test_lines[0], "", test_lines[1]]))
    assert runs[()].stdout == runs[("--average",)].stdout == expected[False]  # the default averages the weights
    assert runs[("--ensemble",)].stdout == expected[True]
    for command in ("translate", "evaluate"):  # --help says what a repeated -c does without a flag
        params = typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]
        (flag,) = [p for p in params if p.name == "ensemble"]
        assert (flag.opts, flag.secondary_opts, flag.default) == (["--ensemble"], ["--average"], False)
        assert "--average (the default" in flag.help and "mean of their log-probabilities" in flag.help


def test_a_positional_input_file_is_pointed_to_i(ckpts: list[Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["translate", "-c", str(ckpts[0]), "file.en"])
    assert result.exit_code == 2 and f"tmt translate -c {ckpts[0]} -i file.en" in result.output
