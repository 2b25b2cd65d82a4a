"""The Transformer model: paper formulas, masking, padding, cached decoding, parameter counts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from transformer_mt.config import ConfigError, ModelConfig, load_config
from transformer_mt.model.attention import (
    SMALL_QUERIES,
    CrossAttention,
    SelfAttention,
    additive_mask,
    attention,
    explicit_attention,
    group_queries,
    ungroup,
)
from transformer_mt.model.positions import LearnedPositions, PositionError, SinusoidalPositions, sinusoidal_positions
from transformer_mt.model.transformer import (
    EncoderOut,
    FeedForward,
    Transformer,
    count_parameters,
    flops_per_token,
    residual,
)

PAD = 0
V = 50
TINY = ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2, max_positions=64)


def make_model(seed: int = 0, vocab: int = V, **changes) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(dataclasses.replace(TINY, **changes), vocab, pad_id=PAD).eval()


def tokens(lengths: list[int], seed: int, vocab: int = V) -> torch.Tensor:
    """Right-padded random token ids (B, max(lengths)), ids >= 1 so that only padding is PAD."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, :n] = torch.randint(1, vocab, (n,), generator=g)
    return out


# ---------------------------------------------------------------- paper formulas


@pytest.mark.parametrize("d_model", [8, 7, 512])
def test_sinusoidal_positions_equal_the_paper_formula(d_model: int) -> None:
    pe = sinusoidal_positions(200, d_model)
    assert pe.shape == (200, d_model) and pe.dtype == torch.float32
    for pos in [0, 1, 2, 17, 199]:
        for dim in range(d_model):
            i = dim // 2
            angle = pos / 10000 ** (2 * i / d_model)
            expected = math.sin(angle) if dim % 2 == 0 else math.cos(angle)  # interleaved, not [sin..., cos...]
            assert pe[pos, dim].item() == pytest.approx(expected, abs=1e-6), (pos, dim)


def test_position_modules_offset_and_limit() -> None:
    sin = SinusoidalPositions(10, 8)
    assert torch.equal(sin(3, offset=4), sinusoidal_positions(10, 8)[4:7])
    assert "table" not in sin.state_dict()  # fixed: a checkpoint may be reused with another max_positions
    learned = LearnedPositions(10, 8)
    assert torch.equal(learned(2, offset=8), learned.weight[8:10])
    for module in (sin, learned):
        with pytest.raises(PositionError, match=r"11 positions.*model\.max_positions is 10"):
            module(3, offset=8)


def test_multi_head_attention_equals_the_paper_formula() -> None:
    """MultiHead(Q, K, V) = Concat(head_1..h) W_O, head_i = softmax(Q W_Q^i (K W_K^i)^T / sqrt(d_k)) V W_V^i."""
    torch.manual_seed(0)
    D, H = 12, 3
    dk = D // H
    attn = SelfAttention(D, H, attention_dropout=0.0)
    for p in attn.parameters():  # non-zero biases too
        torch.nn.init.normal_(p)
    x = torch.randn(2, 5, D)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])  # (B, S) keys allowed
    Wq, Wk, Wv = attn.qkv.weight.split(D)
    bq, bk, bv = attn.qkv.bias.split(D)
    expected = torch.empty(2, 5, D)
    for b in range(2):
        heads = []
        for h in range(H):
            sl = slice(h * dk, (h + 1) * dk)
            q = x[b] @ Wq[sl].T + bq[sl]
            k = x[b] @ Wk[sl].T + bk[sl]
            v = x[b] @ Wv[sl].T + bv[sl]
            scores = q @ k.T / math.sqrt(dk)
            scores[:, ~mask[b]] = float("-inf")
            heads.append(torch.softmax(scores, dim=-1) @ v)
        expected[b] = torch.cat(heads, dim=-1) @ attn.out.weight.T + attn.out.bias
    got = attn(x, mask[:, None, None, :])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    causal = attn(x, is_causal=True)
    tri = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(causal, attn(x, tri), atol=1e-6, rtol=1e-6)


def test_narrower_keys_than_values_equal_the_formula_with_their_own_d_k() -> None:
    """Table 3 row (B): W_Q, W_K project to h*d_k, W_V keeps d_v = D/h; scores scale by 1/sqrt(d_k)."""
    torch.manual_seed(0)
    D, H, dk = 12, 3, 2
    attn = SelfAttention(D, H, attention_dropout=0.0, d_k=dk)
    assert attn.qkv.weight.shape == (2 * H * dk + D, D) and attn.out.weight.shape == (D, D)
    for p in attn.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 5, D)
    Wq, Wk, Wv = attn.qkv.weight.split([H * dk, H * dk, D])
    bq, bk, bv = attn.qkv.bias.split([H * dk, H * dk, D])
    q, k, v = (x @ W.T + b for W, b in ((Wq, bq), (Wk, bk), (Wv, bv)))
    heads = []
    for h in range(H):
        qh, kh, vh = q[..., h * dk : (h + 1) * dk], k[..., h * dk : (h + 1) * dk], v[..., h * 4 : (h + 1) * 4]
        heads.append(torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(dk), dim=-1) @ vh)
    expected = torch.cat(heads, dim=-1) @ attn.out.weight.T + attn.out.bias
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)
    cross = CrossAttention(D, H, 0.0, d_k=dk)
    k, v = cross.project_memory(x)
    assert k.shape == (2, H, 5, dk) and v.shape == (2, H, 5, D // H)


def test_cross_attention_reads_memory_keys_and_values() -> None:
    torch.manual_seed(0)
    cross, self_ = CrossAttention(8, 2, 0.0), SelfAttention(8, 2, 0.0)
    with torch.no_grad():  # the same projections: attending over x itself must agree with self-attention
        self_.qkv.weight.copy_(torch.cat([cross.q.weight, cross.kv.weight]))
        self_.qkv.bias.copy_(torch.cat([cross.q.bias, cross.kv.bias]))
        self_.out.load_state_dict(cross.out.state_dict())
    x = torch.randn(3, 4, 8)
    k, v = cross.project_memory(x)
    assert k.shape == (3, 2, 4, 4)
    torch.testing.assert_close(cross(x, k, v, None), self_(x), atol=1e-6, rtol=1e-6)


def test_feed_forward_equals_the_paper_formula() -> None:
    """FFN(x) = max(0, x W1 + b1) W2 + b2."""
    torch.manual_seed(0)
    ffn = FeedForward(6, 10, activation_dropout=0.0)
    x = torch.randn(2, 3, 6)
    expected = torch.clamp(x @ ffn.fc1.weight.T + ffn.fc1.bias, min=0) @ ffn.fc2.weight.T + ffn.fc2.bias
    torch.testing.assert_close(ffn(x), expected)


def test_residual_post_norm_and_pre_norm() -> None:
    torch.manual_seed(0)
    norm, drop = torch.nn.LayerNorm(4), torch.nn.Dropout(0.0)
    x = torch.randn(2, 3, 4)
    f = lambda h: 3 * h + 1  # noqa: E731
    torch.testing.assert_close(residual(x, norm, f, drop, pre=False), norm(x + f(x)))  # LayerNorm(x + Sublayer(x))
    torch.testing.assert_close(residual(x, norm, f, drop, pre=True), x + f(norm(x)))
    torch.testing.assert_close(residual(x, norm, f, drop, pre=False, skip=False), norm(f(x)))  # no "x +"
    torch.testing.assert_close(residual(x, norm, f, drop, pre=True, skip=False), f(norm(x)))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_encoder_layer_without_its_attention_residual_is_that_formula_at_that_layer_only(norm: str) -> None:
    """model.encoder_no_residual_layer (Liu et al. 2021): layer N's self-attention output replaces its input;
    its FFN and every other layer keep the paper's residuals."""
    model = make_model(norm=norm, encoder_layers=3, encoder_no_residual_layer=2, dropout=0.0)
    assert [layer.attention_residual for layer in model.encoder] == [True, False, True]
    layer, x = model.encoder[1], torch.randn(2, 5, 32)
    attended = layer.self_attn(layer.norm1(x) if norm == "pre" else x, mask=None)
    h = attended if norm == "pre" else layer.norm1(attended)  # no "x +"
    expected = h + layer.ffn(layer.norm2(h)) if norm == "pre" else layer.norm2(h + layer.ffn(h))
    torch.testing.assert_close(layer(x, None), expected)
    same = make_model(norm=norm, encoder_layers=3, dropout=0.0)
    same.load_state_dict(model.state_dict())  # the key changes no weight: a checkpoint's tensors fit either way
    for mine, paper in zip(model.encoder, same.encoder, strict=True):
        assert torch.allclose(mine(x, None), paper(x, None)) == mine.attention_residual


def test_embeddings_scaled_by_sqrt_d_model_plus_positions() -> None:
    model = make_model()
    tok = tokens([5, 3], seed=1)
    expected = model.embed.weight[tok] * math.sqrt(TINY.d_model) + sinusoidal_positions(64, TINY.d_model)[2:7]
    torch.testing.assert_close(model._embed(model.embed, tok, offset=2), expected)


def test_group_queries_and_ungroup_are_inverse_reshapes() -> None:
    q = torch.randn(6, 4, 2, 8)  # 3 sentences x 2 beams, 4 heads, 2 positions
    grouped = group_queries(q, 2)
    assert grouped.shape == (3, 4, 4, 8)
    assert torch.equal(grouped[1, :, 2:], q[3])  # sentence 1, beam 1: its queries follow beam 0's
    assert torch.equal(ungroup(grouped, 2), q)
    assert group_queries(q, 1) is q


@pytest.mark.parametrize("groups", [1, 4])
def test_decoding_step_attention_equals_the_fused_kernel(groups: int) -> None:
    """The two-matmul path of a few queries per row computes what scaled_dot_product_attention does."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3 * groups, 2, 1, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    allowed = torch.rand(3, 1, groups, 6) > 0.3
    allowed[..., 0] = True  # every query sees something
    fused = F.scaled_dot_product_attention(group_queries(q, groups), k, v, attn_mask=allowed)
    for mask in (allowed, additive_mask(allowed)):
        torch.testing.assert_close(ungroup(fused, groups), attention(q, k, v, mask, groups=groups), atol=1e-6, rtol=0)
    big = torch.randn(3, 2, SMALL_QUERIES + 1, 8)  # more queries per row: the fused kernel itself
    torch.testing.assert_close(attention(big, k, v), F.scaled_dot_product_attention(big, k, v), atol=0, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_bf16_attention_on_cpu_is_the_formula_with_its_gradients(is_causal: bool) -> None:
    """bf16 training on the CPU takes two matmuls and an fp32 softmax: the fp32 formula to bf16 rounding, backward too."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 12, 16, requires_grad=True) for _ in range(3))
    allowed = torch.rand(3, 1, 12, 12) > 0.3
    allowed[..., 0] = True  # every query sees something
    mask = None if is_causal else additive_mask(allowed)
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    y = attention(*half, mask, is_causal=is_causal)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference, atol=3e-2, rtol=0)
    grad = torch.randn_like(reference)
    y.backward(grad.bfloat16())
    reference.backward(grad)
    for low, exact in zip(half, (q, k, v), strict=True):
        torch.testing.assert_close(low.grad.float(), exact.grad, atol=6e-2, rtol=0)
    torch.manual_seed(1)
    dropped = attention(*(t.detach() for t in half), mask, is_causal=is_causal, dropout=0.5)
    assert not torch.allclose(dropped.float(), y.detach().float(), atol=1e-2)  # attention dropout applies


@pytest.mark.parametrize("groups", [1, 3])
def test_explicit_attention_returns_probabilities_and_the_fused_kernels_output(groups: int) -> None:
    """The opt-in path for drawing attention: the same output as `attention`, and weights that sum to 1 over keys."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2 * groups, 2, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 4)
    allowed = torch.rand(2, 1, groups * 10, 10) > 0.3
    allowed[..., 0] = True  # every query sees something
    for mask in (None, allowed, additive_mask(allowed)):
        y, weights = explicit_attention(q, k, v, mask, groups=groups)
        torch.testing.assert_close(y, attention(q, k, v, mask, groups=groups), atol=1e-5, rtol=0)
        assert weights.shape == (2 * groups, 2, 10, 10)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2 * groups, 2, 10), atol=1e-6, rtol=0)
        if mask is not None:
            assert not weights[~ungroup(allowed.expand(2, 2, groups * 10, 10), groups)].any()  # forbidden: exactly 0
    y, weights = explicit_attention(q[:2], k, v, is_causal=True)
    torch.testing.assert_close(y, attention(q[:2], k, v, is_causal=True), atol=1e-5, rtol=0)
    assert not weights.triu(1).any()


@pytest.mark.parametrize("changes", [{}, {"d_k": 3}, {"norm": "pre"}], ids=str)
def test_forward_with_attention_is_the_same_pass_with_its_weights(changes: dict) -> None:
    model = make_model(**changes)
    src, tgt = tokens([7, 4], seed=1), tokens([5, 5], seed=2)
    with torch.no_grad():
        logits, maps = model.forward_with_attention(src, tgt)
        torch.testing.assert_close(logits, model(src, tgt), atol=1e-5, rtol=0)
    assert [w.shape for w in maps.encoder] == [(2, 4, 7, 7)] * 2
    assert [w.shape for w in maps.decoder] == [(2, 4, 5, 5)] * 2
    assert [w.shape for w in maps.cross] == [(2, 4, 5, 7)] * 2
    for w in maps.encoder + maps.decoder + maps.cross:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-6, rtol=0)
    assert not any(w.triu(1).any() for w in maps.decoder)  # no attention to later target positions
    assert not any(w[1, ..., 4:].any() for w in maps.encoder + maps.cross)  # nor to sentence 1's source padding


def test_cross_attention_shares_one_memory_row_among_its_group() -> None:
    """Beams of a sentence attend to its memory held once: the same result as a copy of it per beam."""
    torch.manual_seed(0)
    attn = CrossAttention(16, 4, 0.0).eval()
    x, memory = torch.randn(6, 3, 16), torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    with torch.no_grad():
        shared = attn(x, *attn.project_memory(memory), mask)
        copies = attn(x, *attn.project_memory(memory.repeat_interleave(3, 0)), mask.repeat_interleave(3, 0))
    torch.testing.assert_close(shared, copies, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- masking and padding


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_no_future_leakage(norm: str) -> None:
    model = make_model(norm=norm)
    src, tgt = tokens([7, 4], seed=1), tokens([9, 9], seed=2)
    t = 4
    changed = tgt.clone()
    changed[:, t + 1 :] = tokens([4, 4], seed=3)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the later positions do see their inputs


def test_source_padding_does_not_change_real_outputs() -> None:
    model = make_model()
    src, tgt = tokens([6, 3, 5], seed=1), tokens([4, 6, 2], seed=2)
    padded = F.pad(src, (0, 5), value=PAD)  # 5 extra padding columns
    with torch.no_grad():
        enc, enc_padded = model.encode(src), model.encode(padded)
        for i, n in enumerate([6, 3, 5]):
            torch.testing.assert_close(enc.memory[i, :n], enc_padded.memory[i, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(model(src, tgt), model(padded, tgt), atol=1e-5, rtol=0)
    assert enc_padded.src_pad_mask.tolist()[1] == [False] * 3 + [True] * 8


def test_target_padding_does_not_change_real_outputs() -> None:
    model = make_model()
    src, tgt = tokens([6, 3], seed=1), tokens([4, 2], seed=2)
    padded = F.pad(tgt, (0, 3), value=PAD)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, padded)
    torch.testing.assert_close(a[0, :4], b[0, :4], atol=1e-5, rtol=0)
    torch.testing.assert_close(a[1, :2], b[1, :2], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "changes",
    [{}, {"norm": "pre"}, {"positions": "learned"}, {"d_k": 3}, {"share_embeddings": False},
     {"encoder_no_residual_layer": 2}],
    ids=str,
)  # fmt: skip
def test_packed_forward_is_the_padded_forward_at_the_real_positions_with_the_same_gradients(changes: dict) -> None:
    model = make_model(**changes).double()
    src, tgt = tokens([6, 3, 5, 1], seed=1), tokens([4, 6, 2, 5], seed=2)
    real = tgt.ne(PAD)
    padded = model(src, tgt)[real]  # (N, V)
    packed = model(src, tgt, pack=True)
    assert packed.shape == (int(real.sum()), V)
    torch.testing.assert_close(packed, padded, atol=1e-12, rtol=0)
    weights = torch.randn_like(padded)
    grads = [torch.autograd.grad((out * weights).sum(), list(model.parameters())) for out in (padded, packed)]
    for name, g_padded, g_packed in zip([n for n, _ in model.named_parameters()], *grads, strict=True):
        torch.testing.assert_close(g_packed, g_padded, atol=1e-12, rtol=0, msg=name)


def test_packed_encoder_output_is_the_real_rows_of_the_padded_one() -> None:
    model = make_model()
    src = tokens([6, 3, 5], seed=1)
    with torch.no_grad():
        enc, packed = model.encode(src), model.encode(src, pack=True)
    assert packed.packing is not None and enc.packing is None
    torch.testing.assert_close(packed.memory, enc.memory[src.ne(PAD)], atol=1e-6, rtol=0)
    assert packed.packing.cols.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]


def test_decode_packs_in_teacher_forcing_only() -> None:
    model = make_model()
    src = tokens([3, 2], seed=1)
    enc = model.encode(src)
    cache = model.init_cache(enc)
    with pytest.raises(ValueError, match="teacher forcing only"):
        model.decode(torch.ones(2, 1, dtype=torch.long), enc, cache, pack=True)


# ---------------------------------------------------------------- cached decoding


@pytest.mark.parametrize(
    "changes", [{}, {"norm": "pre"}, {"positions": "learned"}, {"share_embeddings": False}, {"d_k": 3}], ids=str
)
def test_cached_decoding_equals_full_forward(changes: dict) -> None:
    model = make_model(**changes)
    src, tgt = tokens([7, 3, 5], seed=1), tokens([8, 8, 8], seed=2)
    with torch.no_grad():
        full = model(src, tgt)  # (B, T, V)
        enc = model.encode(src)
        cache = model.init_cache(enc)
        assert cache.cross_mask is not None and cache.length == 0
        steps = []
        for t in range(tgt.shape[1]):
            steps.append(model.decode(tgt[:, t : t + 1], enc, cache))
            assert cache.length == t + 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_cached_decoding_in_chunks_after_a_prefix() -> None:
    """Several new positions after a cached prefix need the offset causal mask."""
    model = make_model()
    src, tgt = tokens([7, 3], seed=1), tokens([9, 9], seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        enc = model.encode(src)
        cache = model.init_cache(enc)
        chunks = [model.decode(tgt[:, a:b], enc, cache) for a, b in [(0, 3), (3, 4), (4, 9)]]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)


def test_cached_decoding_after_reorder_equals_full_forward() -> None:
    """One beam per sentence: after moving, repeating and dropping sentences, decoding continues exactly."""
    model = make_model()
    src, tgt = tokens([7, 3, 5], seed=1), tokens([8, 8, 8], seed=2)
    first, second, third = torch.tensor([2, 0, 0, 1]), torch.tensor([3, 1, 2]), torch.tensor([2, 2, 0, 1])
    rows = first[second][third]  # rows of the original batch after all three reorders
    with torch.no_grad():
        expected = model(src[rows], tgt[rows])
        enc = model.encode(src)
        cache = model.init_cache(enc)
        for t in range(3):
            model.decode(tgt[:, t : t + 1], enc, cache)
        assert cache.reorder(first, sentences=first) is cache
        cache.reorder(second, sentences=second)  # two reorders before the next step compose
        enc = enc.reorder(first).reorder(second)
        assert isinstance(enc, EncoderOut) and enc.memory.shape[0] == 3
        steps = [model.decode(tgt[first[second], t : t + 1], enc, cache) for t in range(3, 5)]
        cache.reorder(third, sentences=third)
        enc = enc.reorder(third)
        steps += [model.decode(tgt[rows, t : t + 1], enc, cache) for t in range(5, 8)]
    steps[:2] = [s[third] for s in steps[:2]]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected[:, 3:], atol=1e-5, rtol=0)


def beam_rows_decoding(model: Transformer, beam: int, reorders: list[tuple[int, torch.Tensor, torch.Tensor | None]]):
    """Decode 2 sentences x ``beam`` rows step by step, applying ``(step, index, sentences)`` reorders; return
    the logits of every step (rows as after the last reorder) and what a full forward of the same rows gives."""
    src = tokens([7, 3], seed=1)
    tgt = tokens([6] * (2 * beam), seed=2)
    history = torch.arange(2 * beam)[:, None].repeat(1, tgt.shape[1])  # row of tgt feeding each (row, step)
    sentence = torch.arange(2).repeat_interleave(beam)  # the sentence of each row
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc, beams=beam)
        steps = []
        for t in range(tgt.shape[1]):
            for when, index, sentences in reorders:
                if when == t:
                    cache.reorder(index, sentences)
                    history, sentence = history[index], sentence[index]
                    steps = [s[index] for s in steps]
            feed = tgt[history[:, t], t : t + 1]
            steps.append(model.decode(feed, enc, cache))
        own = torch.stack([tgt[history[:, t], t] for t in range(tgt.shape[1])], dim=1)
        expected = model(src[sentence], own)
    return torch.cat(steps, dim=1), expected


def test_beam_reorder_within_sentences_equals_full_forward_of_each_history() -> None:
    """Beams share their sentence's state; each row attends to exactly its own history after reorders."""
    model = make_model()
    reorders = [(2, torch.tensor([2, 2, 0, 4, 3, 3]), None), (3, torch.tensor([1, 0, 0, 5, 5, 4]), None)]
    got, expected = beam_rows_decoding(model, 3, reorders)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_beam_reorder_with_narrower_keys_equals_full_forward_of_each_history() -> None:
    """The cache holds keys d_k wide and values d_v wide in buffers of their own."""
    model = make_model(d_k=3)
    reorders = [(2, torch.tensor([2, 2, 0, 4, 3, 3]), None), (4, torch.tensor([4, 4, 3]), torch.tensor([1]))]
    got, expected = beam_rows_decoding(model, 3, reorders)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_beam_reorder_that_drops_a_sentence_equals_full_forward() -> None:
    model = make_model()
    reorders = [(2, torch.tensor([1, 0, 0, 4, 3, 3]), None), (4, torch.tensor([4, 4, 3]), torch.tensor([1]))]
    got, expected = beam_rows_decoding(model, 3, reorders)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_widening_a_one_beam_cache_to_k_beams_equals_full_forward_of_each_history() -> None:
    """Beam search decodes its first step with one row per sentence, then ``reorder(..., beams=k)`` gives each
    sentence k beams that continue that row; each then attends to exactly its own history."""
    model = make_model()
    src, tgt = tokens([7, 3], seed=1), tokens([6] * 6, seed=2)
    tgt[:3, 0], tgt[3:, 0] = tgt[0, 0], tgt[3, 0]  # the 3 beams of a sentence share its first position
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc, beams=1, capacity=8)
        steps = [model.decode(tgt[[0, 3], :1], enc, cache).repeat_interleave(3, dim=0)]
        cache.reorder(torch.tensor([0, 0, 0, 1, 1, 1]), beams=3)
        layer = cache.layers[0]
        assert cache.beams == 3 and layer.self_k.shape == (2, 4, 8, 3, 8)
        assert layer.self_k[:, :, 0, 1:].eq(0).all()  # the new slots of the cached position: zeros, not stale memory
        for t in range(1, tgt.shape[1]):
            steps.append(model.decode(tgt[:, t : t + 1], enc, cache))
        expected = model(src.repeat_interleave(3, dim=0), tgt)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)


def test_beam_reorder_refuses_fewer_beams() -> None:
    model = make_model()
    with torch.no_grad():
        enc = model.encode(tokens([7, 3], seed=1))
        cache = model.init_cache(enc, beams=2)
        with pytest.raises(ValueError, match="more beams, not fewer: 2 -> 1"):
            cache.reorder(torch.tensor([0, 2]), beams=1)


def test_beam_reorder_copies_no_cached_keys_or_values() -> None:
    model = make_model()
    with torch.no_grad():
        enc = model.encode(tokens([7, 3], seed=1))
        cache = model.init_cache(enc, beams=3, capacity=8)
        model.decode(tokens([6] * 6, seed=2)[:, :2], enc, cache)
        layer = cache.layers[0]
        before = [layer.self_k.data_ptr(), layer.self_v.data_ptr(), layer.cross_k.data_ptr()]
        cache.reorder(torch.tensor([2, 2, 0, 4, 3, 3]))
        assert [layer.self_k.data_ptr(), layer.self_v.data_ptr(), layer.cross_k.data_ptr()] == before
        assert cache.ancestry.tolist() == [[[2, 2], [2, 2], [0, 0]], [[1, 1], [0, 0], [0, 0]]]
        assert layer.cross_k.shape[0] == 2 and layer.self_k.shape[:3] == (2, 4, 8)  # per sentence, capacity 8


def test_beam_reorder_that_swaps_then_drops_sentences_in_place_equals_full_forward() -> None:
    """Sentences moved within the buffers (each moved row read before any is written) decode exactly."""
    model = make_model()
    reorders = [
        (2, torch.tensor([4, 3, 3, 0, 2, 1]), torch.tensor([1, 0])),
        (4, torch.tensor([3, 5, 5]), torch.tensor([1])),
    ]
    got, expected = beam_rows_decoding(model, 3, reorders)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_dropping_sentences_copies_only_the_rows_that_move() -> None:
    """Keeping fewer sentences writes into the same buffers: kept sentences already in place are not copied."""
    model = make_model()
    with torch.no_grad():
        enc = model.encode(tokens([7, 3, 5, 4], seed=1))
        cache = model.init_cache(enc, beams=2, capacity=8)
        model.decode(tokens([6] * 8, seed=2)[:, :2], enc, cache)
        layer = cache.layers[0]
        before = [t.data_ptr() for t in (layer.self_k, layer.self_v, layer.cross_k, layer.cross_v)]
        rows = {name: getattr(layer, name).clone() for name in ("self_k", "self_v", "cross_k", "cross_v")}
        cache.reorder(torch.tensor([6, 7, 2, 3]), sentences=torch.tensor([3, 1]))  # 0 and 2 done; 3 fills place 0
        assert [t.data_ptr() for t in (layer.self_k, layer.self_v, layer.cross_k, layer.cross_v)] == before
        for name, old in rows.items():
            kept = getattr(layer, name)
            assert kept.shape[0] == 2
            if name.startswith("self"):  # positions [:2] are written; the rest of the capacity is unused
                torch.testing.assert_close(kept[:, :, :2], old[[3, 1], :, :2], atol=0, rtol=0)
            else:
                torch.testing.assert_close(kept, old[[3, 1]], atol=0, rtol=0)


def test_beam_reorder_refuses_to_move_a_row_to_another_sentence() -> None:
    model = make_model()
    with torch.no_grad():
        enc = model.encode(tokens([7, 3], seed=1))
        cache = model.init_cache(enc, beams=2)
        with pytest.raises(ValueError, match="moves row 2 .sentence 1. to row 1 of sentence 0"):
            cache.reorder(torch.tensor([0, 2, 2, 3]))
        with pytest.raises(ValueError, match="3 rows for 2 sentences x 2 beams"):
            cache.reorder(torch.tensor([0, 1, 1]))


def test_cache_step_mask_is_causal_and_follows_the_ancestry() -> None:
    model = make_model()
    with torch.no_grad():
        enc = model.encode(tokens([4], seed=1))
        cache = model.init_cache(enc)
        model.decode(tokens([3], seed=2), enc, cache)
        assert cache.step(1).mask is None  # one beam, one new position: it sees everything
        assert cache.step(2).mask.view(2, 5).eq(0).tolist() == [[True] * 4 + [False], [True] * 5]  # 0 or -inf
        beams = model.init_cache(enc.reorder(torch.tensor([0])), beams=2)
        model.decode(tokens([1, 1], seed=2), enc, beams)
        beams.reorder(torch.tensor([1, 1]))
        # keys ordered (position 0: slot 0, slot 1), (position 1: slot 0, slot 1); both beams descend from slot 1
        assert beams.step(1).mask.view(2, 4).eq(0).tolist() == [[False, True, True, False], [False, True, False, True]]


def test_decode_refuses_a_batch_that_does_not_match_the_reordered_cache() -> None:
    model = make_model()
    src, tgt = tokens([5, 3], seed=1), tokens([4, 4], seed=2)
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc)
        model.decode(tgt[:, :1], enc, cache)
        cache.reorder(torch.tensor([1, 1, 0]), sentences=torch.tensor([1, 1, 0]))
        with pytest.raises(ValueError, match="2 target rows but the cache holds 3"):
            model.decode(tgt[:, 1:2], enc, cache)


def test_cache_without_source_padding_needs_no_mask() -> None:
    model = make_model()
    src, tgt = tokens([5, 5], seed=1), tokens([4, 4], seed=2)
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc)
        assert cache.cross_mask is None
        steps = [model.decode(tgt[:, t : t + 1], enc, cache) for t in range(4)]
        torch.testing.assert_close(torch.cat(steps, 1), model(src, tgt), atol=1e-5, rtol=0)


def test_reorder_before_the_first_decode_and_a_growing_buffer() -> None:
    """Reordering an empty cache only renames beams; a buffer of capacity 2 grows as positions arrive."""
    model = make_model()
    src, tgt = tokens([6, 4], seed=1), tokens([5] * 4, seed=2)
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc, beams=2, capacity=2)
        assert cache.reorder(torch.tensor([1, 0, 3, 2])) is cache
        with pytest.raises(ValueError, match="3 target rows but the cache holds 4"):
            model.decode(tgt[:3, :1], enc, cache)
        steps = [model.decode(tgt[:, t : t + 1], enc, cache) for t in range(5)]
        assert cache.layers[0].self_k.shape[2] == 8  # 2 -> 4 -> 8 positions
    torch.testing.assert_close(torch.cat(steps, 1), model(src.repeat_interleave(2, 0), tgt), atol=1e-5, rtol=0)


def masks_seen(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> tuple[object, object]:
    """The mask the first encoder layer and the first decoder layer's cross-attention got in a forward pass."""
    seen: list[object] = []
    hooks = [
        model.encoder[0].register_forward_pre_hook(lambda m, args: seen.append(args[1])),
        model.decoder[0].register_forward_pre_hook(lambda m, args: seen.append(args[3])),
    ]
    with torch.no_grad():
        model(src, tgt)
    for h in hooks:
        h.remove()
    return seen[0], seen[1]


def test_no_padding_passes_no_mask_so_flash_attention_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    tgt = tokens([4, 4], seed=2)
    assert masks_seen(model, tokens([5, 5], seed=1), tgt) == (None, None)
    enc_mask, cross_mask = masks_seen(model, tokens([5, 3], seed=1), tgt)
    assert enc_mask.tolist() == cross_mask.tolist() == [[[[True] * 5]], [[[True] * 3 + [False] * 2]]]
    # Under torch.compile the mask is always passed: a data-dependent branch would break the graph.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    enc_mask, cross_mask = masks_seen(model, tokens([5, 5], seed=1), tgt)
    assert enc_mask is not None and bool(enc_mask.all()) and cross_mask is not None


# ---------------------------------------------------------------- parameters, variants, errors


def paper_parameter_count(d: int, d_ff: int, n: int, vocab: int) -> int:
    """Unique parameters of the paper's model with one tied embedding matrix.

    attention  = 4 (d*d + d)              W_Q, W_K, W_V, W_O with biases
    ffn        = d*d_ff + d_ff + d_ff*d + d
    encoder    = n (attention + ffn + 2 * 2d)       two LayerNorms
    decoder    = n (2 attention + ffn + 3 * 2d)     three LayerNorms
    embeddings = vocab * d                          shared by source, target and output projection
    """
    attention = 4 * (d * d + d)
    ffn = d * d_ff + d_ff + d_ff * d + d
    return n * (attention + ffn + 4 * d) + n * (2 * attention + ffn + 6 * d) + vocab * d


@pytest.mark.parametrize(
    ("d", "d_ff", "heads", "expected", "paper"),
    [
        (512, 2048, 8, 63_082_496, 63.1e6),  # base: 18,944,000 embeddings + 6 x 3,152,384 + 6 x 4,204,032
        (1024, 4096, 16, 214_245_376, 214.3e6),  # big: 37,888,000 + 6 x 12,596,224 + 6 x 16,796,672
    ],
)
def test_parameter_count_of_base_and_big(d: int, d_ff: int, heads: int, expected: int, paper: float) -> None:
    assert paper_parameter_count(d, d_ff, 6, 37_000) == expected
    cfg = ModelConfig(d_model=d, d_ff=d_ff, heads=heads)
    with torch.device("meta"):  # shapes only: no memory, no initialization time
        model = Transformer(cfg, 37_000)
    assert count_parameters(model) == expected
    assert abs(expected - paper) / paper < 0.01


def test_parameter_count_of_variants() -> None:
    base = paper_parameter_count(32, 64, 2, V)
    assert count_parameters(make_model()) == base
    assert count_parameters(make_model(norm="pre")) == base + 2 * 2 * 32  # final encoder and decoder LayerNorm
    assert count_parameters(make_model(positions="learned")) == base + 64 * 32
    assert count_parameters(make_model(share_embeddings=False)) == base + V * 32  # separate source embedding
    # d_k 4 instead of 32/4 = 8: W_Q and W_K of each of the 6 attentions lose 4 heads x 4 rows (and biases)
    assert count_parameters(make_model(d_k=4)) == base - 6 * 2 * (16 * 32 + 16)


def test_shared_embeddings_are_one_tensor() -> None:
    model = make_model()
    assert model.src_embed is None
    names = [n for n, _ in model.named_parameters() if "embed" in n]
    assert names == ["embed.weight"]
    src, tgt = tokens([4], seed=1), tokens([3], seed=2)
    out = model(src, tgt)
    (grad,) = torch.autograd.grad(out.sum(), model.embed.weight)
    unused = torch.ones(V, dtype=torch.bool)
    unused[src.flatten()] = False
    unused[tgt.flatten()] = False
    assert grad[unused].abs().sum() > 0  # rows never looked up still get the output projection's gradient
    with torch.no_grad():  # and the encoder reads the same tensor
        before = model.encode(src).memory
        model.embed.weight[src[0, 0]] += 1.0
        assert not torch.allclose(model.encode(src).memory, before)


def test_separate_source_embedding_keeps_target_tied_to_output() -> None:
    model = make_model(share_embeddings=False)
    assert model.src_embed is not None and model.src_embed.weight is not model.embed.weight
    src, tgt = tokens([4], seed=1), tokens([3], seed=2)
    g_src, g_tgt = torch.autograd.grad(model(src, tgt).sum(), [model.src_embed.weight, model.embed.weight])
    looked_up = torch.zeros(V, dtype=torch.bool)
    looked_up[src.flatten()] = True
    assert torch.equal(g_src.abs().sum(dim=1).gt(0), looked_up)  # the source table feeds only the encoder
    assert g_tgt.abs().sum(dim=1).gt(0).all()  # every row: the output projection uses the whole matrix


@pytest.mark.parametrize(
    "changes", [{"positions": "learned"}, {"norm": "pre"}, {"encoder_no_residual_layer": 1}], ids=str
)
def test_variants_run_and_differ_from_the_defaults(changes: dict) -> None:
    src, tgt = tokens([6, 4], seed=1), tokens([5, 3], seed=2)
    default, variant = make_model(seed=0), make_model(seed=0, **changes)
    out = variant(src, tgt)
    assert out.shape == (2, 5, V) and torch.isfinite(out).all()
    assert not torch.allclose(out, default(src, tgt), atol=1e-3)
    out.sum().backward()
    assert all(p.grad is not None for p in variant.parameters())


def test_post_norm_ends_each_layer_with_layer_norm_and_pre_norm_adds_final_norms() -> None:
    post, pre = make_model(), make_model(norm="pre")
    assert post.encoder_norm is None and post.decoder_norm is None
    assert pre.encoder_norm is not None and pre.decoder_norm is not None
    memory = post.encode(tokens([6, 6], seed=1)).memory  # the last sublayer is LayerNorm(x + FFN(x))
    torch.testing.assert_close(memory.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)
    torch.testing.assert_close(memory.var(-1, unbiased=False), torch.ones(2, 6), atol=1e-3, rtol=0)


def test_xavier_weight_initialization() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=256, d_ff=1024, heads=4, encoder_layers=1, decoder_layers=1, init="xavier")
    model = Transformer(cfg, 4000, pad_id=PAD)
    emb = model.embed.weight
    assert emb[PAD].abs().sum() == 0
    assert emb[1:].std().item() == pytest.approx(256**-0.5, rel=0.02)
    qkv = model.encoder[0].self_attn.qkv
    for block in qkv.weight.split(256):  # each of W_Q, W_K, W_V is xavier-uniform on its own (256, 256)
        bound = math.sqrt(6 / (256 + 256))
        assert block.abs().max() <= bound and block.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    fc1 = model.encoder[0].ffn.fc1.weight
    assert fc1.abs().max() <= math.sqrt(6 / (256 + 1024))
    assert all(m.bias.abs().sum() == 0 for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_dropout_is_active_in_training_only() -> None:
    src, tgt = tokens([6, 4], seed=1), tokens([5, 3], seed=2)
    for changes in [{}, {"dropout": 0.0, "attention_dropout": 0.3}, {"dropout": 0.0, "activation_dropout": 0.3}]:
        model = make_model(**changes)
        with torch.no_grad():
            torch.testing.assert_close(model(src, tgt), model(src, tgt))
            model.train()
            assert not torch.allclose(model(src, tgt), model(src, tgt)), changes
    model = make_model(dropout=0.0).train()  # nothing random left
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), model(src, tgt))


def test_sequences_longer_than_max_positions_are_refused() -> None:
    model = make_model(max_positions=8)
    with pytest.raises(PositionError, match=r"9 positions.*model\.max_positions is 8"):
        model.encode(tokens([9], seed=1))
    enc = model.encode(tokens([4], seed=1))
    cache = model.init_cache(enc)
    model.decode(tokens([8], seed=2), enc, cache)
    with pytest.raises(PositionError, match=r"9 positions.*model\.max_positions"):
        model.decode(tokens([1], seed=3), enc, cache)


def test_heads_must_divide_d_model(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"model\.d_model \(512\) must be divisible by model\.heads \(7\)"):
        load_config(None, ["model.heads=7"])
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: 100\n  heads: 8\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="try heads="):
        load_config(path)
    with pytest.raises(ValueError, match="divisible"):
        Transformer(dataclasses.replace(TINY, heads=5), V)


@pytest.mark.parametrize("layer", [-1, 7])
def test_encoder_no_residual_layer_names_the_model_layers(layer: int) -> None:
    with pytest.raises(ConfigError, match=rf"model\.encoder_no_residual_layer {layer}: .*layers 1 to 6 \(0: off"):
        load_config(None, [f"model.encoder_no_residual_layer={layer}"])
    assert load_config(None, ["model.encoder_no_residual_layer=6"]).model.encoder_no_residual_layer == 6


@pytest.mark.parametrize("d_k", [0, 4])
def test_flops_per_token_counts_six_per_matmul_weight_plus_attention(d_k: int) -> None:
    cfg = dataclasses.replace(TINY, encoder_layers=2, decoder_layers=3, d_k=d_k)
    model = make_model(encoder_layers=2, decoder_layers=3, d_k=d_k)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    L, D, K = 20, cfg.d_model, cfg.heads * (d_k or cfg.d_model // cfg.heads)
    qk_av = 2 * L * K + 2 * L * D  # per attention and query: Q K^T (K wide) and A V (D wide) over L keys
    attention = 3 * (2 * qk_av + 3 * 2 * qk_av)  # 2 encoder layers, 3 decoder layers of 2 attentions
    expected = 6 * (matmul_weights + V * D) + attention  # + the tied output projection
    assert flops_per_token(cfg, V, L, L) == pytest.approx(expected)
    # Twice the source length doubles the encoder's and cross-attention K/V's share per target token.
    assert flops_per_token(cfg, V, 2 * L, L) > flops_per_token(cfg, V, L, L)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_matches_cpu_and_cached_decoding_under_bf16() -> None:
    model = make_model()
    src, tgt = tokens([7, 3, 5], seed=1), tokens([8, 8, 8], seed=2)
    with torch.no_grad():
        expected = model(src, tgt)
        gpu = model.cuda()
        src, tgt = src.cuda(), tgt.cuda()
        torch.testing.assert_close(gpu(src, tgt).cpu(), expected, atol=1e-4, rtol=1e-4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            full = gpu(src, tgt).float()
            enc = gpu.encode(src)
            cache = gpu.init_cache(enc)
            steps = torch.cat([gpu.decode(tgt[:, t : t + 1], enc, cache).float() for t in range(8)], dim=1)
    torch.testing.assert_close(steps, full, atol=0.1, rtol=0.05)
    assert (steps.argmax(-1) == full.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_flash_attention_runs_on_a_batch_without_padding() -> None:
    """CUDA's flash kernel takes no explicit mask: it only runs because an unpadded batch passes None."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model().cuda()
    src, tgt = tokens([7, 7, 7], seed=1).cuda(), tokens([8, 8, 8], seed=2).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = model(src, tgt).float()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = model(src, tgt).float()
    torch.testing.assert_close(flash, expected, atol=0.05, rtol=0.05)


# ---------------------------------------------------------------- initialization


def _uniform_bound(t: torch.Tensor) -> float:
    return float(t.detach().abs().max())


def test_fairseq_init_scales_each_projection_as_fairseq_does() -> None:
    """Q/K/V Xavier gain 1/sqrt(2) per block, W_O Xavier with zero bias, FFN and other biases PyTorch's default."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, d_model=64, d_ff=256, heads=4, init="fairseq")
    model = Transformer(cfg, 1000, pad_id=PAD)
    xavier = math.sqrt(6 / (64 + 64))
    layer = model.decoder[0]
    for block in layer.self_attn.qkv.weight.chunk(3) + layer.cross_attn.kv.weight.chunk(2):
        assert 0.9 * xavier / math.sqrt(2) < _uniform_bound(block) <= xavier / math.sqrt(2)
    assert 0.9 * xavier / math.sqrt(2) < _uniform_bound(layer.cross_attn.q.weight) <= xavier / math.sqrt(2)
    assert 0.9 * xavier < _uniform_bound(layer.self_attn.out.weight) <= xavier
    assert not layer.self_attn.out.bias.any() and not layer.cross_attn.out.bias.any()
    assert 0.5 * 64**-0.5 < _uniform_bound(layer.self_attn.qkv.bias) <= 64**-0.5  # default Linear bias, not zero
    assert 0.9 * 64**-0.5 < _uniform_bound(layer.ffn.fc1.weight) <= 64**-0.5  # default Linear: U(+-1/sqrt(fan_in))
    assert 0.9 * 256**-0.5 < _uniform_bound(layer.ffn.fc2.weight) <= 256**-0.5
    assert model.embed.weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    assert not model.embed.weight[PAD].any()
