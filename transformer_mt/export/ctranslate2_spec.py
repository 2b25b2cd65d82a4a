"""A tmt Transformer as CTranslate2's TransformerSpec, and the converter that writes it.

Imported only when ctranslate2 is installed (`transformer_mt.export.require_ctranslate2`).
The mapping, module by module:

- Post-norm (the paper) or pre-norm with the final LayerNorm of each stack;
  LayerNorm epsilon 1e-5 (PyTorch's, written to config.json); ReLU.
- Embeddings multiplied by sqrt(d_model). One matrix for the target
  embedding and the pre-softmax projection (and the source embedding unless
  `model.share_embeddings: false`); CTranslate2 stores equal matrices once.
- Positions: CTranslate2's own sinusoids concatenate [sin..., cos...]
  (tensor2tensor's layout), but the paper's, and tmt's, interleave them (sin
  on even, cos on odd dimensions). The table of `model.max_positions` rows is
  therefore stored explicitly, exactly as tmt adds it (learned positions the
  same way); position p of the encoder and decoder reads row p.
- Self-attention keeps tmt's fused (3D, D) W_Q|W_K|W_V matrix; cross-attention
  W_Q and the fused (2D, D) W_K|W_V; biases as trained.
- Tokens: the sentencepiece pieces, ids unchanged; the decoder starts from
  BOS (``<s>``) and CTranslate2 adds EOS (``</s>``) to every source sentence,
  as tmt's batches do.
"""

from __future__ import annotations

import numpy as np
from ctranslate2.converters import Converter
from ctranslate2.specs import common_spec, transformer_spec
from torch import Tensor, nn

from transformer_mt.data.bpe import BOS, EOS, UNK
from transformer_mt.model.transformer import DecoderLayer, EncoderLayer, FeedForward, Transformer

LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which every tmt LayerNorm uses


class TmtConverter(Converter):
    """CTranslate2's converter interface around a tmt model in memory: `convert(output_dir, quantization)`.

    ``pieces`` are the vocabulary's tokens by id (`ctranslate2_engine.pieces_of`
    for the model's sentencepiece model); PAD, UNK, BOS and EOS at tmt's ids.
    """

    def __init__(self, model: Transformer, pieces: list[str]) -> None:
        self.model = model
        self.pieces = pieces

    def _load(self) -> transformer_spec.TransformerSpec:
        return model_spec(self.model, self.pieces)


def model_spec(model: Transformer, pieces: list[str]) -> transformer_spec.TransformerSpec:
    """The TransformerSpec of ``model`` with its weights and vocabulary (``pieces``, one per id)."""
    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.heads, pre_norm=cfg.norm == "pre",
        activation=common_spec.Activation.RELU,
    )  # fmt: skip
    positions = _array(model.positions(cfg.max_positions))  # (max_positions, D), as added by tmt
    _set_stack(spec.encoder, model.embed if model.src_embed is None else model.src_embed, positions, model.encoder_norm)
    _set_stack(spec.decoder, model.embed, positions, model.decoder_norm)
    spec.decoder.projection.weight = _array(model.embed.weight)  # tied: CTranslate2 aliases it to the embedding
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder, strict=True):
        _set_encoder_layer(layer_spec, layer)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder, strict=True):
        _set_decoder_layer(layer_spec, layer)
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    config = spec.config
    config.unk_token, config.bos_token, config.eos_token = pieces[UNK], pieces[BOS], pieces[EOS]
    config.decoder_start_token = pieces[BOS]
    config.add_source_eos = True
    config.layer_norm_epsilon = LAYER_NORM_EPSILON
    return spec


def _set_stack(spec: object, embed: nn.Embedding, positions: np.ndarray, final_norm: nn.LayerNorm | None) -> None:
    """Embedding (scaled by sqrt(d_model)), explicit position table and, with pre-norm, the final LayerNorm."""
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings  # type: ignore[attr-defined]
    embeddings.weight = _array(embed.weight)
    spec.scale_embeddings = True  # type: ignore[attr-defined]
    spec.position_encodings.encodings = positions  # type: ignore[attr-defined]
    if final_norm is not None:
        _set_norm(spec.layer_norm, final_norm)  # type: ignore[attr-defined]


def _set_encoder_layer(spec: object, layer: EncoderLayer) -> None:
    attention = spec.self_attention  # type: ignore[attr-defined]
    _set_linear(attention.linear[0], layer.self_attn.qkv)
    _set_linear(attention.linear[1], layer.self_attn.out)
    _set_norm(attention.layer_norm, layer.norm1)
    _set_ffn(spec.ffn, layer.ffn, layer.norm2)  # type: ignore[attr-defined]


def _set_decoder_layer(spec: object, layer: DecoderLayer) -> None:
    own = spec.self_attention  # type: ignore[attr-defined]
    _set_linear(own.linear[0], layer.self_attn.qkv)
    _set_linear(own.linear[1], layer.self_attn.out)
    _set_norm(own.layer_norm, layer.norm1)
    cross = spec.attention  # type: ignore[attr-defined]
    _set_linear(cross.linear[0], layer.cross_attn.q)
    _set_linear(cross.linear[1], layer.cross_attn.kv)
    _set_linear(cross.linear[2], layer.cross_attn.out)
    _set_norm(cross.layer_norm, layer.norm2)
    _set_ffn(spec.ffn, layer.ffn, layer.norm3)  # type: ignore[attr-defined]


def _set_ffn(spec: object, ffn: FeedForward, norm: nn.LayerNorm) -> None:
    _set_linear(spec.linear_0, ffn.fc1)  # type: ignore[attr-defined]
    _set_linear(spec.linear_1, ffn.fc2)  # type: ignore[attr-defined]
    _set_norm(spec.layer_norm, norm)  # type: ignore[attr-defined]


def _set_linear(spec: object, linear: nn.Linear) -> None:
    spec.weight = _array(linear.weight)  # type: ignore[attr-defined]
    spec.bias = _array(linear.bias)  # type: ignore[attr-defined]


def _set_norm(spec: object, norm: nn.LayerNorm) -> None:
    spec.gamma = _array(norm.weight)  # type: ignore[attr-defined]
    spec.beta = _array(norm.bias)  # type: ignore[attr-defined]


def _array(t: Tensor) -> np.ndarray:
    """A float32 numpy copy of a CPU tensor, detached from autograd."""
    return t.detach().float().cpu().numpy().copy()
