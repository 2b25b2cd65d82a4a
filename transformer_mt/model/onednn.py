"""fp32 Linear layers through oneDNN, for decoding on the CPU.

PyTorch computes an fp32 `nn.Linear` on the CPU with MKL's sgemm. MKL picks
its code path by CPU vendor, and on AMD processors it runs AVX2 kernels even
where the core has AVX-512: about 100 GFLOP/s on the benchmark machine (an
AMD EPYC with AVX-512), where oneDNN, the library PyTorch already uses for
bf16 matmuls, reaches 230-257 GFLOP/s in fp32 on the same shapes. PyTorch
exposes oneDNN's fp32 matmul as ``torch.ops.mkldnn._linear_pointwise`` (the
op its compiler's CPU inference path emits), without a backward.

So a model loaded for decoding on the CPU in fp32 has its Linear layers, and
the tied output projection, replaced by `OneDnnLinear`s over the same
weights. The formula is the same in fp32; only the order of the sums inside
a dot product differs, a rounding-level change. Training, CUDA, int8
(`decode.quantize`), machines other than x86-64 and PyTorch builds without
oneDNN keep `nn.Linear`.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_mt.model.transformer import Transformer


def onednn_available() -> bool:
    """Whether this is an x86-64 machine and its PyTorch build has oneDNN's fp32 linear op.

    x86-64 only: MKL's vendor dispatch is an x86 matter, and elsewhere oneDNN runs on other backends.
    """
    x86 = platform.machine().lower() in {"x86_64", "amd64"}
    return x86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(nn.Module):
    """``x W^T + b`` by oneDNN for fp32 CPU inputs without gradients; `F.linear` otherwise (same parameters).

    ``tied``: the weight belongs to another module (the embedding of the output projection); it is held as a
    buffer outside the state dict, so that the model's state dict keeps exactly its keys.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tied: bool = False) -> None:
        super().__init__()
        if tied:
            self.register_buffer("weight", weight.detach(), persistent=False)
        else:
            self.weight = weight
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if needs_grad or x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: Transformer) -> Transformer:
    """``model``, in place, with every nn.Linear and the tied output projection computed by `OneDnnLinear`.

    For a model loaded to decode (eval mode, no gradients): the layers share
    the original parameters, so nothing is copied and the state dict keeps its
    keys. A model off the CPU, or where `onednn_available` is False, is
    returned as it is.
    """
    if model.embed.weight.device.type != "cpu" or not onednn_available():
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, OneDnnLinear(child.weight, child.bias))
    if model.output_projection is None:
        model.output_projection = OneDnnLinear(model.embed.weight, None, tied=True)
    return model
