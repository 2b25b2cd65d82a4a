"""Figures: `tmt plot` (training curves), `tmt attention` (heatmaps per head), the chart of `tmt report`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import metric_records
from typer.testing import CliRunner

from transformer_mt.attention_maps import AttentionError, sentence_attention
from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.cli import app
from transformer_mt.data.bpe import BOS, load_bpe_bytes
from transformer_mt.data.clean import normalize
from transformer_mt.paper import TABLE3
from transformer_mt.plots import PlotError, attention_figure, curves_figure, new_figure, report_figure
from transformer_mt.report import table3_points
from transformer_mt.runs import read_run
from transformer_mt.train.run_checkpoints import newest_readable

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The old man sees the red car."
PNG = b"\x89PNG\r\n\x1a\n"


def _records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in metric_records(run_dir) if r["kind"] == kind]


def _checkpoint(run_dir: Path) -> Path:
    (last,) = newest_readable(run_dir, 1)
    return last


# ---------------------------------------------------------------- tmt plot


def test_curves_draw_the_runs_metrics_against_updates_and_minutes(toy_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "curves.png"
    fig = curves_figure(read_run(toy_run), out)
    assert out.read_bytes().startswith(PNG)
    train, valid = _records(toy_run, "train"), _records(toy_run, "valid")
    loss, lr, bleu, loss_t, lr_t, _ = fig.axes  # top row against updates, bottom row against minutes
    train_loss, valid_loss, valid_nll = loss.get_lines()
    assert list(train_loss.get_xdata()) == [r["update"] for r in train] == [2, 4, 6]
    assert list(train_loss.get_ydata()) == [r["loss"] for r in train]
    assert list(valid_loss.get_xdata()) == [3, 6] and list(valid_nll.get_ydata()) == [r["nll"] for r in valid]
    assert list(lr.get_lines()[0].get_ydata()) == [r["lr"] for r in train]
    assert list(loss_t.get_lines()[0].get_xdata()) == [r["minutes"] for r in train]
    assert list(lr_t.get_lines()[0].get_xdata()) == [r["minutes"] for r in train]
    assert not bleu.get_lines() and "no validation BLEU" in bleu.texts[0].get_text()  # the toy run logged none


def test_plot_cli_writes_the_png_and_refuses_a_run_without_records(toy_run: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plot", str(toy_run), "-o", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c.png").read_bytes().startswith(PNG)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((toy_run / "config.yaml").read_text())
    result = CliRunner().invoke(app, ["plot", str(empty), "-o", str(tmp_path / "e.png")])
    assert result.exit_code == 2 and "no train or valid records" in result.output
    assert not (tmp_path / "e.png").exists()


def _rescaled_run(toy_run: Path, root: Path, scale: float) -> Path:
    """A second run directory: toy_run's config and records, losses scaled by ``scale``, a valid BLEU per validation."""
    import json

    run = root / f"scaled_{scale}"
    run.mkdir()
    (run / "config.yaml").write_text((toy_run / "config.yaml").read_text())
    records = metric_records(toy_run)
    for r in records:
        for key in ("loss", "nll"):
            if key in r and r["kind"] in ("train", "valid"):
                r[key] *= scale
        if r["kind"] == "valid":
            r["bleu"] = 10.0 * r["update"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_several_runs_draw_one_color_each_on_the_same_axes(toy_run: Path, tmp_path: Path) -> None:
    other = _rescaled_run(toy_run, tmp_path, 2.0)
    out = tmp_path / "compare.png"
    fig = curves_figure([read_run(toy_run), read_run(other)], out)
    assert out.read_bytes().startswith(PNG)
    loss, lr, bleu, loss_t, _, bleu_t = fig.axes
    train, valid = _records(toy_run, "train"), _records(toy_run, "valid")
    first_train, first_nll, second_train, second_nll = loss.get_lines()  # per run: training loss, validation NLL
    assert list(first_train.get_ydata()) == [r["loss"] for r in train]
    assert list(second_train.get_ydata()) == [2.0 * r["loss"] for r in train]
    assert list(first_nll.get_xdata()) == [3, 6] and list(second_nll.get_ydata()) == [2.0 * r["nll"] for r in valid]
    assert first_train.get_color() == first_nll.get_color() != second_train.get_color() == second_nll.get_color()
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        f"{toy_run} train",
        f"{toy_run} valid NLL",
        f"{other} train",
        f"{other} valid NLL",
    ]
    assert [line.get_label() for line in lr.get_lines()] == [str(toy_run), str(other)]
    (drawn,) = bleu.get_lines()  # only the second run logged validation BLEU
    assert drawn.get_label() == str(other) and list(drawn.get_ydata()) == [30.0, 60.0]
    assert drawn.get_color() == second_train.get_color() and not bleu.texts
    assert list(bleu_t.get_lines()[0].get_xdata()) == [r["minutes"] for r in valid]
    assert list(loss_t.get_lines()[2].get_xdata()) == [r["minutes"] for r in train]


def test_plot_cli_compares_runs_and_names_the_one_without_records(toy_run: Path, tmp_path: Path) -> None:
    other = _rescaled_run(toy_run, tmp_path, 0.5)
    result = CliRunner().invoke(app, ["plot", str(toy_run), str(other), "-o", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c.png").read_bytes().startswith(PNG)
    (other / "metrics.jsonl").write_text("")
    result = CliRunner().invoke(app, ["plot", str(toy_run), str(other), "-o", str(tmp_path / "e.png")])
    assert result.exit_code == 2 and "no train or valid records" in result.output and "scaled_0.5" in result.output
    assert not (tmp_path / "e.png").exists()


def test_without_matplotlib_each_figure_names_the_pip_command(toy_run: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(PlotError, match=r"pip install matplotlib"):
        new_figure(4, 3)
    for args in (["plot", str(toy_run)], ["attention", "-c", str(_checkpoint(toy_run)), "--text", TEXT]):
        result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "x.png")])
        assert result.exit_code == 2 and "pip install matplotlib" in result.output
    result = CliRunner().invoke(app, ["report", str(toy_run), "-o", str(tmp_path / "r.md")])
    assert result.exit_code == 0 and (tmp_path / "r.md").exists() and not (tmp_path / "r.png").exists()
    assert "no chart" in result.output and "pip install matplotlib" in result.output


# ---------------------------------------------------------------- tmt attention


def _source_pieces(checkpoint: Path, text: str) -> list[str]:
    bpe = load_bpe_bytes(read_checkpoint(checkpoint).spm_model)
    return [*(bpe.id_to_piece(i) for i in bpe.encode(normalize(text), out_type=int)), "</s>"]


def test_encoder_attention_of_a_sentence_per_head(toy_run: Path) -> None:
    checkpoint = _checkpoint(toy_run)
    found = sentence_attention(checkpoint, TEXT, "encoder")
    pieces = _source_pieces(checkpoint, TEXT)
    heads = read_run(toy_run).cfg.model.heads
    assert found.panel.weights.shape == (heads, len(pieces), len(pieces))
    assert found.panel.queries == found.panel.keys == pieces
    np.testing.assert_allclose(found.panel.weights.sum(-1), 1.0, atol=1e-6)
    assert "layer 1 of 1" in found.panel.title  # the paper's "one below the top", or the only layer


def test_cross_and_decoder_attention_of_a_given_target(toy_run: Path) -> None:
    checkpoint = _checkpoint(toy_run)
    target = "Der alte Mann sieht das rote Auto."
    cross = sentence_attention(checkpoint, TEXT, "cross", target=target)
    tgt = _source_pieces(checkpoint, target)  # the target's pieces + EOS: what each decoder position predicts
    src = _source_pieces(checkpoint, TEXT)
    assert cross.target == target and cross.panel.queries == tgt and cross.panel.keys == src
    assert cross.panel.weights.shape[1:] == (len(tgt), len(src))
    np.testing.assert_allclose(cross.panel.weights.sum(-1), 1.0, atol=1e-6)
    decoder = sentence_attention(checkpoint, TEXT, "decoder", target=target)
    assert decoder.panel.queries == decoder.panel.keys == ["<s>", *tgt[:-1]]
    assert not np.triu(decoder.panel.weights, 1).any()  # masked: no position attends to a later one


def test_attention_weights_equal_the_models_explicit_pass(toy_run: Path) -> None:
    """What is drawn is the forward pass's own weights, whose outputs equal the fused kernel's."""
    from transformer_mt.decode.translate import Translator

    checkpoint = _checkpoint(toy_run)
    translator = Translator.from_checkpoints([checkpoint], device="cpu")
    src = torch.tensor([translator.encode(0, TEXT)])
    tgt_in = torch.tensor([[BOS, *translator.bpe.encode(normalize("Das Auto."), out_type=int)]])
    with torch.no_grad():
        logits, maps = translator.model.forward_with_attention(src, tgt_in)
        torch.testing.assert_close(logits, translator.model(src, tgt_in), atol=1e-5, rtol=0)
    found = sentence_attention(checkpoint, TEXT, "cross", target="Das Auto.")
    np.testing.assert_array_equal(found.panel.weights, maps.cross[0][0].numpy())


def test_attention_refuses_a_layer_the_model_lacks_and_an_empty_sentence(toy_run: Path) -> None:
    checkpoint = _checkpoint(toy_run)
    with pytest.raises(AttentionError, match=r"--layer 3: the decoder of .* has layers 1 to 1"):
        sentence_attention(checkpoint, TEXT, "decoder", layer=3)
    with pytest.raises(AttentionError, match="--text is empty"):
        sentence_attention(checkpoint, "  ", "encoder")


def test_attention_figure_draws_each_head_and_the_cli_writes_it(toy_run: Path, tmp_path: Path) -> None:
    checkpoint = _checkpoint(toy_run)
    found = sentence_attention(checkpoint, TEXT, "encoder")
    fig = attention_figure(found.panel, tmp_path / "a.png")
    images = [ax.get_images()[0].get_array() for ax in fig.axes if ax.get_images()]
    assert len(images) == found.panel.weights.shape[0]
    for h, image in enumerate(images):
        np.testing.assert_array_equal(np.asarray(image), found.panel.weights[h])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == found.panel.keys
    out = tmp_path / "cli.png"
    result = CliRunner().invoke(
        app, ["attention", "-c", str(checkpoint), "--text", TEXT, "--kind", "cross", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(PNG) and "translation: " in result.output


# ---------------------------------------------------------------- the report's chart


def test_report_chart_sets_each_runs_figures_beside_the_papers(toy_run: Path, tmp_path: Path) -> None:
    run = read_run(toy_run)
    points = table3_points([run])  # the toy run is no row of Table 3: its bars come first, with no paper bar
    fig = report_figure(points, tmp_path / "r.png")
    bleu, ppl = fig.axes
    paper, mine = bleu.containers
    assert math.isnan(paper[0].get_height()) and [bar.get_height() for bar in paper][1:] == [r.bleu for r in TABLE3]
    assert all(math.isnan(bar.get_height()) for bar in mine[1:])  # no row of Table 3 was run
    expected = run.scores[min(run.scores)]["sacrebleu"]["score"] if run.scores else math.nan
    assert mine[0].get_height() == expected or (math.isnan(expected) and math.isnan(mine[0].get_height()))
    assert ppl.containers[1][0].get_height() == pytest.approx(run.dev_ppl) and points[0]["label"].startswith(
        toy_run.name
    )
    assert [bar.get_height() for bar in ppl.containers[0]][1:] == [row.ppl for row in TABLE3]
    result = CliRunner().invoke(app, ["report", str(toy_run), "-o", str(tmp_path / "rep.md")])
    assert result.exit_code == 0 and (tmp_path / "rep.png").read_bytes().startswith(PNG)
