"""Linear layers through oneDNN on the CPU: fp32 for decoding, bf16 for training.

PyTorch computes an fp32 `nn.Linear` on the CPU with MKL's sgemm. MKL picks
its code path by CPU vendor, and on AMD processors it runs AVX2 kernels even
where the core has AVX-512: about 100 GFLOP/s on the benchmark machine (an
AMD EPYC with AVX-512), where oneDNN, the library PyTorch already uses for
bf16 matmuls, reaches 230-257 GFLOP/s in fp32 on the same shapes. PyTorch
exposes oneDNN's linear as ``torch.ops.mkldnn._linear_pointwise`` (the op
its compiler's CPU inference path emits), without a backward; it adds the
bias and can apply the ReLU in the same call. Where MKL runs its best code
anyway (an Intel AVX-512 core, an AVX2-only core) the two libraries are within
about 6% of each other on these shapes (oneDNN the slower on an AVX-512
Xeon), so there the swap gains little or nothing (benchmarks/README.md).

So a model loaded for decoding on the CPU in fp32 has its Linear layers, and
the tied output projection, replaced by `OneDnnLinear`s over the same
weights. The formula is the same in fp32; only the order of the sums inside
a dot product differs, a rounding-level change.

Training on the CPU under bf16 autocast takes them too (the trainer swaps
them in, the tied projection left as it is): the forward is one oneDNN call
with the bias and, in the feed-forward layer's first projection, the ReLU
fused, where autocast's ``addmm`` copies the bias into the output first and
runs the ReLU as a pass of its own; the backward is autograd's for ``addmm``
(`_Bf16Linear`). The casts and dtypes are autocast's, so the numbers are the
same up to the order of sums: a base-shape update about 2% faster.

CUDA, int8 (`decode.quantize`), machines other than x86-64 and PyTorch builds
without oneDNN keep `nn.Linear`. oneDNN's bf16 kernels need AVX-512 (or AMX);
on a CPU without them (an AVX2-only core) bf16 training takes autocast's
`F.linear` inside the same layer (`onednn_bf16`).
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_mt.model.transformer import FeedForward, Transformer


def onednn_available() -> bool:
    """Whether this is an x86-64 machine and its PyTorch build has oneDNN's fp32 linear op.

    x86-64 only: MKL's vendor dispatch is an x86 matter, and elsewhere oneDNN runs on other backends.
    """
    x86 = platform.machine().lower() in {"x86_64", "amd64"}
    return x86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN can multiply bf16 matrices on this CPU (AVX-512 or AMX; not on AVX2-only cores, where it
    cannot even build the primitive). A fact of the machine, so asked once."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_available() and supported is not None and bool(supported())


class OneDnnLinear(nn.Module):
    """``x W^T + b`` (then a ReLU with ``relu``) by oneDNN on the CPU: fp32 without gradients, or under bf16
    autocast with them where oneDNN has bf16 kernels (`_Bf16Linear`); `F.linear` otherwise (same parameters).

    ``tied``: the weight belongs to another module (the embedding of the output projection); it is held as a
    buffer outside the state dict, so that the model's state dict keeps exactly its keys (for decoding only:
    no gradient reaches a buffer).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tied: bool = False, relu: bool = False) -> None:
        super().__init__()
        if tied:
            self.register_buffer("weight", weight.detach(), persistent=False)
        else:
            self.weight = weight
        self.bias = bias
        self.relu = relu

    def forward(self, x: Tensor) -> Tensor:
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if x.device.type == "cpu" and needs_grad and _bf16_autocast() and onednn_bf16():
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            return _Bf16Linear.apply(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), bias, self.relu)
        if needs_grad or x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            y = F.linear(x, self.weight, self.bias)
            return F.relu(y) if self.relu else y
        rows = x.numel() // x.shape[-1]
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self._post, [], "")
        flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))  # zero rows, cut off again below
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, self._post, [], "")
        return y[:rows].view(*x.shape[:-1], y.shape[-1])

    @property
    def _post(self) -> str:
        return "relu" if self.relu else "none"


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to one of few sizes: as it is up to 16, else to a multiple of a quarter of its power
    of two (17 -> 20, 100 -> 112, 1000 -> 1024; at most 25% more rows; 48 sizes from 1 to 4096).

    oneDNN builds (JIT-compiles) a kernel for each input shape it meets and
    keeps what it built. Decoding meets a new row count (a batch's sentences x
    its source length, live hypotheses x beam) at nearly every batch and step,
    so unrounded an fp32 run spends time building kernels and memory holding
    them: 2.2 GB after 1200 random row counts through a d_model-256 model's
    four Linear shapes, 0.36 GB rounded (benchmarks/onednn_shapes.py), and as
    fast on real text (benchmarks/README.md, "Memory bounded by the window").
    A row's result does not depend on how many rows are multiplied with it
    (from 2 rows up: one row takes another kernel, hence exact up to 16;
    tests/test_model_onednn.py checks it), so the zero rows change no output.
    """
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def _bf16_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


class _Bf16Linear(torch.autograd.Function):
    """y = x W^T + b (ReLU'd with ``relu``) in one oneDNN call on bf16 tensors; the backward of ``addmm``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")
        ctx.save_for_backward(x, weight, y if relu else None)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight, y = ctx.saved_tensors
        if y is not None:
            grad = torch.ops.aten.threshold_backward(grad, y, 0)  # the ReLU's: 0 where it output 0
        g = grad.reshape(-1, grad.shape[-1])  # (rows, out)
        grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def use_onednn_linears(model: Transformer, output_projection: bool = True) -> Transformer:
    """``model``, in place, with every nn.Linear (and, with ``output_projection``, the tied output projection)
    computed by `OneDnnLinear`; each feed-forward layer's ReLU moves into its first projection.

    The layers share the original parameters, so nothing is copied and the
    state dict keeps its keys. The trainer passes ``output_projection=False``:
    that projection's weight is the embedding, which a buffer would cut from
    its gradient. A model off the CPU, or where `onednn_available` is False,
    is returned as it is.
    """
    if model.embed.weight.device.type != "cpu" or not onednn_available():
        return model
    for module in list(model.modules()):
        if isinstance(module, FeedForward) and type(module.fc1) is nn.Linear:
            module.fc1 = OneDnnLinear(module.fc1.weight, module.fc1.bias, relu=True)
            module.relu = nn.Identity()
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, OneDnnLinear(child.weight, child.bias))
    if output_projection and model.output_projection is None:
        model.output_projection = OneDnnLinear(model.embed.weight, None, tied=True)
    return model
