"""`decode.quantize: int8`: every Linear and the tied output projection become int8 layers; the fp32 model stays.

Each int8 layer quantizes each input row with its own scale, so a sentence's translation does not depend on
the sentences decoded with it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint
from torch import nn
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config, ModelConfig
from transformer_mt.data.bpe import EOS, PAD
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.decode.translate import Translator
from transformer_mt.model.quantize import Int8Linear, QuantizeError, quantize_int8
from transformer_mt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(d_model=64, d_ff=128, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
V = 100


def make_model(**changes: object) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(CFG, **changes), V).eval()
    with torch.no_grad():
        model.embed.weight.mul_(4.0)  # peaky: hypotheses differ and end
    return model


def sources(lengths: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    src = torch.full((len(lengths), max(lengths) + 1), PAD)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, V, (n,), generator=g)
        src[i, n] = EOS
    return src


def test_every_linear_and_the_output_projection_become_int8() -> None:
    model = make_model()
    quantized = quantize_int8(model)
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())
    assert isinstance(quantized.output_projection, Int8Linear) and quantized.output_projection.bias is None
    assert isinstance(quantized.decoder[0].self_attn.qkv, Int8Linear)
    assert isinstance(quantized.encoder[1].ffn.fc2, Int8Linear)
    assert model.output_projection is None and type(model.decoder[0].self_attn.qkv) is nn.Linear  # untouched
    assert torch.equal(quantized.embed.weight, model.embed.weight)  # embedding lookups stay fp32


def test_int8_weights_have_one_scale_per_row() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 6)
    stored = Int8Linear.of(linear).int8_weight()  # (6, 32) int8 with a scale per row
    scales = linear.weight.detach().abs().amax(dim=1) / 127
    assert torch.allclose(stored.q_per_channel_scales().float(), scales)
    expected = torch.round(linear.weight.detach() / scales[:, None])
    assert torch.equal(stored.int_repr().float(), expected)
    assert stored.int_repr().abs().amax(dim=1).tolist() == [127] * 6  # each row's largest weight at full scale


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_computes_its_formula(bias: bool) -> None:
    """Each input row x: round(64 x / max|x|) / 64 times the int8 weights, scaled back by max|x|, plus the bias."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=bias)
    layer = Int8Linear.of(linear)
    x = torch.randn(3, 5, 48) * torch.rand(3, 5, 1) * 10
    x[1, 2] = 0.0  # a row of zeros (its quantized values are 0)
    with torch.no_grad():
        got = layer(x).double()
    a = x.abs().amax(dim=-1, keepdim=True).double()
    levels = torch.round(64 * x.double() / a.clamp_min(1e-30)) / 64  # in [-1, 1]
    weight = layer.int8_weight()
    w = weight.int_repr().double() * weight.q_per_channel_scales().double()[:, None]
    expected = levels @ w.t() * a + (linear.bias.detach().double() if bias else 0.0)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    assert torch.equal(got[1, 2], (linear.bias.detach().double() if bias else torch.zeros(40, dtype=torch.float64)))


def test_an_int8_row_does_not_depend_on_the_other_rows() -> None:
    torch.manual_seed(0)
    layer = Int8Linear.of(nn.Linear(64, 96))
    x = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different ranges
    with torch.no_grad():
        together = layer(x)
        for i in range(9):
            assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


def test_int8_beam_search_of_a_batch_equals_one_sentence_at_a_time() -> None:
    quantized = quantize_int8(make_model())
    lengths = [5, 9, 3, 12, 7, 4, 10, 6]
    src = sources(lengths)
    batched = beam_search(quantized, src, SearchSettings(beam_size=4, max_len_b=8), nbest=4)
    for i, n in enumerate(lengths):
        alone = beam_search(quantized, src[i : i + 1, : n + 1], SearchSettings(beam_size=4, max_len_b=8), nbest=4)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]  # the same n-best lists
        assert [h.score for h in alone] == pytest.approx([h.score for h in batched[i]], abs=1e-4)  # float rounding


@pytest.mark.parametrize("changes", [{}, {"norm": "pre"}, {"share_embeddings": False}], ids=str)
def test_int8_logits_stay_close_to_fp32(changes: dict) -> None:
    model = make_model(**changes)
    src, tgt = sources([7, 3, 9]), sources([6, 8, 2])
    with torch.no_grad():
        exact, approx = model(src, tgt), quantize_int8(model)(src, tgt)
    scale = exact.abs().max()
    assert (approx - exact).abs().max() < 0.05 * scale  # int8 weights and activations: about 1% per matmul
    assert (approx - exact).abs().max() > 0  # it did change: the int8 kernels ran
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_int8_beam_search_mostly_agrees_with_fp32() -> None:
    model = make_model()
    src = sources([5, 9, 3, 12, 7, 4, 10, 6])
    exact = beam_search(model, src, SearchSettings(beam_size=4, max_len_b=8))
    approx = beam_search(quantize_int8(model), src, SearchSettings(beam_size=4, max_len_b=8))
    same = sum(e[0].tokens == a[0].tokens for e, a in zip(exact, approx, strict=True))
    assert same >= 6


def test_int8_is_refused_off_the_cpu() -> None:
    model = make_model().to("meta")  # any device but the CPU
    with pytest.raises(QuantizeError, match=r"CPU only.*pass --device cpu, or --set decode\.quantize=none"):
        quantize_int8(model)


def test_translate_and_evaluate_take_quantize_int8(prepared_toy: Config, tmp_path: Path) -> None:
    checkpoint = tmp_path / "model.pt"
    write_checkpoint(prepared_toy, checkpoint, seed=0)
    translator = Translator.from_checkpoints([checkpoint], device="cpu", overrides=["decode.quantize=int8"])
    assert isinstance(translator.model.output_projection, Int8Linear)
    source = tmp_path / "in.en"
    source.write_text("A man sees the dog.\n\nThe child has a table.\n", encoding="utf-8")
    runner = CliRunner()
    args = ["translate", "-c", str(checkpoint), "-i", str(source), "--device", "cpu", "-b", "2", "--quantize", "int8"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "out.de")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.de").read_text(encoding="utf-8").count("\n") == 3
    result = runner.invoke(
        app,
        [
            "evaluate",
            "-c",
            str(checkpoint),
            "--src",
            str(source),
            "--ref",
            str(source),
            "-o",
            str(tmp_path / "eval"),
            "-b",
            "1",
            "--device",
            "cpu",
            "--quantize",
            "int8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert '"quantize": "int8"' in (tmp_path / "eval" / "scores.json").read_text(encoding="utf-8")
    result = runner.invoke(app, [*args[:-1], "int4"])
    assert result.exit_code == 2 and "int4" in result.output
