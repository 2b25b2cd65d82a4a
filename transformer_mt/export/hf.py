"""`tmt export hf`: a directory that Hugging Face transformers loads as `MarianMTModel` and `MarianTokenizer`.

Written whole or not at all (`export.atomic_directory`):

    config.json             MarianConfig: the model's shape, special tokens, decoding from BOS
    generation_config.json  the checkpoint's decoding settings, as far as `generate` can express them
    model.safetensors       the weights, mapped by `marian_state_dict`
    source.spm, target.spm  the checkpoint's sentencepiece model, with tmt's text normalization built in
    vocab.json              piece -> id, the sentencepiece ids unchanged
    tokenizer_config.json   MarianTokenizer's settings (special tokens, languages, longest input)
    README.md               a model card: data, model, decoding, the scores found beside the checkpoint

The mapping is exact, not an approximation:

- Marian is the paper's post-norm Transformer with ReLU, embeddings scaled
  by sqrt(d_model), sinusoidal positions and one tied embedding matrix, so a
  tmt model maps onto it layer by layer. What Marian cannot hold is refused
  (`check_marian`): pre-norm, learned positions, d_k != d_model/heads,
  separate source and target embeddings, an encoder layer without its
  residual connection.
- Positions: transformers rebuilds Marian's sinusoids when it loads, with the
  sines of all frequencies in the first half of the model dimension and the
  cosines in the second; tmt (and the paper) interleave them. Permuting the
  model dimension, the same way in every tensor that reads or writes the
  residual stream (embeddings, the inputs of Q/K/V and FFN's first layer,
  the outputs of attention and FFN, every LayerNorm), turns tmt's table into
  Marian's while every logit stays the same: attention heads and FFN units
  are not in that dimension, and LayerNorm does not mind the order.
- Text: tmt normalizes every line before sentencepiece (`data.clean.normalize`:
  NFC, control and invisible characters removed, whitespace collapsed), and
  its sentencepiece model itself normalizes nothing. The exported model
  carries that normalization as a sentencepiece character map
  (`export.normalizer.normalizing_spm`), so raw text through MarianTokenizer alone gives the
  ids tmt feeds its model; `check_normalization` verifies it on awkward
  text and refuses the export where it would not hold.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from torch import Tensor

from transformer_mt.checkpoint import decoded_file
from transformer_mt.config import Config, DataConfig, ModelConfig
from transformer_mt.data.bpe import BOS, EOS, PAD, UNK
from transformer_mt.data.directions import directions, languages, multilingual, tag
from transformer_mt.decode.load import load_model
from transformer_mt.errors import UserError
from transformer_mt.export.normalizer import check_normalization, normalizing_spm
from transformer_mt.files import check_output_parent
from transformer_mt.model.transformer import Transformer
from transformer_mt.run_names import EVAL_PREFIX, SCORES_NAME


class HfExportError(UserError):
    """A model transformers' Marian cannot hold exactly, or a missing package; the message says which and why."""


def check_marian(model: ModelConfig) -> None:
    """Refuse what MarianMTModel cannot represent exactly, naming the key."""
    problems = {
        "model.norm: pre (Marian is post-norm: LayerNorm after each residual sum)": model.norm != "post",
        "model.positions: learned (Marian rebuilds sinusoids when it loads)": model.positions != "sinusoidal",
        f"model.d_k: {model.d_k} (Marian's queries and keys are d_model/heads wide)": model.d_k
        not in (0, model.d_model // model.heads),
        "model.share_embeddings: false (Marian ties one matrix for both sides here)": not model.share_embeddings,
        f"model.d_model: {model.d_model} is odd (Marian's sines and cosines need an even width)": model.d_model % 2,
        f"model.encoder_no_residual_layer: {model.encoder_no_residual_layer} (Marian has every residual)": bool(
            model.encoder_no_residual_layer
        ),
    }
    found = [name for name, bad in problems.items() if bad]
    if found:
        raise HfExportError(
            f"this model cannot be exported to Hugging Face's Marian exactly: {'; '.join(found)}; translate it with "
            "tmt, or export it to CTranslate2 (tmt export ctranslate2)"
        )


def interleave_to_halves(d_model: int) -> Tensor:
    """The permutation of the model dimension from tmt's interleaved [sin, cos, sin, cos, ...] to Marian's
    [sin ... | cos ...]: Marian's dimension k is tmt's dimension ``perm[k]``."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """MarianMTModel's weights for ``model`` (the model dimension permuted by `interleave_to_halves`).

    Only ``model.shared.weight`` holds the embedding: transformers ties the
    encoder's and decoder's embeddings and the output projection to it.
    """
    d = model.cfg.d_model
    p = interleave_to_halves(d)
    state = {"model.shared.weight": model.embed.weight[:, p], "final_logits_bias": torch.zeros(1, model.vocab_size)}
    for i, layer in enumerate(model.encoder):
        prefix = f"model.encoder.layers.{i}."
        qkv = layer.self_attn.qkv
        state |= _attention(prefix + "self_attn.", qkv.weight.split(d), qkv.bias.split(d), layer.self_attn.out, p)
        state |= _norm(prefix + "self_attn_layer_norm.", layer.norm1, p)
        state |= _ffn(prefix, layer.ffn, p) | _norm(prefix + "final_layer_norm.", layer.norm2, p)
    for i, layer in enumerate(model.decoder):
        prefix = f"model.decoder.layers.{i}."
        qkv = layer.self_attn.qkv
        state |= _attention(prefix + "self_attn.", qkv.weight.split(d), qkv.bias.split(d), layer.self_attn.out, p)
        state |= _norm(prefix + "self_attn_layer_norm.", layer.norm1, p)
        cross = layer.cross_attn
        kv_weight, kv_bias = cross.kv.weight.split(d), cross.kv.bias.split(d)
        weights, biases = (cross.q.weight, *kv_weight), (cross.q.bias, *kv_bias)
        state |= _attention(prefix + "encoder_attn.", weights, biases, cross.out, p)
        state |= _norm(prefix + "encoder_attn_layer_norm.", layer.norm2, p)
        state |= _ffn(prefix, layer.ffn, p) | _norm(prefix + "final_layer_norm.", layer.norm3, p)
    return {name: t.detach().float().contiguous().clone() for name, t in state.items()}


def _attention(prefix: str, weights: Sequence[Tensor], biases: Sequence[Tensor], out: Any, p: Tensor) -> dict:
    """Q, K, V read the stream (their inputs permuted); the output projection writes it (rows permuted)."""
    state = {}
    for name, w, b in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
        state[f"{prefix}{name}.weight"], state[f"{prefix}{name}.bias"] = w[:, p], b
    state[f"{prefix}out_proj.weight"], state[f"{prefix}out_proj.bias"] = out.weight[p, :], out.bias[p]
    return state


def _ffn(prefix: str, ffn: Any, p: Tensor) -> dict[str, Tensor]:
    return {
        f"{prefix}fc1.weight": ffn.fc1.weight[:, p], f"{prefix}fc1.bias": ffn.fc1.bias,
        f"{prefix}fc2.weight": ffn.fc2.weight[p, :], f"{prefix}fc2.bias": ffn.fc2.bias[p],
    }  # fmt: skip


def _norm(prefix: str, norm: Any, p: Tensor) -> dict[str, Tensor]:
    return {f"{prefix}weight": norm.weight[p], f"{prefix}bias": norm.bias[p]}


def marian_config(cfg: Config, vocab_size: int) -> dict[str, Any]:
    """config.json: MarianConfig for the model of ``cfg``; the decoder starts from BOS, as tmt's does."""
    m = cfg.model
    return {
        "model_type": "marian", "architectures": ["MarianMTModel"], "vocab_size": vocab_size,
        "decoder_vocab_size": vocab_size, "d_model": m.d_model, "encoder_layers": m.encoder_layers,
        "decoder_layers": m.decoder_layers, "encoder_attention_heads": m.heads, "decoder_attention_heads": m.heads,
        "encoder_ffn_dim": m.d_ff, "decoder_ffn_dim": m.d_ff, "activation_function": "relu",
        "max_position_embeddings": m.max_positions, "scale_embedding": True, "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True, "dropout": m.dropout, "attention_dropout": m.attention_dropout,
        "activation_dropout": m.activation_dropout, "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": BOS,
        "decoder_start_token_id": BOS, "forced_eos_token_id": EOS, "is_encoder_decoder": True,
        "torch_dtype": "float32", "dtype": "float32",
    }  # fmt: skip


def generation_config(cfg: Config) -> tuple[dict[str, Any], list[str]]:
    """generation_config.json from ``cfg.decode``, and what `generate` cannot express (for the docs and card).

    Carried: the beam, the n-gram block, PAD and BOS never generated (as tmt's
    search), and EOS forced at the length limit. HF's length penalty divides
    by length ** alpha, tmt's ``len_penalty_form: fairseq``; its stopping rule
    ``early_stopping: true`` ends a sentence at k finished hypotheses, tmt's
    ``stopping: k_finished``. HF's limit is one number per call, not one per
    source sentence: ``max_length`` is the model's positions.
    """
    d = cfg.decode
    config = {
        "decoder_start_token_id": BOS, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
        "forced_eos_token_id": EOS, "num_beams": d.beam_size, "length_penalty": d.len_penalty,
        "early_stopping": True if d.stopping == "k_finished" else "never", "max_length": cfg.model.max_positions,
        "suppress_tokens": [PAD, BOS], "no_repeat_ngram_size": d.no_repeat_ngram,
    }  # fmt: skip
    gaps = []
    if d.len_penalty_form == "gnmt" and d.len_penalty != 0:
        gaps.append(
            f"length penalty: tmt divides scores by the paper's ((5 + length) / 6) ** {d.len_penalty} (GNMT's form); "
            f"generate divides by length ** {d.len_penalty} (decode.len_penalty_form: fairseq)"
        )
    if d.stopping == "exact":
        gaps.append(
            "stopping: tmt ends a sentence when no live hypothesis can still win (exact); generate's "
            "early_stopping='never' is a heuristic of the same aim, early_stopping=True is tmt's k_finished"
        )
    gaps.append(
        f"maximum length: tmt allows {d.max_len_a} x source length + {d.max_len_b} tokens per sentence; generate "
        f"takes one limit per call (max_length {cfg.model.max_positions} here; pass max_new_tokens)"
    )
    return config, gaps


def tokenizer_files(spm_model: bytes, cfg: Config) -> dict[str, bytes]:
    """The tokenizer files: the normalizing sentencepiece model (both sides), vocab.json, tokenizer_config.json."""
    normalizing = normalizing_spm(spm_model)
    bpe = spm.SentencePieceProcessor(model_proto=spm_model)
    tags = {tag(lang): marian_tag(lang) for lang in languages(cfg.data)}  # <2de> -> >>de<<, as OPUS-MT's
    pieces = [tags.get(piece, piece) for piece in (bpe.id_to_piece(i) for i in range(bpe.get_piece_size()))]
    src, tgt = _language_pair(cfg.data)
    settings = {
        "tokenizer_class": "MarianTokenizer", "source_lang": src, "target_lang": tgt,
        "unk_token": pieces[UNK], "eos_token": pieces[EOS], "pad_token": pieces[PAD], "bos_token": pieces[BOS],
        "model_max_length": cfg.model.max_positions, "separate_vocabs": False, "sp_model_kwargs": {},
    }  # fmt: skip
    return {
        "source.spm": normalizing, "target.spm": normalizing,
        "vocab.json": _json({piece: i for i, piece in enumerate(pieces)}),
        "tokenizer_config.json": _json(settings),
        "special_tokens_map.json": _json({k: settings[k] for k in ("unk_token", "eos_token", "pad_token", "bos_token")}),
    }  # fmt: skip


def marian_tag(lang: str) -> str:
    """The target token of a model of several directions as Marian's tokenizer reads it at the start of a text,
    OPUS-MT's convention: ``>>de<< The text.``"""
    return f">>{lang}<<"


def _language_pair(data: DataConfig) -> tuple[str, str]:
    """tokenizer_config.json's languages: the pair, or "mul" for each side with several languages."""
    ways = directions(data)
    sources, targets = {w.src for w in ways}, {w.tgt for w in ways}
    return (ways[0].src if len(sources) == 1 else "mul"), (ways[0].tgt if len(targets) == 1 else "mul")


def model_card(cfg: Config, checkpoints: Sequence[Path], parameters: int, gaps: list[str]) -> str:
    """README.md: what the model is, how to use it, and the scores recorded beside the checkpoint."""
    m, d, data = cfg.model, cfg.decode, cfg.data
    scores = _scores(checkpoints)
    rows = [
        f"| {s['testset']} | {s['sacrebleu']['score']:.2f} | {s.get('chrf', {}).get('score', float('nan')):.2f} | "
        f"{s['sentences']} | `{s['sacrebleu']['signature'].replace('|', chr(92) + '|')}` |"
        for s in scores
    ]
    table = (
        "| test set | sacreBLEU | chrF | sentences | sacreBLEU signature |\n| --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        if rows
        else "No `tmt evaluate` scores were found beside the checkpoint (`eval_*/scores.json`)."
    )
    gap_lines = "\n".join(f"- {g}" for g in gaps)
    return f"""---
language: [{", ".join(languages(data))}]
tags: [translation, marian, transformer_mt]
pipeline_tag: translation
---

# {_title(data)} Transformer, trained with transformer_mt

A Transformer ("Attention Is All You Need") trained with `tmt` (transformer_mt)
and exported with `tmt export hf` from {", ".join(f"`{p.name}`" for p in checkpoints)}.

| | |
| --- | --- |
| data | train `{data.train}`, valid `{data.valid}`, test `{data.test}` |
| vocabulary | joint sentencepiece BPE, {cfg.bpe.vocab_size} pieces |
| model | post-norm, d_model {m.d_model}, FFN {m.d_ff}, {m.heads} heads, {m.encoder_layers}+{m.decoder_layers} layers, {parameters:,} parameters |
| decoding in tmt | beam {d.beam_size}, length penalty {d.len_penalty} ({d.len_penalty_form}), max length {d.max_len_a} × source + {d.max_len_b} |

## Scores (tmt's own decoding)

{table}

## Use

```python
from transformers import MarianMTModel, MarianTokenizer

tokenizer = MarianTokenizer.from_pretrained("PATH_OR_HUB_ID")
model = MarianMTModel.from_pretrained("PATH_OR_HUB_ID")
batch = tokenizer(["{_example(data)}Your text here."], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

The tokenizer normalizes raw text as tmt does (NFC, control and invisible
characters removed, whitespace collapsed) inside its sentencepiece model: no
other preprocessing is needed.{_several(data)}

What `generate` cannot express of tmt's decoding:

{gap_lines}
"""


def _title(data: DataConfig) -> str:
    """``en → de``, or the directions of a model of several."""
    if not multilingual(data):
        return f"{data.src_lang} → {data.tgt_lang}"
    return ", ".join(w.name for w in directions(data))


def _example(data: DataConfig) -> str:
    """The target token the usage example starts with: a model of several directions reads one."""
    return f"{marian_tag(directions(data)[0].tgt)} " if multilingual(data) else ""


def _several(data: DataConfig) -> str:
    """The model card's note on choosing the target language, for a model of several directions."""
    if not multilingual(data):
        return ""
    targets = ", ".join(dict.fromkeys(marian_tag(w.tgt) for w in directions(data)))
    return (
        f"\n\nThis model translates {', '.join(w.name for w in directions(data))}: start each text with the token "
        f"of the language to translate into ({targets}), as OPUS-MT's models read it."
    )


def _scores(checkpoints: Sequence[Path]) -> list[dict[str, Any]]:
    """The `tmt evaluate` results beside the first checkpoint that were decoded from these checkpoints (a record of
    ``-c RUN_DIR`` by an older tmt counts for the file that directory stands for: `decoded_file`)."""
    wanted = {p.resolve() for p in checkpoints}
    found = []
    for path in sorted(checkpoints[0].parent.glob(f"{EVAL_PREFIX}*/{SCORES_NAME}")):
        try:
            scores = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if {decoded_file(Path(c)) for c in scores.get("checkpoints", [])} == wanted and "sacrebleu" in scores:
            found.append(scores)
    return found


@contextmanager
def safetensors_os_errors(path: Path) -> Iterator[None]:
    """safetensors reports a write the OS refused as its own error ("... (os error 28)"): it is raised as the
    OSError it was, naming ``path``, so that a full disk ends in one line as for every other writer."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from None


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def export_hf(checkpoints: Sequence[str | Path], out: str | Path, force: bool = False) -> tuple[Path, list[str]]:
    """Write the transformers directory of ``checkpoints`` (several are averaged) to ``out``; returns it and what
    `generate` cannot express of the checkpoint's decoding settings."""
    from transformer_mt.export import ExportError, atomic_directory

    try:
        from safetensors.torch import save_file
    except ImportError:
        raise HfExportError("tmt export hf needs safetensors: pip install safetensors (or the hf extra)") from None
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; choose another -o or pass --force to replace it")
    check_output_parent(out)
    paths = [Path(p) for p in checkpoints]
    loaded = load_model(paths, device="cpu", overrides=["decode.quantize=none"])
    check_marian(loaded.config.model)
    tokenizer = tokenizer_files(loaded.spm_model, loaded.config)
    check_normalization(tokenizer["source.spm"], loaded.spm_model)
    generation, gaps = generation_config(loaded.config)
    parameters = sum(p.numel() for p in loaded.model.parameters())
    with atomic_directory(out) as tmp:
        with safetensors_os_errors(out / "model.safetensors"):
            save_file(marian_state_dict(loaded.model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_bytes(_json(marian_config(loaded.config, loaded.model.vocab_size)))
        (tmp / "generation_config.json").write_bytes(_json(generation))
        for name, blob in tokenizer.items():
            (tmp / name).write_bytes(blob)
        (tmp / "README.md").write_text(model_card(loaded.config, paths, parameters, gaps), encoding="utf-8")
    return out, gaps
