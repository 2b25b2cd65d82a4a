"""fp32 CPU decoding through oneDNN's Linear: the same outputs as nn.Linear to fp32 rounding, on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_decode_translate import write_checkpoint
from torch import nn

from transformer_mt.config import Config, ModelConfig
from transformer_mt.data.bpe import PAD
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.translate import Translator
from transformer_mt.model.onednn import OneDnnLinear, onednn_available, use_onednn_linears
from transformer_mt.model.transformer import Transformer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN"),
]

CFG = ModelConfig(d_model=64, d_ff=128, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
V = 100


def make_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CFG, V).eval()
    with torch.no_grad():
        model.embed.weight.mul_(4.0)  # peaky: hypotheses differ and end
    return model


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 64), (1, 1, 64)])
def test_onednn_linear_is_the_linear_formula(shape: tuple[int, ...]) -> None:
    linear = nn.Linear(64, 48)
    x = torch.randn(shape)
    fast = OneDnnLinear(linear.weight, linear.bias)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), x @ linear.weight.T + linear.bias, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(OneDnnLinear(linear.weight, None)(x), x @ linear.weight.T, atol=1e-5, rtol=1e-5)


def test_onednn_linear_falls_back_to_the_plain_linear() -> None:
    """oneDNN's op has no backward: with gradients wanted the layer computes F.linear, and they flow; so it
    does for other dtypes than fp32."""
    linear = nn.Linear(8, 4)
    fast = OneDnnLinear(linear.weight, linear.bias)
    x = torch.randn(3, 8, requires_grad=True)
    fast(x).sum().backward()
    assert linear.weight.grad is not None
    torch.testing.assert_close(x.grad, linear.weight.detach().sum(0).expand(3, 8))
    half = nn.Linear(8, 4).bfloat16()
    with torch.no_grad():
        y = OneDnnLinear(half.weight, half.bias)(x.bfloat16())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, half(x.bfloat16()), atol=0, rtol=0)


def test_onednn_model_decodes_as_the_model() -> None:
    """Every Linear and the tied projection are replaced, sharing the weights; logits and beam output agree."""
    model = make_model()
    src = torch.randint(4, V, (3, 9))
    src[1, 6:] = PAD
    with torch.no_grad():
        reference = model(src, src[:, :7])
        before = beam_search(model, src, beam_size=3, max_len_a=0, max_len_b=12)
    fast = use_onednn_linears(model)
    assert fast is model and not any(type(m) is nn.Linear for m in fast.modules())
    assert fast.decoder[0].ffn.fc1.weight is fast.state_dict(keep_vars=True)["decoder.0.ffn.fc1.weight"]
    assert fast.output_projection.weight.data_ptr() == fast.embed.weight.data_ptr()
    assert fast.state_dict().keys() == make_model().state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(fast(src, src[:, :7]), reference, atol=1e-4, rtol=1e-4)
    after = beam_search(fast, src, beam_size=3, max_len_a=0, max_len_b=12)
    assert [[h.tokens for h in hyps] for hyps in after] == [[h.tokens for h in hyps] for hyps in before]


def test_translator_on_the_cpu_uses_onednn_linears(
    prepared_toy: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tmp_path / "model.pt"
    write_checkpoint(prepared_toy, checkpoint, seed=0)
    lines = ["A man sees the dog.", "", "The child has a table.", "Two women walk."]
    translator = Translator.from_checkpoints([checkpoint], device="cpu")
    assert isinstance(translator.model.output_projection, OneDnnLinear)
    assert isinstance(translator.model.decoder[0].self_attn.qkv, OneDnnLinear)
    translator.show_progress = False
    monkeypatch.setattr("transformer_mt.model.onednn.onednn_available", lambda: False)
    plain = Translator.from_checkpoints([checkpoint], device="cpu")
    assert plain.model.output_projection is None and type(plain.model.decoder[0].self_attn.qkv) is nn.Linear
    plain.show_progress = False
    assert translator.translate_lines(lines) == plain.translate_lines(lines)


def test_only_x86_64_machines_take_the_onednn_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL's vendor dispatch is an x86 matter; elsewhere (ARM's oneDNN runs on other backends) nn.Linear stays."""
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert not onednn_available()
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert onednn_available()
