"""int8 decoding on the CPU (`decode.quantize: int8`): a named deviation from the paper's fp32 model, off by default.

Every Linear layer becomes an `Int8Linear`: int8 weights with one scale per
output row, each input row quantized on the fly with a scale of its own, the
product accumulated in int32 by PyTorch's fbgemm kernels (3-6x faster than
MKL's fp32 matmuls at decoding's batch sizes; a whole decode 1.3-1.6x faster
than fp32 through oneDNN, `transformer_mt.model.onednn`). The tied output
projection, a plain matmul with the embedding matrix in the fp32 model and
about 40% of a decoder step's FLOPs with an 8000-word vocabulary, becomes an
int8 layer of its own too. Embeddings, LayerNorm, softmax, attention and the
cached keys/values stay fp32. The BLEU change is measured in
benchmarks/README.md.

One scale per input row, not one per input tensor as PyTorch's dynamic
quantization (``quantize_dynamic``) takes: with a tensor-wide scale, the
rounding of a sentence's activations depends on the largest value among all
the sentences decoded with it, and on the quickstart's toy model 32 of 300
test lines came out differently with another ``--batch-tokens``. With a scale
per row, these layers compute a sentence's rows exactly as they would alone
(as CTranslate2's int8 does); what is left is the last-bit rounding of fp32
attention over a padded batch, which in int8 rarely crosses a rounding step
(2 of 1000 Multi30k test lines changed between two batch sizes, against 167
with a scale per tensor). The rounding is also finer: 932 of the toy model's
1000 test lines equal the fp32 translation, against 893.

PyTorch has no CUDA kernels for these layers, so int8 decoding is CPU-only.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn

from transformer_mt.errors import UserError
from transformer_mt.model.transformer import Transformer

WEIGHT_LEVELS = 127  # a weight row w is stored as round(127 * w / max|w|), in [-127, 127]
INPUT_LEVELS = 64  # an input row x is multiplied as round(64 * x / max|x|), in [-64, 64]
TINY = 1e-30  # the scale of an all-zero row (any positive number: its quantized values are all 0)


class QuantizeError(UserError):
    """int8 decoding was asked for where it cannot run; the message says what to pass instead."""


class Int8Linear(nn.Module):
    """``x W^T + b`` with W in int8, one scale per output row, and each input row quantized with its own scale.

    An input row x (the last dimension) is divided by its largest magnitude
    a, rounded to the 129 levels k / 64 for k in [-64, 64], multiplied by the
    int8 weights with int32 accumulation, scaled back by a and the weight
    row's scale, and the fp32 bias is added. 64 levels a side, not 127:
    fbgemm's AVX2 kernels add products of unsigned 8-bit inputs in pairs
    into 16-bit sums, which would saturate for inputs above 128 (PyTorch's
    ``reduce_range`` keeps the same 7 bits for the same reason).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(TINY) / WEIGHT_LEVELS  # (out,)
        with warnings.catch_warnings():
            # quantized tensors are marked deprecated in favour of torchao, but still ship (and are tested) in torch
            warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*", category=UserWarning)
            zeros = torch.zeros_like(scales, dtype=torch.long)
            qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's layout; the bias comes after scaling
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def of(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def int8_weight(self) -> Tensor:
        """The stored weights (out, in) as a quantized tensor: int8 values with one scale per row."""
        return torch.ops.quantized.linear_unpack(self.packed)[0]

    def forward(self, x: Tensor) -> Tensor:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(TINY)  # (..., 1): a per row
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x / scale, 1.0 / INPUT_LEVELS, INPUT_LEVELS, self.packed
        )  # each row of x / scale in [-1, 1] as uint8 k + 64: the levels above, exactly (the scale is a power of 2)
        if self.bias is None:
            return y.mul_(scale)
        return torch.addcmul(self.bias, y, scale, out=y)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: Transformer) -> Transformer:
    """An int8 copy of ``model`` for decoding on the CPU; ``model`` itself is left as it is.

    Every nn.Linear, and the tied pre-softmax projection, is replaced by an
    `Int8Linear`. The copy is for inference only (eval mode, no gradients).
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise QuantizeError(
            f"decode.quantize=int8 runs on the CPU only (PyTorch's int8 layers have no {device.type} "
            "kernels), but the model is on "
            f"{device}; pass --device cpu, or --set decode.quantize=none to decode in fp32 on {device}"
        )
    quantized = copy.deepcopy(model).eval()
    for module in list(quantized.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.of(child))
    quantized.output_projection = Int8Linear(quantized.embed.weight, None)  # the tied projection, as its own layer
    return quantized
