"""`tmt attention`: one sentence through a trained model, and one layer's attention weights per head.

The paper's Figures 3-5 draw encoder self-attention in layer 5 of 6; here any
layer of the encoder's self-attention, the decoder's masked self-attention or
the decoder's attention over the source can be drawn. The weights come from
`Transformer.forward_with_attention` (the explicit softmax path, the same
outputs as the fused kernel), on the source sentence and a target: the
model's own beam-search translation unless one is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from transformer_mt.data.bpe import BOS, EOS
from transformer_mt.data.clean import normalize
from transformer_mt.decode.load import load_model
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import UserError
from transformer_mt.model.transformer import Transformer
from transformer_mt.plots import AttentionPanel

Kind = Literal["encoder", "decoder", "cross"]
DESCRIBED = {
    "encoder": "encoder self-attention (rows: source tokens attending)",
    "decoder": "decoder masked self-attention (rows: target input tokens attending)",
    "cross": "decoder attention over the source (rows: the target token being predicted)",
}


class AttentionError(UserError):
    """A sentence, layer or checkpoint the figure cannot be drawn for; the message says what to pass."""


@dataclass
class SentenceAttention:
    """The panel to draw and the target it was computed with (the model's translation unless one was given)."""

    panel: AttentionPanel
    target: str


def default_layer(layers: int) -> int:
    """The layer the paper draws (5 of 6): the one below the top, or the only one."""
    return max(layers - 1, 1)


def sentence_attention(
    checkpoint: Path, text: str, kind: Kind = "encoder", layer: int | None = None, target: str | None = None,
    device: str = "cpu",
) -> SentenceAttention:  # fmt: skip
    """Run ``text`` (and ``target``, or the model's translation of ``text``) through the checkpoint's model and
    return layer ``layer`` (1-based; default `default_layer`) of the ``kind`` attention, every head."""
    loaded = load_model([checkpoint], device=device, overrides=["decode.quantize=none"])
    translator = Translator(loaded.model, loaded.bpe, loaded.config, loaded.device)
    return translator_attention(translator, text, kind, layer, target, name=str(checkpoint))


def translator_attention(
    translator: Translator, text: str, kind: Kind = "encoder", layer: int | None = None, target: str | None = None,
    name: str = "",
) -> SentenceAttention:  # fmt: skip
    """`sentence_attention` with the model of ``translator`` (tmt's own engine), already loaded: `tmt serve`'s
    heat map. ``name`` ends the panel's title (the checkpoint)."""
    model, bpe = translator.model, translator.bpe
    if not isinstance(model, Transformer):
        raise AttentionError("attention maps need one tmt model (--engine pytorch, no --ensemble)")
    translator.show_progress = False
    layers = model.cfg.encoder_layers if kind == "encoder" else model.cfg.decoder_layers
    layer = default_layer(layers) if layer is None else layer
    if not 1 <= layer <= layers:
        raise AttentionError(f"--layer {layer}: the {kind} of {name or 'the model'} has layers 1 to {layers}")
    src = translator.encode(0, text)
    if not src:
        raise AttentionError("--text is empty (after normalization); give the sentence to draw")
    if target is None:  # the encoder's attention needs no target: only BOS is fed then
        target = "" if kind == "encoder" else translator.translate_lines([text])[0]
    tgt = bpe.encode(normalize(target), out_type=int)[: model.cfg.max_positions - 1]
    with torch.no_grad():
        _, maps = model.forward_with_attention(
            torch.tensor([src], device=translator.device), torch.tensor([[BOS, *tgt]], device=translator.device)
        )
    weights = getattr(maps, kind)[layer - 1][0].float().cpu().numpy()  # (H, queries, keys)
    source, tgt_in, tgt_out = (
        [bpe.id_to_piece(i) for i in ids] for ids in (src, [BOS, *tgt], [*tgt, EOS])
    )  # fmt: skip
    queries, keys = {"encoder": (source, source), "decoder": (tgt_in, tgt_in), "cross": (tgt_out, source)}[kind]
    title = f"{DESCRIBED[kind]}, layer {layer} of {layers}, {weights.shape[0]} heads: {name}"
    return SentenceAttention(AttentionPanel(title, weights, queries, keys), target)
