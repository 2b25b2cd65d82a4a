"""oneDNN's Linear on the CPU: fp32 decoding (the same outputs as nn.Linear to fp32 rounding) and bf16 training
(autocast's outputs and gradients), on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import write_checkpoint
from torch import nn

from transformer_mt.config import Config, ModelConfig
from transformer_mt.data.bpe import PAD
from transformer_mt.decode.search import beam_search
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.decode.translate import Translator
from transformer_mt.model.onednn import (
    OneDnnLinear,
    onednn_available,
    onednn_bf16,
    padded_rows,
    use_onednn_linears,
)
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
        before = beam_search(model, src, SearchSettings(beam_size=3, max_len_a=0, max_len_b=12))
    fast = use_onednn_linears(model)
    assert fast is model and not any(type(m) is nn.Linear for m in fast.modules())
    assert fast.decoder[0].ffn.fc1.weight is fast.state_dict(keep_vars=True)["decoder.0.ffn.fc1.weight"]
    assert fast.output_projection.weight.data_ptr() == fast.embed.weight.data_ptr()
    assert fast.state_dict().keys() == make_model().state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(fast(src, src[:, :7]), reference, atol=1e-4, rtol=1e-4)
    after = beam_search(fast, src, SearchSettings(beam_size=3, max_len_a=0, max_len_b=12))
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


@pytest.mark.parametrize("onednn_has_bf16", [True, False])
@pytest.mark.parametrize(("bias", "relu"), [(True, False), (True, True), (False, False)])
def test_bf16_training_linear_is_autocasts_linear_with_its_gradients(
    bias: bool, relu: bool, onednn_has_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 autocast with gradients, one oneDNN call (bias and ReLU fused) and addmm's backward: the
    output and every gradient as autocast's F.linear (+ ReLU) computes them, in the same dtypes. Where oneDNN
    has no bf16 kernels (AVX2-only CPUs, where it cannot build the primitive) the layer takes F.linear."""
    if onednn_has_bf16 and not onednn_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU (needs AVX-512 or AMX)")
    monkeypatch.setattr("transformer_mt.model.onednn.onednn_bf16", lambda: onednn_has_bf16)
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    fast = OneDnnLinear(linear.weight, linear.bias, relu=relu)
    x = torch.randn(3, 7, 64, requires_grad=True)
    grad_out = torch.randn(3, 7, 96)
    results = []
    for layer in (fast, lambda h: F.relu(linear(h)) if relu else linear(h)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        params = [x, linear.weight] + ([linear.bias] if bias else [])
        results.append((y, *torch.autograd.grad(y, params, grad_out.to(y.dtype))))
    (y, *grads), (y_ref, *grads_ref) = results
    assert ("_Bf16Linear" in type(y.grad_fn).__name__) == onednn_has_bf16  # which path ran
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == g_ref.dtype == torch.float32
        torch.testing.assert_close(g, g_ref, atol=5e-2, rtol=2e-2)
    if relu:
        assert (y == 0).any()  # the ReLU really clipped something


def test_training_model_keeps_its_tied_projection_and_moves_each_relu_into_its_layer() -> None:
    model = use_onednn_linears(make_model().train(), output_projection=False)
    assert model.output_projection is None  # logits = x E^T with the embedding's own gradient
    ffn = model.encoder[0].ffn
    assert isinstance(ffn.fc1, OneDnnLinear) and ffn.fc1.relu and isinstance(ffn.relu, nn.Identity)
    assert isinstance(ffn.fc2, OneDnnLinear) and not ffn.fc2.relu
    src = torch.randint(4, V, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(src, src).float().sum().backward()
    assert model.embed.weight.grad is not None and model.encoder[0].ffn.fc1.weight.grad.abs().sum() > 0


def test_the_trainer_builds_its_cpu_model_with_onednn_linears(prepared_toy: Config) -> None:
    from transformer_mt.train.build import build_stepper
    from transformer_mt.train.distributed import DistEnv

    step = build_stepper(prepared_toy, DistEnv(0, 1, 0, torch.device("cpu"), True), 300)
    assert isinstance(step.module.decoder[0].ffn.fc1, OneDnnLinear) and step.module.output_projection is None


def test_padded_rows_are_few_sizes_with_little_waste() -> None:
    sizes = [padded_rows(rows) for rows in range(4097)]
    assert sizes[:17] == list(range(17))  # exact where a row count is one of few anyway
    assert all(rows <= padded <= rows * 1.25 for rows, padded in enumerate(sizes))
    assert sizes == sorted(sizes) and len(set(sizes[1:])) == 48
    assert [padded_rows(r) for r in (17, 100, 1000, 1025)] == [20, 112, 1024, 1280]


@pytest.mark.parametrize(("d_in", "d_out"), [(64, 48), (256, 1024), (1024, 256), (256, 8000)])
def test_rounding_the_rows_up_changes_no_output(d_in: int, d_out: int) -> None:
    """The zero rows that `padded_rows` adds leave every real row's result as oneDNN gives it unrounded, bit for
    bit: a row's result does not depend on how many rows are multiplied with it."""
    torch.manual_seed(0)
    linear = nn.Linear(d_in, d_out)
    fast = OneDnnLinear(linear.weight, linear.bias, relu=True)
    with torch.no_grad():
        for rows in [*range(1, 40), 100, 333, 1000]:
            x = torch.randn(rows, d_in)
            exact = torch.ops.mkldnn._linear_pointwise(x, linear.weight, linear.bias, "relu", [], "")
            assert torch.equal(fast(x), exact), rows
            assert torch.equal(fast(x.view(1, rows, d_in)), exact.view(1, rows, d_out)), rows
