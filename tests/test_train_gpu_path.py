"""The GPU path of training, as far as a CPU can check it: read-ahead, padded lengths, fused Adam and its
device-side skip, figures read only at log lines, MFU, compilation counts. Tests marked `gpu` need CUDA."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from helpers import metric_records, run_config

from transformer_mt.config import ModelConfig, TrainConfig
from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.data.dataset import Batch, collate, pad_to_multiple
from transformer_mt.model import packing
from transformer_mt.model.transformer import Transformer
from transformer_mt.train import build
from transformer_mt.train.distributed import DistEnv, setup
from transformer_mt.train.loss import label_smoothed_cross_entropy
from transformer_mt.train.mfu import device_peak_flops, peak_tflops, throughput_figures
from transformer_mt.train.prefetch import prefetched
from transformer_mt.train.schedule import build_optimizer, load_optimizer_state, set_lr
from transformer_mt.train.step import (
    Stepper,
    TrainError,
    UpdateStats,
    _compiled,
    accumulate_gradients,
    apply_gradients,
    forward_loss,
)
from transformer_mt.train.trainer import Trainer, train_model

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = DistEnv(0, 1, 0, torch.device("cpu"), True)


# ---------------------------------------------------------------- read-ahead


def test_prefetched_keeps_order_and_prepares_the_next_item_in_the_background():
    prepared_on: list[tuple[int, str]] = []
    pulled: list[int] = []

    def items():
        for i in range(5):
            pulled.append(i)
            yield i

    def prepare(i: int) -> int:
        prepared_on.append((i, threading.current_thread().name))
        return i * i

    out = []
    for item, value in prefetched(items(), prepare):
        out.append((item, value))
        assert len(pulled) == min(item + 2, 5)  # the next item is read (and prepared) before this one is used
    assert out == [(i, i * i) for i in range(5)]
    assert [i for i, _ in prepared_on] == list(range(5))
    assert all(name.startswith("prefetch") for _, name in prepared_on)


def test_prefetched_raises_a_failed_preparation_at_its_item():
    def prepare(i: int) -> int:
        if i == 2:
            raise ValueError("bad batch")
        return i

    seen = []
    with pytest.raises(ValueError, match="bad batch"):
        for item, _ in prefetched(range(4), prepare):
            seen.append(item)
    assert seen == [0, 1]


def test_trainer_reads_the_same_batches_in_the_same_order(prepared_toy, tmp_path):
    """Batches read ahead are the epoch's batches, collated as before, each with the position after it."""
    trainer = Trainer(run_config(prepared_toy, tmp_path / "run", update_freq=2, max_updates=0, max_epochs=1), CPU)
    groups = trainer.epochs.batches(1)
    seen = list(prefetched(trainer.epochs.updates(1, 0), trainer.epochs.collate))
    assert len(seen) == -(-len(groups) // 2)
    for k, ((group, epoch, position), batches) in enumerate(seen):
        assert epoch == 1 and position == min(2 * k + 2, len(groups))
        for idx, batch in zip(group, batches, strict=True):
            expected = collate(trainer.data.train, idx)
            assert torch.equal(batch.src, expected.src) and torch.equal(batch.tgt_out, expected.tgt_out)
    assert trainer.progress.batch_in_epoch == 0  # reading ahead moves no position; `run` does


# ---------------------------------------------------------------- padded lengths


def _batch(lengths: list[int], vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, vocab, (n,), generator=g) for n in lengths]
    longest = max(lengths) + 1
    src = torch.full((len(rows), longest), PAD)
    tgt_in, tgt_out = src.clone(), src.clone()
    for i, r in enumerate(rows):
        src[i, : len(r)], src[i, len(r)] = r, EOS
        tgt_in[i, 0], tgt_in[i, 1 : len(r) + 1] = BOS, r.flip(0)
        tgt_out[i, : len(r)], tgt_out[i, len(r)] = r.flip(0), EOS
    return Batch(src, tgt_in, tgt_out)


def test_padding_to_a_multiple_changes_shapes_not_the_loss():
    """Pads are masked keys and ignored targets: the summed loss and NLL are those of the unpadded batch."""
    model_cfg = ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0)
    torch.manual_seed(0)
    model = Transformer(model_cfg, 50, PAD).eval()
    batch = _batch([5, 9, 3], vocab=50, seed=1)
    padded = pad_to_multiple(batch, 8, limit=256)
    assert padded.src.shape == (3, 16) and padded.tgt_in.shape == (3, 16)  # 10 -> 16 tokens
    assert padded.num_tgt_tokens == batch.num_tgt_tokens and torch.equal(padded.src[:, :10], batch.src)
    with torch.no_grad():
        loss, nll = forward_loss(model, batch, "fp32", 0.1)
        loss_p, nll_p = forward_loss(model, padded, "fp32", 0.1)
    torch.testing.assert_close(loss_p, loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(nll_p, nll, rtol=1e-6, atol=1e-5)


def test_the_loss_on_a_cpu_runs_the_model_on_the_real_tokens_alone(monkeypatch: pytest.MonkeyPatch):
    """forward_loss packs on the CPU (`Packing`): the same loss and gradients as the padded batch's, in fp64."""
    model_cfg = ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0)
    torch.manual_seed(0)
    model = Transformer(model_cfg, 50, PAD).double().eval()
    batch = _batch([5, 9, 3, 1], vocab=50, seed=1)
    packed = []
    original = packing.Packing.of
    monkeypatch.setattr(packing.Packing, "of", classmethod(lambda cls, mask: packed.append(mask) or original(mask)))
    loss, nll = forward_loss(model, batch, "fp32", 0.1)
    assert len(packed) == 2  # the source, then the target
    logits = model(batch.src, batch.tgt_in).flatten(0, 1)
    loss_ref, nll_ref = label_smoothed_cross_entropy(logits, batch.tgt_out.reshape(-1), 0.1, PAD)
    torch.testing.assert_close((loss, nll), (loss_ref, nll_ref), rtol=1e-12, atol=1e-12)
    params = list(model.parameters())
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(loss_ref, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    compiled = torch.compile(model)
    assert _compiled(compiled) and not _compiled(model)  # a compiled model runs padded: no packing inside a graph


def test_padding_never_passes_the_limit_and_multiple_one_is_off():
    batch = _batch([11, 2], vocab=50, seed=2)  # length 12
    assert pad_to_multiple(batch, 8, limit=14).src.shape[1] == 14  # not 16: max_positions is 14
    assert pad_to_multiple(batch, 8, limit=10).src.shape[1] == 12  # never shorter than the batch itself
    assert pad_to_multiple(batch, 1, limit=256) is batch and pad_to_multiple(batch, 0, limit=256) is batch


# ---------------------------------------------------------------- MFU


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 SXM5", 989.0), ("NVIDIA H200", 989.0),
     ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0),
     ("NVIDIA H100 PCIe", 756.0), ("NVIDIA L4", 121.0), ("Mystery GPU", None)],
)  # fmt: skip
def test_peak_table_by_device_name(name, peak):
    assert peak_tflops(name) == peak


def test_no_mfu_without_a_known_peak():
    assert device_peak_flops(torch.device("cpu")) is None
    assert throughput_figures(6e8, 1e4, None) == {"model_tflops": pytest.approx(6.0)}
    assert throughput_figures(6e8, 1e4, 12e12) == {"model_tflops": pytest.approx(6.0), "mfu": pytest.approx(0.5)}


# ---------------------------------------------------------------- the optimizer and the deferred step


def test_adam_is_fused_and_resuming_keeps_the_implementation():
    """Fused on the CPU too (3x faster there), the paper's Adam all the same; an unfused state loads fused."""
    module = torch.nn.Linear(3, 2)
    twin = copy.deepcopy(module)
    cpu = build_optimizer(module.parameters(), TrainConfig())
    plain = torch.optim.Adam(twin.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)  # torch's default loop
    assert cpu.defaults["fused"] is True and plain.defaults["fused"] is None
    for lr in (0.1, 0.05):
        for m, opt in ((module, cpu), (twin, plain)):
            for p in m.parameters():
                p.grad = torch.linspace(-1, 1, p.numel()).view_as(p) * lr
            set_lr(opt, lr)
            opt.step()
    for fused, looped in zip(module.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(fused, looped, atol=1e-6, rtol=0)  # the same update, to float rounding
    saved = cpu.state_dict()
    saved["param_groups"][0].update(fused=None, foreach=True)  # as written by an unfused run
    again = build_optimizer(module.parameters(), TrainConfig())
    load_optimizer_state(again, saved)
    assert again.param_groups[0]["fused"] is True and again.param_groups[0]["foreach"] is None
    assert torch.equal(again.state[module.weight]["exp_avg"], cpu.state[module.weight]["exp_avg"])


def _deferred_stepper(module: torch.nn.Module, clip_norm: float = 0.0) -> Stepper:
    """A stepper that never waits for the device: fused Adam (which CPUs have too) skipping on the device."""
    opt = torch.optim.Adam(module.parameters(), lr=0.0, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Stepper(module, module, opt, scaler, CPU, "fp32", 0.1, clip_norm, defer_sync=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_deferred_step_skips_a_nonfinite_update_on_the_device(bad):
    m = torch.nn.Linear(3, 2)
    step = _deferred_stepper(m, clip_norm=1.0)
    figures = []
    for g in (1.0, bad, 2.0):
        before = [p.detach().clone() for p in m.parameters()]
        for p in m.parameters():
            p.grad = torch.full_like(p, g)
        stats = apply_gradients(step, UpdateStats(loss_sum=torch.tensor(1.0, dtype=torch.float64), tokens=5.0), 0.1)
        changed = not all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
        figures.append((changed, float(stats.skipped), float(stats.nonfinite), float(stats.tokens), stats.stepped))
    assert figures == [(True, 0.0, 0.0, 5.0, True), (False, 1.0, 1.0, 0.0, True), (True, 0.0, 0.0, 5.0, True)]
    assert step.optimizer.state[m.weight]["step"].item() == 2  # the skipped update took no step


def test_deferred_accumulation_keeps_its_figures_on_the_device():
    torch.manual_seed(0)
    module = Transformer(ModelConfig(d_model=16, d_ff=32, heads=2, encoder_layers=1, decoder_layers=1), 40, PAD)
    step = _deferred_stepper(module)
    batches = [_batch([4, 6], vocab=40, seed=3), _batch([7], vocab=40, seed=4)]
    stats = accumulate_gradients(step, batches)
    assert isinstance(stats.loss_sum, torch.Tensor) and stats.tokens == 20.0  # one process: counted on the host
    applied = apply_gradients(step, stats, lr=1e-3)
    assert all(isinstance(getattr(applied, k), torch.Tensor) for k in ("loss_sum", "nll_sum", "gnorm", "skipped"))
    assert float(applied.loss_sum) == pytest.approx(float(stats.loss_sum)) and float(applied.skipped) == 0.0


def _fused_adam(monkeypatch) -> None:
    """Make the trainer build fused Adam on the CPU, hence defer host synchronization as it does on CUDA."""

    def fused(params, cfg):
        return torch.optim.Adam(params, lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)

    monkeypatch.setattr(build, "build_optimizer", fused)


def test_deferred_run_equals_a_host_synced_run(prepared_toy, tmp_path, monkeypatch):
    """Same weights and the same metric lines whether an update's figures are read at once or at log lines."""
    _fused_adam(monkeypatch)
    common = dict(max_updates=6, update_freq=2, log_every=2, validate_every=3, save_every_updates=3, keep_last=9)
    deferred = train_model(run_config(prepared_toy, tmp_path / "deferred", **common))

    real = build.build_stepper

    def synced(cfg, env, vocab_size):
        return dataclasses.replace(real(cfg, env, vocab_size), defer_sync=False)

    monkeypatch.setattr("transformer_mt.train.trainer.build_stepper", synced)
    synced_result = train_model(run_config(prepared_toy, tmp_path / "synced", **common))
    assert (deferred.update, deferred.valid_loss) == (synced_result.update, synced_result.valid_loss)
    a = torch.load(tmp_path / "deferred" / "checkpoint_u0000006.pt", weights_only=True)
    b = torch.load(tmp_path / "synced" / "checkpoint_u0000006.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])

    def lines(run):
        return [{k: v for k, v in m.items() if "per_s" not in k and "tflops" not in k and k != "minutes"}
                for m in metric_records(run) if m["kind"] in ("train", "valid")]  # fmt: skip

    assert lines(tmp_path / "deferred") == lines(tmp_path / "synced")


def test_deferred_run_stops_after_max_nonfinite_in_a_row(prepared_toy, tmp_path, monkeypatch, capsys):
    _fused_adam(monkeypatch)
    cfg = run_config(prepared_toy, tmp_path / "run", lr_scale=1e38, max_nonfinite=3, warmup=1, log_every=4)
    with pytest.raises(TrainError, match=r"updates in a row had a non-finite loss .*lower train.lr_scale"):
        train_model(cfg)
    assert "skipped" in capsys.readouterr().err


def test_train_records_carry_model_tflops_and_no_mfu_on_a_cpu(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=2, log_every=1, validate_every=100, pad_to_multiple=8))
    train = [m for m in metric_records(run) if m["kind"] == "train"]
    assert len(train) == 2 and all(m["model_tflops"] > 0 and "mfu" not in m for m in train)
    assert all("compiled_graphs" not in m for m in train)
    err = capsys.readouterr().err
    assert "model TFLOP/s" in err and "MFU" not in err


@pytest.mark.slow
def test_compiled_run_counts_its_graphs(prepared_toy, tmp_path, capsys):
    """torch.compile on the CPU, lengths padded to multiples of 8: the graphs built are logged, and bounded."""
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=6, log_every=3, validate_every=100, compile=True,
                     pad_to_multiple=8))  # fmt: skip
    graphs = [m["compiled_graphs"] for m in metric_records(run) if m["kind"] == "train"]
    assert len(graphs) == 2 and 1 <= graphs[0] <= graphs[1] <= 8
    assert f"torch.compile: {graphs[1]} graph(s) compiled" in capsys.readouterr().err


# ---------------------------------------------------------------- on a GPU


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_update_on_cuda_never_waits_for_the_device(precision):
    """Fused Adam, pinned batches copied asynchronously, and no synchronizing call in accumulate or apply."""
    env = setup()
    cfg = TrainConfig(precision=precision)
    torch.manual_seed(0)
    module = Transformer(ModelConfig(d_model=64, d_ff=128, heads=4, encoder_layers=2, decoder_layers=2), 100, PAD)
    module = module.to(env.device)
    opt = build_optimizer(module.parameters(), cfg)
    assert opt.defaults["fused"] is True
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    step = Stepper(module, module, opt, scaler, env, precision, 0.1, 1.0, defer_sync=True)
    batches = [_batch([5, 9, 3], 100, seed).pin_memory() for seed in range(3)]
    apply_gradients(step, accumulate_gradients(step, batches[:1]), 1e-3)  # the first call allocates state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[1:]:
            stats = apply_gradients(step, accumulate_gradients(step, [batch]), 1e-3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(stats.skipped) == 0.0 and float(stats.loss_sum) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_logs_mfu_on_a_known_device(prepared_toy, tmp_path):
    run = tmp_path / "run"
    train_model(run_config(prepared_toy, run, max_updates=4, log_every=2, validate_every=100, pad_to_multiple=8))
    train = [m for m in metric_records(run) if m["kind"] == "train"]
    assert len(train) == 2 and all(m["model_tflops"] > 0 for m in train)
    known = device_peak_flops(torch.device("cuda")) is not None
    assert all(("mfu" in m) == known for m in train)
