"""Model FLOPs utilization: the model's training FLOP/s against the device's bf16 dense peak.

The FLOPs are the model's own (`transformer_mt.model.transformer.flops_per_token`,
forward and backward per target token), not what the kernels happen to
execute, so MFU compares runs, toolkits and devices on the same footing. The
peak is the vendor's dense (no sparsity) bf16 tensor-core figure; a device not
in the table (and every CPU) has no MFU, rather than a made-up one.
"""

from __future__ import annotations

import torch

# bf16 dense tensor-core peaks, TFLOP/s (vendor datasheets, without sparsity), matched by substring of the name.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,  # the SXM part, "NVIDIA H200"
    "H200 NVL": 835.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # "NVIDIA H100 80GB HBM3" is the SXM part
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,  # fp16 tensor cores (V100 has no bf16)
    "T4": 65.0,  # fp16
}


def peak_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of a GPU by name (longest matching key wins, so "H100 PCIe" beats "H100"), or None."""
    matches = [k for k in PEAK_BF16_TFLOPS if k.lower() in device_name.lower()]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None


def device_peak_flops(device: torch.device) -> float | None:
    """FLOP/s of ``device``'s bf16 dense peak; None on a CPU or an unknown GPU (then no MFU is reported)."""
    if device.type != "cuda":
        return None
    peak = peak_tflops(torch.cuda.get_device_name(device))
    return None if peak is None else peak * 1e12


def throughput_figures(flops_per_token: float, tgt_tokens_per_s: float, peak_flops: float | None) -> dict[str, float]:
    """``model_tflops`` (the model's TFLOP/s at this pace) and, with a known peak, ``mfu`` (0..1).

    ``peak_flops`` is the peak of all the devices that produced the tokens
    (one device's peak x world size), since the tokens are counted over all.
    """
    flops = flops_per_token * tgt_tokens_per_s
    figures = {"model_tflops": flops / 1e12}
    if peak_flops:
        figures["mfu"] = flops / peak_flops
    return figures
