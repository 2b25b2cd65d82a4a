"""What a training run is built from: its prepared data, and the model with the tools of one update.

`transformer_mt.train.trainer.Trainer` calls these once, in this order:
`load_run_data` (rank 0 prepares ``data.dir`` first when needed), then
`build_stepper`, which seeds the model's initial weights identically on every
rank before drawing anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from transformer_mt.checkpoint import Batching
from transformer_mt.config import Config
from transformer_mt.cpus import check_memory
from transformer_mt.data.batching import too_long
from transformer_mt.data.bpe import PAD, load_bpe
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.directions import mixed, multilingual
from transformer_mt.data.mix import CorpusMix, direction_parts, train_mix
from transformer_mt.model.onednn import use_onednn_linears
from transformer_mt.model.transformer import Transformer, describe_size, model_bytes
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.run_files import batching_key, dropout_seed
from transformer_mt.train.schedule import build_optimizer
from transformer_mt.train.step import Stepper, TrainError, resolve_precision


def max_sentence_len(cfg: Config) -> int:
    """Longest sentence (tokens, EOS/BOS included) trained or validated on: it must fit a batch and the model."""
    return min(cfg.train.max_tokens, cfg.model.max_positions)


@dataclass(frozen=True)
class RunData:
    """The prepared data of a run and what the trainer derives from it once."""

    dir: Path  # data.dir, prepared
    train: ParallelDataset | CorpusMix  # with data.directions, every direction's pairs behind their tags
    valid: ParallelDataset | CorpusMix
    spm_model: bytes  # the sentencepiece model, stored in every checkpoint
    vocab_size: int
    max_len: int  # `max_sentence_len`: longer sentences are left out of training and validation
    too_long: dict[str, int]  # sentences left out, per split ("train", "valid")
    batching: Batching  # `batching_key`: what decides the epoch's batch order besides epoch and world size
    valid_directions: dict[str, CorpusMix] = field(default_factory=dict)  # data.directions: each one's valid split


def load_run_data(cfg: Config, env: DistEnv) -> RunData:
    """Open ``data.dir`` (prepared by rank 0 when needed, `prepare_on_rank0`) memory-mapped."""
    data_dir = prepare_on_rank0(cfg, env)
    spm_path = data_dir / "spm.model"
    bpe = load_bpe(spm_path)  # the tags' ids, and the vocabulary's size
    max_len = max_sentence_len(cfg)
    valid_directions = {}
    if multilingual(cfg.data):
        parts = direction_parts(data_dir, cfg.data, "valid", bpe)
        valid = CorpusMix(list(parts.values()))
        valid_directions = {name: CorpusMix([part]) for name, part in parts.items()}
    else:
        valid = ParallelDataset(data_dir, "valid", cfg.data.src_lang, cfg.data.tgt_lang)  # DatasetError: the file
    if mixed(cfg.data):
        train = train_mix(data_dir, cfg.data, bpe)
    else:
        train = ParallelDataset(data_dir, "train", cfg.data.src_lang, cfg.data.tgt_lang)
    return RunData(
        dir=data_dir,
        train=train,
        valid=valid,
        spm_model=spm_path.read_bytes(),
        vocab_size=bpe.get_piece_size(),
        max_len=max_len,
        too_long={
            name: int(too_long(ds.src_lens, ds.tgt_lens, max_len).sum())
            for name, ds in (("train", train), ("valid", valid))
        },
        batching=batching_key(
            train.src_lens, train.tgt_lens, cfg.train.max_tokens, cfg.train.seed, max_len, cfg.bpe.sampling_alpha
        ),
        valid_directions=valid_directions,
    )


def prepare_on_rank0(cfg: Config, env: DistEnv) -> Path:
    """Rank 0 prepares ``data.dir`` when needed; the other ranks wait for it outside any collective.

    Preparing WMT takes far longer than a collective may wait (NCCL's default
    timeout is 10 minutes), so the others poll for the finished data
    (`wait_until_prepared`) and nobody waits in a collective meanwhile. When
    rank 0 fails it raises at once, and torchrun stops the waiting ranks.
    """
    from transformer_mt.data.prepare import prepare_data, wait_until_prepared

    if not env.is_main:
        wait_until_prepared(cfg, f"rank {env.rank}")
        return Path(cfg.data.dir)
    return Path(prepare_data(cfg))


def build_stepper(cfg: Config, env: DistEnv, vocab_size: int) -> Stepper:
    """The model, its optimizer and loss scaler, and the module that runs forward (compiled, DDP-wrapped).

    The initial weights are drawn from ``train.seed`` alone, so every rank
    starts from the same model; then each rank's generator is reseeded for its
    own dropout masks (`dropout_seed`).
    """
    tc = cfg.train
    check_training_memory(cfg, env, vocab_size)
    precision = resolve_precision(tc.precision, env.device)
    torch.manual_seed(tc.seed)  # identical initial weights on every rank
    module = Transformer(cfg.model, vocab_size, pad_id=PAD).to(env.device)
    if not tc.compile:  # on the CPU: bf16 training and fp32 validation decoding through oneDNN (model/onednn.py)
        use_onednn_linears(module, output_projection=False)
    torch.manual_seed(dropout_seed(tc.seed, env.rank))
    optimizer = build_optimizer(module.parameters(), tc)
    scaler = torch.amp.GradScaler(env.device.type, enabled=precision == "fp16")
    model: nn.Module = torch.compile(module) if tc.compile else module
    if env.distributed:
        model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    return Stepper(
        model, module, optimizer, scaler, env, precision, tc.label_smoothing, tc.clip_norm, tc.max_tokens,
        tc.update_freq, defer_sync=bool(optimizer.defaults.get("fused")) and env.device.type == "cuda",
    )  # fmt: skip


TRAINING_COPIES = 4  # the weights, their gradients and Adam's two moments, each as large as the weights


def check_training_memory(cfg: Config, env: DistEnv, vocab_size: int) -> None:
    """Refuse a model whose training cannot fit in this machine's memory, before any of it is allocated
    (`cpus.check_memory`): a --set model.d_model in range can still ask for 51 GB. On a GPU the host holds
    the weights only while they are built."""
    copies = TRAINING_COPIES if env.device.type == "cpu" else 1
    check_memory(
        model_bytes(cfg.model, vocab_size) * copies,
        f"training the model of this config ({describe_size(cfg.model, vocab_size)})"
        + (", with its gradients and Adam's two moments," if copies > 1 else ""),
        "make the model smaller (model.d_model, model.d_ff, model.encoder_layers, model.decoder_layers) or train "
        "on a machine with more memory",
        TrainError,
    )


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far: the first compilation of a model, and one more per
    recompilation (a new shape it could not reuse a graph for) or graph break. Read from dynamo's counters."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
