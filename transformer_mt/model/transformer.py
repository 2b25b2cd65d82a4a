"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Defaults are the paper's: post-norm layers LayerNorm(x + Dropout(Sublayer(x))),
ReLU feed-forward, sinusoidal positions added to embeddings scaled by
sqrt(d_model), dropout on that sum and on every sublayer output, and one
embedding matrix shared by source, target and the pre-softmax projection.
Each deviation (pre-norm, learned positions, attention/activation dropout,
separate source embedding, an encoder layer without its attention residual)
is a `ModelConfig` key that is off by default.

The decoding API (`encode`, `init_cache`, `decode` with a `DecoderCache`) lets
beam search run one new position per step: cross-attention keys/values are
computed and held once per sentence, self-attention keys/values are written
once per step and never copied when beams are reordered
(`transformer_mt.model.cache`). `forward_with_attention` is the one pass that
also returns every attention weight (`AttentionMaps`), for drawing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_mt.config import ModelConfig
from transformer_mt.model.attention import CrossAttention, SelfAttention, additive_mask, head_dims
from transformer_mt.model.cache import MIN_CAPACITY, DecoderCache, LayerCache, Step
from transformer_mt.model.dropout import Dropout
from transformer_mt.model.packing import Packing
from transformer_mt.model.positions import LearnedPositions, SinusoidalPositions


@dataclass
class EncoderOut:
    """What the decoder needs from the encoder."""

    memory: Tensor  # (B, S, D) encoder output, or (N, D) for the real source tokens of `packing`
    src_pad_mask: Tensor  # (B, S) bool, True at padding
    packing: Packing | None = None  # set when `memory` is packed (teacher forcing on the CPU)

    def reorder(self, index: Tensor) -> EncoderOut:
        """A new EncoderOut with rows `index` (LongTensor): drop finished sentences, or repeat rows for beams."""
        return EncoderOut(self.memory.index_select(0, index), self.src_pad_mask.index_select(0, index))


@dataclass
class AttentionMaps:
    """Attention weights of one forward pass, one (B, H, queries, keys) tensor per layer, bottom layer first.

    Probabilities over keys (rows sum to 1), as the paper's Figures 3-5 draw them.
    """

    encoder: list[Tensor] = field(default_factory=list)  # (B, H, S, S) encoder self-attention
    decoder: list[Tensor] = field(default_factory=list)  # (B, H, T, T) masked decoder self-attention
    cross: list[Tensor] = field(default_factory=list)  # (B, H, T, S) decoder queries over the encoder output


def residual(
    x: Tensor, norm: nn.LayerNorm, sublayer: Callable[[Tensor], Tensor], drop: Dropout, pre: bool, skip: bool = True
) -> Tensor:
    """Post-norm LayerNorm(x + Dropout(Sublayer(x))) (paper), or pre-norm x + Dropout(Sublayer(LayerNorm(x)));
    ``skip=False`` leaves out the ``x +`` (`ModelConfig.encoder_no_residual_layer`)."""
    y = drop(sublayer(norm(x) if pre else x))
    if skip:
        y = x + y
    return y if pre else norm(y)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper eq. 2), applied at each position."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.relu: nn.Module = nn.ReLU()  # `use_onednn_linears` moves it into fc1's oneDNN call (an Identity here)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.drop = Dropout(activation_dropout)  # deviation; p=0 by default

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(self.relu(self.fc1(x))))  # (B, T, D)


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each wrapped in dropout + residual + LayerNorm.

    With ``attention_residual=False`` the self-attention's output replaces its input instead of adding to it
    (Liu et al. 2021): each position's state no longer carries its own token and position forward unchanged,
    and the states above become less tied to the source language's word order, which helps zero-shot directions.
    """

    def __init__(self, cfg: ModelConfig, attention_residual: bool = True) -> None:
        super().__init__()
        self.pre = cfg.norm == "pre"
        self.attention_residual = attention_residual
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cfg.d_k)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.drop = Dropout(cfg.dropout)

    def forward(
        self, x: Tensor, mask: Tensor | None, maps: AttentionMaps | None = None, packing: Packing | None = None
    ) -> Tensor:
        """x (B, S, D), or (N, D) for the real tokens of ``packing``; mask (B, 1, 1, S) True at real keys, or
        None when nothing is padded.

        With ``maps``, the attention weights are computed explicitly and appended to ``maps.encoder``.
        """
        weights = None if maps is None else maps.encoder
        attend = partial(self.self_attn, mask=mask, weights=weights, packing=packing)
        x = residual(x, self.norm1, attend, self.drop, self.pre, self.attention_residual)
        return residual(x, self.norm2, self.ffn, self.drop, self.pre)  # (B, S, D) or (N, D)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cfg.d_k)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cfg.d_k)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.drop = Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        cross_mask: Tensor | None,
        cache: LayerCache | None = None,
        step: Step | None = None,
        maps: AttentionMaps | None = None,
        packing: Packing | None = None,
    ) -> Tensor:
        """x (B*G, T, D) new target positions; cross_k/v (B, H, S, d_k|d_v); cross_mask (B, 1, 1, S) or None.

        G = x rows per cross-attention row (the beams of a sentence; 1 without
        a cache). With a cache, `step` says where the new positions go. With
        ``maps``, both attentions' weights are computed explicitly and appended.
        With the target's ``packing`` (teacher forcing), x is (N, D), its real positions.
        """
        mine, cross = (None, None) if maps is None else (maps.decoder, maps.cross)
        x = residual(x, self.norm1, lambda h: self._self_attend(h, cache, step, mine, packing), self.drop, self.pre)
        attend = partial(self.cross_attn, k=cross_k, v=cross_v, mask=cross_mask, weights=cross, packing=packing)
        x = residual(x, self.norm2, attend, self.drop, self.pre)
        return residual(x, self.norm3, self.ffn, self.drop, self.pre)  # (B, T, D) or (N, D)

    def _self_attend(
        self,
        h: Tensor,
        cache: LayerCache | None,
        step: Step | None,
        weights: list[Tensor] | None,
        packing: Packing | None = None,
    ) -> Tensor:
        """Causal self-attention; with a cache, h holds only new positions and their K/V are added to it."""
        q, k, v = self.self_attn.project(h, packing)  # (B, H, T, d_k|d_v) each
        if cache is None or step is None:
            # Right padding: a real query only ever sees earlier, real keys, so the causal mask suffices.
            return self.self_attn.attend(q, k, v, is_causal=True, weights=weights, packing=packing)
        keys, values = cache.append(k, v, step)  # (n, H, (past+T)*k, d_k|d_v), n = B / k sentences
        return self.self_attn.attend(q, keys, values, mask=step.mask, groups=step.beams, weights=weights)


def key_mask(pad_mask: Tensor) -> Tensor:
    """(B, S) True-at-padding -> (B, 1, 1, S) True-where-attending-is-allowed, for the fused kernel."""
    return (~pad_mask)[:, None, None, :]


def padding_mask_or_none(pad_mask: Tensor, training: bool = False) -> Tensor | None:
    """`key_mask(pad_mask)`, or None when nothing is padded: without a mask CUDA can use the flash kernel.

    Under torch.compile the mask is always passed, so that this data-dependent test never breaks the graph;
    so it is in training on CUDA, where nearly every batch is padded anyway and the test would make the host
    wait for the device at every forward.
    """
    if torch.compiler.is_compiling() or (training and pad_mask.is_cuda) or bool(pad_mask.any()):
        return key_mask(pad_mask)
    return None


class Transformer(nn.Module):
    """Encoder-decoder Transformer; `forward(src, tgt_in)` gives logits (B, T, V) for teacher forcing."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int = 0) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"model.d_model ({cfg.d_model}) must be divisible by model.heads ({cfg.heads})")
        self.cfg = cfg
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.embed_scale = math.sqrt(cfg.d_model)
        # Target embedding, tied to the pre-softmax projection; also the source embedding when shared.
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        self.src_embed = None if cfg.share_embeddings else nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        pos_cls = SinusoidalPositions if cfg.positions == "sinusoidal" else LearnedPositions
        self.positions = pos_cls(cfg.max_positions, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(
            EncoderLayer(cfg, attention_residual=i != cfg.encoder_no_residual_layer)
            for i in range(1, cfg.encoder_layers + 1)
        )
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the residual stream unnormalized, so each stack ends with a LayerNorm.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else None
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else None
        # None: logits = x E^T with the tied embedding. `quantize.quantize_int8` puts that projection here as a
        # quantized layer of its own; nothing is stored in checkpoints.
        self.output_projection: nn.Module | None = None
        self._init_weights()

    def _init_weights(self) -> None:
        """Initialize every weight by ``cfg.init``; embeddings N(0, d_model^-0.5) with the padding row 0.

        ``xavier``: Xavier-uniform per projection matrix (W_Q, W_K, W_V as three
        matrices), zero biases. ``fairseq``: fairseq's scheme, Xavier with gain
        1/sqrt(2) on W_Q, W_K, W_V, Xavier on W_O with a zero bias, PyTorch's
        default Linear init for the feed-forward layers and the other biases;
        its smaller query/key/value and FFN-output weights learn faster early.
        """
        fairseq = self.cfg.init == "fairseq"
        qkv_gain = 2**-0.5 if fairseq else 1.0
        for m in self.modules():
            if isinstance(m, SelfAttention):
                qk, v = m.heads * m.d_k, m.heads * m.d_v
                init_linear(m.qkv, blocks=(qk, qk, v), gain=qkv_gain, zero_bias=not fairseq)
                init_linear(m.out)
            elif isinstance(m, CrossAttention):
                init_linear(m.q, gain=qkv_gain, zero_bias=not fairseq)
                init_linear(m.kv, blocks=(m.heads * m.d_k, m.heads * m.d_v), gain=qkv_gain, zero_bias=not fairseq)
                init_linear(m.out)
            elif isinstance(m, FeedForward):
                for fc in (m.fc1, m.fc2):
                    if fairseq:
                        fc.reset_parameters()
                    else:
                        init_linear(fc)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=self.cfg.d_model**-0.5)
                with torch.no_grad():
                    m.weight[self.pad_id].zero_()

    def _embed(
        self, table: nn.Embedding, tokens: Tensor, offset: int | Tensor, packing: Packing | None = None
    ) -> Tensor:
        """Dropout(sqrt(d_model) * E[tokens] + PE[offset:offset+T]): (B, T) -> (B, T, D), or (N, D) for the
        real tokens of ``packing``; ``offset`` may be one per row (B,) (`DecoderCache.offsets`)."""
        positions = self.positions(tokens.shape[1], offset)  # (T, D), or (B, T, D)
        if packing is not None:
            tokens, positions = packing.pack(tokens), positions.index_select(0, packing.cols)
        x = table(tokens) * self.embed_scale  # (B, T, D) or (N, D)
        return self.drop(x + positions)

    def encode(self, src: Tensor, maps: AttentionMaps | None = None, pack: bool = False) -> EncoderOut:
        """src (B, S) token ids, right-padded -> EncoderOut(memory (B, S, D), src_pad_mask (B, S)).

        With ``maps``, each layer's attention weights are appended to ``maps.encoder`` (see `forward_with_attention`).
        With ``pack``, the layers run on the real tokens alone and memory is (N, D) (`Packing`).
        """
        src_pad_mask = src.eq(self.pad_id)  # (B, S)
        packing = Packing.of(src_pad_mask) if pack else None
        x = self._embed(self.embed if self.src_embed is None else self.src_embed, src, 0, packing)
        mask = padding_mask_or_none(src_pad_mask, self.training)
        for layer in self.encoder:
            x = layer(x, mask, maps, packing)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return EncoderOut(x, src_pad_mask, packing)

    def init_cache(self, enc: EncoderOut, beams: int = 1, capacity: int = MIN_CAPACITY) -> DecoderCache:
        """An empty cache for ``beams`` hypotheses per sentence of `enc`, holding each layer's cross-attention
        keys/values once per sentence.

        Rows r*beams .. r*beams+beams-1 of a decode batch belong to sentence r.
        ``capacity`` target positions are allocated at the first step, and a
        full buffer doubles (`model.cache`); beam search starts small, so a
        batch holds room for what its hypotheses reach, not for every
        sentence's maximum length.
        """
        layers = []
        for layer in self.decoder:
            k, v = layer.cross_attn.project_memory(enc.memory)  # (B, H, S, Dh) each
            layers.append(LayerCache(None, None, k.contiguous(), v.contiguous()))
        ancestry = torch.zeros(enc.memory.shape[0], beams, 0, dtype=torch.long, device=enc.memory.device)
        cross_mask = additive_mask(padding_mask_or_none(enc.src_pad_mask))  # built once for every step and layer
        return DecoderCache(layers, cross_mask, beams, ancestry, capacity)

    def decode(
        self,
        tgt_in: Tensor,
        enc: EncoderOut,
        cache: DecoderCache | None = None,
        maps: AttentionMaps | None = None,
        pack: bool = False,
    ) -> Tensor:
        """Logits (B, T, V) of the next token at each position of tgt_in (B, T); with ``pack`` (teacher forcing
        only), (N, V) for its N real positions in row-major order, computed on those alone (`Packing`).

        Without a cache, tgt_in is the whole shifted-right target (teacher
        forcing). With one, tgt_in holds only the new positions (usually one),
        their self-attention keys/values are appended to the cache, and the
        cross-attention state is read from the cache, not from `enc`. With
        ``maps``, the attention weights are appended to ``maps.decoder`` and ``maps.cross``.
        """
        return self.logits(self.decode_features(tgt_in, enc, cache, maps, pack))

    def decode_features(
        self,
        tgt_in: Tensor,
        enc: EncoderOut,
        cache: DecoderCache | None = None,
        maps: AttentionMaps | None = None,
        pack: bool = False,
    ) -> Tensor:
        """`decode` up to the pre-softmax projection: the decoder's output (B, T, D), or (N, D) with ``pack``.

        A beam search projects these a few rows at a time (`transformer_mt.decode.search.best_extensions`), so
        that a step's (rows, V) logits, the largest tensor of decoding, never exist all at once.
        """
        offset = 0 if cache is None else cache.offsets()
        if pack and cache is not None:
            raise ValueError("decode packs the target in teacher forcing only, not with a cache")
        if cache is not None and cache.rows != tgt_in.shape[0]:
            raise ValueError(
                f"decode got {tgt_in.shape[0]} target rows but the cache holds {cache.rows} "
                f"({cache.rows // cache.beams} sentences x {cache.beams} beams); pass one row per cache row"
            )
        packing = Packing.of(tgt_in.eq(self.pad_id)) if pack else None
        x = self._embed(self.embed, tgt_in, offset, packing)  # (B, T, D) or (N, D)
        if cache is None:
            cross_mask = padding_mask_or_none(enc.src_pad_mask, self.training)
            for layer in self.decoder:
                k, v = layer.cross_attn.project_memory(enc.memory, enc.packing)
                x = layer(x, k, v, cross_mask, None, maps=maps, packing=packing)
        else:
            step = cache.step(tgt_in.shape[1])
            for layer, lc in zip(self.decoder, cache.layers, strict=True):
                x = layer(x, lc.cross_k, lc.cross_v, cache.cross_mask, lc, step, maps)
            cache.advance(tgt_in.shape[1])
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """The tied pre-softmax projection of decoder outputs ``x`` (..., D): logits (..., V)."""
        if self.output_projection is not None:
            return self.output_projection(x)  # the same projection as a layer of its own (int8, oneDNN)
        return F.linear(x, self.embed.weight)

    def forward(self, src: Tensor, tgt_in: Tensor, pack: bool = False) -> Tensor:
        """Teacher-forced logits (B, T, V) for src (B, S) and tgt_in (B, T).

        With ``pack``, (N, V) for the N real (non-padding) positions of tgt_in in
        row-major order, which is ``logits[tgt_in != pad]``: the layers then run
        on the real tokens alone (`Packing`), as training on the CPU does.
        """
        return self.decode(tgt_in, self.encode(src, pack=pack), pack=pack)

    def forward_with_attention(self, src: Tensor, tgt_in: Tensor) -> tuple[Tensor, AttentionMaps]:
        """`forward`'s logits and every layer's attention weights, computed explicitly (for drawing them).

        The same model and the same outputs as `forward` (to float rounding),
        through softmax(Q K^T / sqrt(d_k)) V instead of the fused kernel.
        """
        maps = AttentionMaps()
        return self.decode(tgt_in, self.encode(src, maps), maps=maps), maps


def init_linear(linear: nn.Linear, blocks: tuple[int, ...] = (), gain: float = 1.0, zero_bias: bool = True) -> None:
    """Xavier-uniform each stacked matrix of ``blocks`` output rows (default: one), as if they were separate.

    The bias is zeroed, or with ``zero_bias=False`` drawn as PyTorch's default
    Linear bias of each part, U(-1/sqrt(in), 1/sqrt(in)).
    """
    for block in linear.weight.data.split(list(blocks) or [linear.out_features], dim=0):
        nn.init.xavier_uniform_(block, gain=gain)
    if zero_bias:
        nn.init.zeros_(linear.bias)
    else:
        bound = linear.in_features**-0.5
        nn.init.uniform_(linear.bias, -bound, bound)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars, each tied tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def model_bytes(cfg: ModelConfig, vocab_size: int) -> int:
    """Bytes of the model's parameters and buffers (tied ones once), counted on a model built on the meta device:
    nothing is allocated, however large the config, so that a model too large for the machine is refused first."""
    with torch.device("meta"):
        model = Transformer(cfg, vocab_size)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def describe_size(cfg: ModelConfig, vocab_size: int) -> str:
    """The keys that size a model, for a message: d_model, d_ff, layers, vocabulary."""
    return (
        f"model.d_model {cfg.d_model}, model.d_ff {cfg.d_ff}, {cfg.encoder_layers}+{cfg.decoder_layers} layers, "
        f"vocabulary {vocab_size}"
    )


def flops_per_token(cfg: ModelConfig, vocab_size: int, src_len: float, tgt_len: float) -> float:
    """Training FLOPs (forward + backward) per target token, for model FLOPs utilization.

    Multiply-adds count 2 FLOPs; backward costs twice the forward, so training is
    3x forward = 6 FLOPs per matmul parameter per token it touches. With
    D = d_model, F = d_ff, S = src_len, T = tgt_len, V = vocab_size and
    K = h * d_k (= D unless model.d_k is set), forward:

      encoder, per source token:   N_enc * (2 * (2 D K + 2 D^2 + 2 D F) + 2 S (K + D))
      cross K/V, per source token: N_dec * 2 * (D K + D^2)
      decoder, per target token:   N_dec * (2 * (2 D K + 2 D^2 + D K + D^2 + 2 D F) + 2 (T + S) (K + D)) + 2 D V

    (2 D K + 2 D^2: W_Q, W_K, W_V, W_O of self-attention; D K + D^2: W_Q,
    W_O of cross-attention; 2 D F: the FFN; 2 D V: the tied output projection.)

    The 2 S (K + D) / 2 T (K + D) terms are Q K^T and attention x V over all
    keys (the causal half is not subtracted, as most MFU reports do). Source
    work is spread over target tokens by S / T. Embedding lookups, LayerNorm,
    softmax and biases are not counted.
    """
    D, Fd = cfg.d_model, cfg.d_ff
    K = cfg.heads * head_dims(D, cfg.heads, cfg.d_k)[0]
    encoder = cfg.encoder_layers * (2 * (2 * D * K + 2 * D * D + 2 * D * Fd) + 2 * src_len * (K + D))
    cross_kv = cfg.decoder_layers * 2 * (D * K + D * D)
    decoder = cfg.decoder_layers * (2 * (3 * D * K + 3 * D * D + 2 * D * Fd) + 2 * (tgt_len + src_len) * (K + D))
    output = 2 * D * vocab_size
    forward = (encoder + cross_kv) * src_len / tgt_len + decoder + output
    return 3.0 * forward
