"""One optimizer update: precision, token-normalized gradient accumulation, the step itself.

The summed label-smoothed loss of every batch is divided by the number of
target tokens in the whole update (all batches, all ranks) before backward, so
the gradient is the per-token mean whatever the batch sizes, accumulation or
number of GPUs (DDP then averages over ranks, hence the extra factor
``world_size``). The training loop around it lives in ``trainer.py``.

With a fused optimizer (on CUDA) an update never waits for the device: the
token counts of DDP are summed on the device, the finiteness check and the
skip of a non-finite update happen there too (the fused kernel's
``found_inf``), and the update's figures stay on the device until the
trainer logs them (``Stepper.defer_sync``). On CPU every figure is read at
once, as the host has nothing to overlap.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.data.dataset import Batch
from transformer_mt.errors import UserError, out_of_memory
from transformer_mt.train.distributed import DistEnv, all_reduce_, all_reduce_sum
from transformer_mt.train.loss import label_smoothed_cross_entropy
from transformer_mt.train.schedule import set_lr


class TrainError(UserError):
    """A training problem the user can fix; the message says what to change."""


@dataclass
class UpdateStats:
    """Sums over one update, all ranks: label-smoothed loss and NLL (nats), target tokens, sentences.

    Floats, or with ``Stepper.defer_sync`` 0-dim tensors on the device that the
    trainer reads only when it logs; ``stepped`` is then provisional, and
    ``skipped`` (1.0 or 0.0, on the device) says whether the device skipped the
    update after all, its figures zeroed.
    """

    loss_sum: float | Tensor = 0.0
    nll_sum: float | Tensor = 0.0
    tokens: float | Tensor = 0.0
    sentences: float | Tensor = 0.0
    gnorm: float | Tensor = 0.0
    stepped: bool = False
    skipped: float | Tensor = 0.0  # deferred only: the device skipped this update (non-finite)
    nonfinite: float | Tensor = 0.0  # deferred only: ... and it counts towards train.max_nonfinite (no fp16 overflow)


@dataclass
class Stepper:
    """What one update needs; ``model`` is what runs forward (DDP and/or compiled), ``module`` the plain model."""

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    env: DistEnv
    precision: str
    label_smoothing: float
    clip_norm: float
    max_tokens: int = 0
    update_freq: int = 1
    defer_sync: bool = False  # no host synchronization per update (a fused optimizer, which skips on the device)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: bf16 on CUDA devices that support it, fp16 (with loss scaling) on older GPUs; on a CPU bf16
    where it has bf16 instructions (`cpu_has_bf16`), fp32 elsewhere."""
    if precision == "auto":
        if device.type != "cuda":
            return "bf16" if cpu_has_bf16() else "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and device.type != "cuda":
        raise TrainError("train.precision=fp16 needs a CUDA device; on CPU use fp32 (or bf16)")
    return precision


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX).

    There bf16 autocast trains 2-3x faster than fp32 at the same validation
    perplexity (benchmarks/README.md); without those instructions bf16 is
    emulated and slower than fp32.
    """
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own CPU feature probes
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def forward_loss(
    model: nn.Module, batch: Batch, precision: str, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (label-smoothed loss, NLL) in nats over the batch's target tokens; the loss sums in fp32.

    On the CPU the model runs on the real tokens alone (``pack``, `Packing`): the 2-9% of padding positions
    in a length-bucketed batch cost no matrix multiplies (a base-shape update 4% faster). On a GPU finding
    them would make the host wait for the device at every batch, and under torch.compile their varying
    number would break the graph, so there the padded batch runs whole and the loss skips the padding.
    """
    pack = batch.src.device.type == "cpu" and not _compiled(model)
    with autocast(batch.src.device, precision):
        logits = model(batch.src, batch.tgt_in, pack=pack)  # (N, V) packed, else (B, T, V)
    if pack:
        target = batch.tgt_out[batch.tgt_in.ne(PAD)]  # the targets at the packed logits' positions
    else:
        logits, target = logits.flatten(0, 1), batch.tgt_out.reshape(-1)
    return label_smoothed_cross_entropy(logits, target, label_smoothing, PAD)


def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` (DDP-wrapped or not) is a torch.compile module."""
    inner = model.module if isinstance(model, DDP) else model
    return isinstance(inner, torch._dynamo.eval_frame.OptimizedModule)


def filler_batch(device: torch.device) -> Batch:
    """A one-token batch run with weight 0 by a rank whose shard is empty, so every rank joins the same collectives."""
    one = torch.tensor([[EOS]], device=device)
    return Batch(one, torch.tensor([[BOS]], device=device), one.clone())


def oom_message(batch: Batch, max_tokens: int, update_freq: int, doing: str = "") -> str:
    """Training's advice when a batch does not fit: half the tokens per batch, twice the batches per update."""
    smaller = max(max_tokens // 2, 1)
    return (
        f"out of memory{doing} on a batch of src {tuple(batch.src.shape)}, tgt {tuple(batch.tgt_out.shape)} "
        f"(train.max_tokens={max_tokens}); try --set train.max_tokens={smaller} "
        f"--set train.update_freq={update_freq * 2} (same tokens per update, half the memory per batch)"
    )


def accumulate_gradients(step: Stepper, batches: list[Batch | None]) -> UpdateStats:
    """Forward and backward over this rank's batches of one update, gradients normalized by the global token count.

    ``None`` (or an empty batch) is this rank's filler: a zero-weight step.
    DDP synchronizes gradients on the last batch only (``no_sync`` on the others).
    """
    env = step.env
    local_tokens = sum(b.num_tgt_tokens for b in batches if b is not None and len(b) > 0)
    local_sents = sum(len(b) for b in batches if b is not None)
    if step.defer_sync and env.distributed:
        stats, norm = _device_counts(float(local_tokens), float(local_sents), env)
    else:
        total_tokens, total_sents = all_reduce_sum([float(local_tokens), float(local_sents)], env)
        stats = UpdateStats(tokens=total_tokens, sentences=total_sents)
        if total_tokens == 0:
            return stats
        norm = env.world_size / total_tokens if isinstance(step.model, DDP) else 1.0 / total_tokens
    sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # (loss, nll), on the device: one sync per update
    for i, batch in enumerate(batches):
        empty = batch is None or len(batch) == 0
        batch = filler_batch(env.device) if empty else batch.to(env.device, non_blocking=True)
        sync = i == len(batches) - 1 or not isinstance(step.model, DDP)
        oom = partial(oom_message, batch, step.max_tokens, step.update_freq)
        with contextlib.nullcontext() if sync else step.model.no_sync(), out_of_memory(oom, TrainError):
            loss, nll = forward_loss(step.model, batch, step.precision, step.label_smoothing)
            weight = 0.0 if empty else norm
            step.scaler.scale(loss * weight).backward()
        if not empty:
            sums += torch.stack([loss.detach(), nll.detach()]).double()
    if step.defer_sync:
        stats.loss_sum, stats.nll_sum = all_reduce_(sums, env).unbind()
    else:
        stats.loss_sum, stats.nll_sum = all_reduce_sum(sums.tolist(), env)
    return stats


def _device_counts(tokens: float, sentences: float, env: DistEnv) -> tuple[UpdateStats, Tensor]:
    """The update's target tokens and sentences summed over ranks on the device, and the loss weight of DDP.

    When no rank has a token every batch is a filler of weight 0, so the
    clamp only keeps the weight finite; the update is then skipped.
    """
    counts = torch.empty(2, dtype=torch.float64, device=env.device)
    counts[0], counts[1] = tokens, sentences  # filled on the device: torch.tensor(..., device) would wait for it
    all_reduce_(counts, env)
    norm = (env.world_size / counts[0].clamp_min(1.0)).float()
    return UpdateStats(tokens=counts[0], sentences=counts[1]), norm


def apply_gradients(step: Stepper, stats: UpdateStats, lr: float) -> UpdateStats:
    """Clip (optionally), check finiteness and step the optimizer; a non-finite update is skipped.

    Gradients are identical on every rank after DDP's all-reduce, so every rank
    takes the same decision without another collective. The host takes it
    (one read of the gradient norm), or with ``Stepper.defer_sync`` the
    device, without waiting for it (`_deferred_stats`).
    """
    params = [p for p in step.module.parameters() if p.grad is not None]
    step.scaler.unscale_(step.optimizer)
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=step.env.device)
    if step.defer_sync:
        loss = _on_device(stats.loss_sum, norm.device)
        finite: bool | Tensor = (
            torch.isfinite(norm) & torch.isfinite(loss) & (_on_device(stats.tokens, norm.device) > 0)
        )
        _step(step, params, norm, lr, finite)
        return _deferred_stats(step, stats, norm, finite)
    gnorm = float(norm)  # the one host sync of the update's gradients
    finite = math.isfinite(gnorm) and math.isfinite(stats.loss_sum)
    _step(step, params, norm, lr, finite)
    stats.gnorm, stats.stepped = gnorm, finite and stats.tokens > 0
    return stats


def _step(step: Stepper, params: list[nn.Parameter], norm: Tensor, lr: float, finite: bool | Tensor) -> None:
    """Clip, set the lr and step the optimizer unless the update is non-finite; the one apply path of both ways.

    ``finite`` is the host's decision (a bool), or the device's (a tensor):
    the fused optimizer then skips its step (step counts included) where
    ``found_inf`` is set, the protocol GradScaler uses with fused optimizers,
    and clipping runs regardless (a skipped step ignores the result). With
    fp16 the scaler itself skips a step whose scaled gradients overflowed.
    """
    if finite is not False and step.clip_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, step.clip_norm, norm)
    set_lr(step.optimizer, lr)
    if step.scaler.is_enabled():
        step.scaler.step(step.optimizer)
        step.scaler.update()
    elif isinstance(finite, Tensor):
        step.optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
        try:
            step.optimizer.step()
        finally:
            del step.optimizer.found_inf  # type: ignore[attr-defined]
    elif finite:
        step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)


def _deferred_stats(step: Stepper, stats: UpdateStats, norm: Tensor, finite: Tensor) -> UpdateStats:
    """The update's figures on the device, zeroed when it was skipped; ``skipped`` tells the trainer, which reads
    it at its next log line, validation or checkpoint (`Trainer._settle`)."""
    zero = torch.zeros((), dtype=torch.float64, device=norm.device)

    def kept(value: float | Tensor) -> Tensor:  # the figure, or 0 when the update was skipped
        return torch.where(finite, _on_device(value, norm.device).double(), zero)

    skipped = (_on_device(stats.tokens, norm.device) > 0) & ~finite
    overflow = step.scaler.is_enabled() & torch.isfinite(_on_device(stats.loss_sum, norm.device))  # the scaler's
    return UpdateStats(
        loss_sum=kept(stats.loss_sum), nll_sum=kept(stats.nll_sum), tokens=kept(stats.tokens),
        sentences=kept(stats.sentences), gnorm=kept(norm), stepped=not _known_empty(stats),
        skipped=skipped.double(), nonfinite=(skipped & ~overflow).double(),
    )  # fmt: skip


def _known_empty(stats: UpdateStats) -> bool:
    """Whether the host already knows the update had no target token (one process: counted on the host)."""
    return not isinstance(stats.tokens, Tensor) and stats.tokens == 0


def _on_device(value: float | Tensor, device: torch.device) -> Tensor:
    """``value`` as a tensor on ``device``; a float is filled in there, since copying one from the host would wait."""
    if isinstance(value, Tensor):
        return value
    return torch.full((), float(value), dtype=torch.float64, device=device)
