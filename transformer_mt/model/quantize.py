"""int8 decoding on the CPU (`decode.quantize: int8`): a named deviation from the paper's fp32 model, off by default.

Dynamic quantization (``torch.ao.quantization.quantize_dynamic``): each
Linear layer's weights are stored as int8 with one scale per output row, its
input is quantized per call from its observed range, and the product is
accumulated in int32 (the fbgemm/x86 kernels, 3-6x faster than MKL's fp32
matmuls at decoding's batch sizes, and a whole decode 1.3-1.6x faster than
fp32 through oneDNN, `transformer_mt.model.onednn`). The tied output projection, a plain matmul with
the embedding matrix in the fp32 model and about 40% of a decoder step's
FLOPs with an 8000-word vocabulary, first becomes a Linear of its own so that
it is quantized too. Embeddings, LayerNorm, softmax, attention and the cached
keys/values stay fp32. The BLEU change is measured in benchmarks/README.md.

PyTorch has no CUDA kernels for these layers, so int8 decoding is CPU-only.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from transformer_mt.errors import UserError
from transformer_mt.model.transformer import Transformer


class QuantizeError(UserError):
    """int8 decoding was asked for where it cannot run; the message says what to pass instead."""


def quantize_int8(model: Transformer) -> Transformer:
    """An int8 copy of ``model`` for decoding on the CPU; ``model`` itself is left as it is.

    Every nn.Linear, and the tied pre-softmax projection, is replaced by a
    dynamically quantized layer with per-output-row weight scales. The copy
    is for inference only (eval mode, no gradients).
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise QuantizeError(
            f"decode.quantize=int8 runs on the CPU only (PyTorch's dynamic int8 layers have no {device.type} "
            "kernels), but the model is on "
            f"{device}; pass --device cpu, or --set decode.quantize=none to decode in fp32 on {device}"
        )
    quantized = copy.deepcopy(model).eval()
    projection = nn.Linear(model.cfg.d_model, model.vocab_size, bias=False)
    projection.weight = quantized.embed.weight  # the same tensor: quantized below as its own layer
    quantized.output_projection = projection
    with warnings.catch_warnings():
        # torch.ao.quantization is marked deprecated in favour of torchao, but still ships (and is tested) in torch.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*", category=UserWarning)
        torch.ao.quantization.quantize_dynamic(
            quantized, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )
    return quantized
