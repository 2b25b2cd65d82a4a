"""`decode.quantize: int8`: every Linear and the tied output projection become int8 layers; the fp32 model stays."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_decode_translate import write_checkpoint
from torch import nn
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config, ModelConfig
from transformer_mt.data.bpe import EOS, PAD
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.translate import Translator
from transformer_mt.model.quantize import QuantizeError, quantize_int8
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
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    assert isinstance(quantized.output_projection, dynamic)
    assert isinstance(quantized.decoder[0].self_attn.qkv, dynamic) and isinstance(quantized.encoder[1].ffn.fc2, dynamic)
    assert quantized.output_projection.weight().qscheme() == torch.per_channel_affine  # one scale per row
    assert model.output_projection is None and type(model.decoder[0].self_attn.qkv) is nn.Linear  # untouched
    assert torch.equal(quantized.embed.weight, model.embed.weight)  # embedding lookups stay fp32


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
    exact = beam_search(model, src, beam_size=4, max_len_b=8)
    approx = beam_search(quantize_int8(model), src, beam_size=4, max_len_b=8)
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
    assert isinstance(translator.model.output_projection, torch.ao.nn.quantized.dynamic.Linear)
    source = tmp_path / "in.en"
    source.write_text("A man sees the dog.\n\nThe child has a table.\n", encoding="utf-8")
    runner = CliRunner()
    args = ["translate", "-c", str(checkpoint), "-i", str(source), "--device", "cpu", "-b", "2", "--quantize", "int8"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "out.de")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.de").read_text(encoding="utf-8").count("\n") == 3
    result = runner.invoke(app, ["evaluate", "-c", str(checkpoint), "--src", str(source), "--ref", str(source),
                                 "-o", str(tmp_path / "eval"), "-b", "1", "--device", "cpu", "--quantize", "int8"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert '"quantize": "int8"' in (tmp_path / "eval" / "scores.json").read_text(encoding="utf-8")
    result = runner.invoke(app, [*args[:-1], "int4"])
    assert result.exit_code == 2 and "int4" in result.output
