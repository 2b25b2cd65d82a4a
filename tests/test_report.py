"""`tmt report` and the run directory it reads (transformer_mt/runs.py, transformer_mt/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import metric_records
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import load_config, save_config
from transformer_mt.model.transformer import Transformer, count_parameters
from transformer_mt.paper import TABLE2, TABLE3
from transformer_mt.report import NOT_RUN, report_markdown
from transformer_mt.runs import RunError, read_run

CONFIGS = Path(__file__).parent.parent / "configs"


def tables(text: str) -> dict[str, list[dict[str, str]]]:
    """The Markdown tables of a report by their section title: one dict (header -> cell) per line."""
    found: dict[str, list[dict[str, str]]] = {}
    title, header = "", None
    for line in text.splitlines():
        if line.startswith("## "):
            title, header = line[3:], None
        elif line.startswith("|---"):
            continue
        elif line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if header is None:
                header = cells
                found[title] = []
            else:
                assert len(cells) == len(header), line
                found[title].append(dict(zip(header, cells, strict=True)))
    return found


def table(text: str, starts: str) -> list[dict[str, str]]:
    return next(rows for title, rows in tables(text).items() if title.startswith(starts))


def assert_every_paper_figure_is_labelled(text: str) -> None:
    """Each figure of the paper's Tables 2 and 3 sits on its row's 'paper' line, under the column that names it."""
    t2 = {line["model"]: line for line in table(text, "Table 2") if line["source"] == "paper"}
    assert list(t2) == [row.model for row in TABLE2]
    for row in TABLE2:
        line = t2[row.model]
        for column, figure in (
            ("BLEU EN-DE (paper BLEU)", row.bleu_en_de),
            ("BLEU EN-FR (paper BLEU)", row.bleu_en_fr),
        ):
            assert line[column] == ("" if figure is None else f"{figure:g}"), (row.model, column)
        for column, figure in (("training cost EN-DE (FLOPs)", row.flops_en_de), ("training cost EN-FR (FLOPs)", row.flops_en_fr)):  # fmt: skip
            if figure is not None:
                mantissa, exponent = line[column].split("·10^")
                assert float(mantissa) * 10 ** int(exponent) == pytest.approx(figure), (row.model, column)
    t3 = [line for line in table(text, "Table 3") if line["source"] == "paper"]
    assert len(t3) == len(TABLE3)
    for row, line in zip(TABLE3, t3, strict=True):
        assert (line["PPL (dev)"], line["BLEU (dev, paper BLEU)"]) == (f"{row.ppl:.2f}", f"{row.bleu:g}"), row.name
        assert line["params ×10⁶"] == ("" if row.params_m is None else str(row.params_m)), row.name


def test_report_of_no_runs_is_the_papers_tables_with_every_row_not_run() -> None:
    text = report_markdown([])
    assert_every_paper_figure_is_labelled(text)
    not_run = [line for title in ("Table 2", "Table 3") for line in table(text, title) if NOT_RUN in line.values()]
    assert len(not_run) == 2 + len(TABLE3)  # Table 2's two Transformer rows, every Table 3 row
    assert "paper BLEU" in text and "sacreBLEU" in text and "9.5 TFLOPS" in text  # what each figure is, said once


def test_report_of_the_toy_run_lists_it_with_its_own_figures(toy_run: Path) -> None:
    run = read_run(toy_run)
    text = report_markdown([run])
    assert_every_paper_figure_is_labelled(text)
    (line,) = table(text, "Runs that are no row")
    assert text.index("Runs that are no row") < text.index("## Table 2")  # the user's own run first
    scores = json.loads((toy_run / "eval_toy-test" / "scores.json").read_text())
    valid = [r for r in metric_records(toy_run) if r["kind"] == "valid"]
    vocab = run.start["vocab_size"]
    assert line["run"] == f"tmt: `{toy_run}`" and line["pair"] == "en-de" and line["updates"] == "6"
    assert line["test set"] == "toy-test"
    assert line["paper BLEU"] == f"{scores['paper_bleu']['score']:.2f}"
    assert line["sacreBLEU"] == f"{scores['sacrebleu']['score']:.2f}"
    assert line["PPL (dev)"] == f"{valid[-1]['ppl']:.2f}"
    assert line["params ×10⁶"] == f"{count_parameters(Transformer(run.cfg.model, vocab)) / 1e6:.1f}"
    assert line["device"].startswith("CPU") and line["wall time"].endswith("min")
    flops = 6 * run.tokens_per_update * run.start["flops_per_token"]
    mantissa, exponent = line["training cost (FLOPs)"].removesuffix(" (model)").split("·10^")
    assert float(mantissa) * 10 ** int(exponent) == pytest.approx(flops, rel=0.05)


def _fake_run(root: Path, config: Path, scores: dict[str, tuple[float, float]], **start) -> Path:
    """A run directory as `tmt train` and `tmt evaluate` leave it: config, metric records, one scores.json per set."""
    root.mkdir(parents=True)
    save_config(load_config(config), root / "config.yaml")
    records = [
        {"kind": "start", "update": 0, "parameters": 55_990_784, "flops_per_token": 1e9, "device": "NVIDIA H100",
         "world_size": 8, **start},
        {"kind": "train", "update": 100, "loss": 5.0, "lr": 1e-3, "tgt_tokens_per_update": 24_000, "minutes": 40.0},
        {"kind": "train", "update": 200, "loss": 4.0, "lr": 9e-4, "tgt_tokens_per_update": 26_000, "minutes": 80.0},
        {"kind": "valid", "update": 200, "loss": 4.1, "nll": 1.6, "ppl": 4.953, "minutes": 81.0},
        {"kind": "end", "update": 200, "minutes": 90.0, "stop_reason": "max_updates=200"},
    ]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    for testset, (paper, sacre) in scores.items():
        (root / f"eval_{testset}").mkdir()
        result = {"testset": testset, "paper_bleu": {"score": paper}, "sacrebleu": {"score": sacre}}
        (root / f"eval_{testset}" / "scores.json").write_text(json.dumps(result))
    return root


def test_runs_sit_on_the_rows_their_configs_train(tmp_path: Path) -> None:
    dk16 = _fake_run(tmp_path / "dk16", CONFIGS / "table3" / "b_dk16.yaml", {"newstest2013": (24.81, 24.02)})
    base = _fake_run(
        tmp_path / "base", CONFIGS / "base.yaml", {"newstest2013": (25.5, 24.9), "newstest2014": (27.1, 26.4)}
    )
    text = report_markdown([read_run(dk16), read_run(base)])
    assert_every_paper_figure_is_labelled(text)
    t3 = table(text, "Table 3")
    mine = [line for line in t3 if line["source"] == f"tmt: `{dk16}`"]
    assert mine == [
        {
            "row": "(B)",
            "N": "",
            "d_model": "",
            "d_ff": "",
            "h": "",
            "d_k": "",
            "d_v": "",
            "P_drop": "",
            "ε_ls": "",
            "train steps": "200",
            "source": f"tmt: `{dk16}`",
            "PPL (dev)": "4.95",
            "BLEU (dev, paper BLEU)": "24.81",
            "sacreBLEU (dev)": "24.02",
            "params ×10⁶": "56.0",
            "training cost (FLOPs)": "5.0·10^15 (model)",
            "wall time": "1.5 h",
            "device": "8 × NVIDIA H100",
        }
    ]  # 200 updates x 25,000 target tokens x 1e9 FLOPs; fmt: skip
    above = t3[t3.index(mine[0]) - 1]  # right under the paper's own line for the row
    assert (above["source"], above["d_k"], above["PPL (dev)"]) == ("paper", "16", "5.16")
    (base_t3,) = [line for line in t3 if line["source"] == f"tmt: `{base}`"]
    assert base_t3["row"] == "base" and base_t3["BLEU (dev, paper BLEU)"] == "25.50"
    (base_t2,) = [line for line in table(text, "Table 2") if line["source"] == f"tmt: `{base}`"]
    assert (base_t2["model"], base_t2["BLEU EN-DE (paper BLEU)"], base_t2["sacreBLEU"]) == (
        "Transformer (base model)", "27.10", "26.40",
    )  # fmt: skip
    assert base_t2["BLEU EN-FR (paper BLEU)"] == "" and base_t2["updates"] == "200"
    not_run = [line for line in t3 + table(text, "Table 2") if NOT_RUN in line.values()]
    assert len(not_run) == 1 + len(TABLE3) - 2  # Table 2's big row; every Table 3 row but base and d_k 16
    assert "Runs that are no row" not in text


def test_a_run_not_evaluated_on_the_tables_test_set_says_so(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "r", CONFIGS / "table3" / "c_n2.yaml", {}, flops_per_token=None)
    (line,) = [line for line in table(report_markdown([read_run(run)]), "Table 3") if line["source"].startswith("tmt:")]
    assert line["BLEU (dev, paper BLEU)"] == "not evaluated on newstest2013" and line["training cost (FLOPs)"] == ""


def test_report_cli_writes_markdown_and_names_a_directory_that_is_no_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["report", "-o", "out/report.md", "--no-plot"])
    assert result.exit_code == 0, result.output
    assert_every_paper_figure_is_labelled((tmp_path / "out" / "report.md").read_text(encoding="utf-8"))
    result = CliRunner().invoke(app, ["report", str(tmp_path), "-o", "r.md"])
    assert result.exit_code == 2 and f"{tmp_path}: no config.yaml" in result.output
    with pytest.raises(RunError, match="not a run directory"):
        read_run(tmp_path)


def test_results_of_evaluate_test_count_for_the_test_set_the_config_names(tmp_path: Path) -> None:
    """`tmt evaluate test` on a config whose data.test is .../newstest2014 fills Table 2's newstest2014 column."""
    base = _fake_run(tmp_path / "base", CONFIGS / "base.yaml", {"newstest2013": (25.5, 24.9)})
    (base / "eval_test").mkdir()
    result = {"testset": "test", "corpus": "newstest2014", "paper_bleu": {"score": 27.2}, "sacrebleu": {"score": 26.5}}
    (base / "eval_test" / "scores.json").write_text(json.dumps(result))
    (line,) = [
        line for line in table(report_markdown([read_run(base)]), "Table 2") if line["source"].startswith("tmt:")
    ]
    assert (line["BLEU EN-DE (paper BLEU)"], line["sacreBLEU"]) == ("27.20", "26.50")


def test_what_evaluate_test_writes_is_what_report_reads(prepared_toy, tmp_path: Path, monkeypatch) -> None:
    import dataclasses

    from helpers import write_checkpoint

    lines = {lang: Path(f"{prepared_toy.data.test}.{lang}").read_text(encoding="utf-8").splitlines()[:3]
             for lang in ("en", "de")}  # fmt: skip
    for lang, text in lines.items():
        (tmp_path / f"newstest2014.{lang}").write_text("".join(line + "\n" for line in text), encoding="utf-8")
    data = dataclasses.replace(prepared_toy.data, test="newstest2014")  # relative, as in configs/base.yaml
    cfg = dataclasses.replace(prepared_toy, data=data, decode=dataclasses.replace(prepared_toy.decode, max_len_b=3))
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    write_checkpoint(cfg, run / "checkpoint_u0000010.pt", seed=0)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["evaluate", "test", "-c", "run/checkpoint_u0000010.pt", "--beam", "2"])
    assert result.exit_code == 0, result.output
    written = json.loads((run / "eval_test" / "scores.json").read_text())
    assert (written["testset"], written["corpus"]) == ("test", "newstest2014")
    assert read_run(run).scores["newstest2014"]["sacrebleu"] == written["sacrebleu"]
    (line,) = table(report_markdown([read_run(run)]), "Runs that are no row")
    assert line["test set"] == "newstest2014" and line["sacreBLEU"] == f"{written['sacrebleu']['score']:.2f}"


def test_a_metrics_record_of_the_wrong_type_is_passed_over_with_a_warning(
    toy_run: Path, tmp_path: Path, capsys
) -> None:
    """A record with a string (or a list, or a bool) where a number belongs is named on stderr, by file and line,
    and left out; `tmt report` and `tmt plot` read the rest instead of ending in a TypeError."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(toy_run / name, run / name)
    good = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    train = next(json.loads(line) for line in good if json.loads(line)["kind"] == "train")
    valid = next(json.loads(line) for line in good if json.loads(line)["kind"] == "valid")
    bad = [{**train, "loss": "x"}, {**valid, "ppl": [1.0]}, {**train, "update": True}]
    (run / "metrics.jsonl").write_text("\n".join(good + [json.dumps(r) for r in bad]) + "\n", encoding="utf-8")
    read = read_run(run)
    assert len(read.kind("train")) == sum(json.loads(line)["kind"] == "train" for line in good)
    assert len(read.kind("valid")) == sum(json.loads(line)["kind"] == "valid" for line in good)
    err = capsys.readouterr().err.splitlines()
    n = len(good)
    assert err == [
        f"warning: {run / 'metrics.jsonl'}: line {n + 1}: a 'train' record whose 'loss' is 'x', not a number; the "
        "record is passed over",
        f"warning: {run / 'metrics.jsonl'}: line {n + 2}: a 'valid' record whose 'ppl' is [1.0], not a number; the "
        "record is passed over",
        f"warning: {run / 'metrics.jsonl'}: line {n + 3}: a 'train' record whose 'update' is True, not a number; the "
        "record is passed over",
    ]
    assert CliRunner().invoke(app, ["report", str(run), "-o", str(tmp_path / "r.md")]).exit_code == 0
    assert CliRunner().invoke(app, ["plot", str(run), "-o", str(tmp_path / "c.png")]).exit_code == 0
