"""One way from checkpoint files to a model: every decode path (translate, evaluate, serve, export, attention
maps, ensembles, streaming) loads through `load_model` or `load_ensemble`.

`load_model` gives the fp32 `Transformer` exactly as trained (plain
``nn.Linear`` layers, eval mode), its config with the user's ``decode.*``
overrides applied and validated once, and its BPE model. What a decoder
swaps in for speed (int8 or oneDNN Linear layers, `for_decoding`) is a
separate step, so that an export or an attention map never sees those
layers. Decoding flags (``--beam``, ``--lenpen``, ``--nbest``,
``--batch-tokens``, ``--quantize``) are ``--set decode.*`` overrides
(`decode_flags`), so a rule such as nbest <= beam is checked in one place,
`transformer_mt.config.validate`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

from transformer_mt.checkpoint import Checkpoint, check_weights, read_average, run_dir_checkpoint
from transformer_mt.config import Config, ConfigError, apply_override, parse_override, validate
from transformer_mt.cpus import check_memory
from transformer_mt.data.bpe import BOS, EOS, PAD, UNK, load_bpe_bytes
from transformer_mt.decode.aligner import Aligner, AlignerShape, from_entry
from transformer_mt.errors import UserError
from transformer_mt.model.onednn import use_onednn_linears
from transformer_mt.model.transformer import Transformer, describe_size, model_bytes


class LoadError(UserError):
    """A checkpoint, device or override a user can fix; the message names the file or flag and the fix."""


@dataclass(frozen=True)
class LoadedModel:
    """A trained model as its checkpoint holds it: fp32 weights in eval mode, on ``device``."""

    model: Transformer
    config: Config
    bpe: spm.SentencePieceProcessor
    spm_model: bytes  # the sentencepiece model's bytes (what exports write out)
    device: torch.device
    aligner: Aligner | None = None  # the checkpoint's word aligner (`tmt train-aligner`), if it has one


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str | torch.device | None, default: str | None = None) -> torch.device:
    """``--device`` as a torch device, refused here when this machine cannot run it (before any model loads).

    torch would accept ``cuda`` on a build without CUDA and fail on the
    first tensor moved, in an assertion about how it was compiled.
    """
    try:
        device = torch.device(name or default or default_device())
    except RuntimeError:
        raise LoadError(f"--device {name}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"--device {name}: this machine has no CUDA GPU that torch can use; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise LoadError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), from cuda:0")
    return device


def decode_flags(
    beam: int | None = None,
    lenpen: float | None = None,
    nbest: int | None = None,
    batch_tokens: int | None = None,
    quantize: str | None = None,
    sample: str | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    alignment: str | None = None,
) -> list[str]:
    """The ``--set decode.*`` texts that the decoding flags stand for (those not None), in that order."""
    flags = {
        "beam_size": beam,
        "len_penalty": lenpen,
        "nbest": nbest,
        "batch_tokens": batch_tokens,
        "quantize": quantize,
        "sampling": sample,
        "sampling_temperature": temperature,
        "seed": seed,
        "alignment": alignment,
    }
    return [f"decode.{key}={value}" for key, value in flags.items() if value is not None]


def override_config(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with ``--set section.key=value`` overrides applied: only ``decode.*`` and ``model.max_positions``.

    Every other key is fixed by the trained weights or the data they were
    trained on. Sinusoidal positions are computed, not stored, so a trained
    model accepts any ``max_positions``; learned positions cannot change. A
    smaller ``decode.beam_size`` without a ``decode.nbest`` also shortens the
    stored n-best list to the beam. ``decode.sampling`` without a
    ``decode.beam_size`` sets the beam to 1 (a sample takes no beam). The
    result is validated once, here.
    """
    stored_nbest, nbest_given, beam_given = cfg.decode.nbest, False, False
    for text in overrides:
        section, key, _ = parse_override(text)
        if section != "decode" and f"{section}.{key}" != "model.max_positions":
            raise ConfigError(
                f"--set {text}: a trained checkpoint only takes decode.* keys and model.max_positions; "
                "the other keys are fixed by its weights"
            )
        nbest_given = nbest_given or f"{section}.{key}" == "decode.nbest"
        beam_given = beam_given or f"{section}.{key}" == "decode.beam_size"
        changed = apply_override(cfg, text)
        if changed.model.max_positions != cfg.model.max_positions and cfg.model.positions == "learned":
            raise ConfigError(
                f"--set {text}: this checkpoint has learned positions (one trained vector per position), so "
                f"model.max_positions stays {cfg.model.max_positions}"
            )
        cfg = changed
    return _settled(cfg, stored_nbest, nbest_given, beam_given)


def change_decode(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """``cfg`` with typed ``changes`` to its decode section (``{"beam_size": 2}``, a server request's), by
    `override_config`'s rules (a sample takes no beam unless one is given; a smaller beam shortens the stored
    n-best), validated."""
    changed = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, **changes))
    return _settled(changed, cfg.decode.nbest, "nbest" in changes, "beam_size" in changes)


def _settled(cfg: Config, stored_nbest: int, nbest_given: bool, beam_given: bool) -> Config:
    """The decode section's implied values, then the whole config validated once."""
    if not beam_given and cfg.decode.sampling != "none":
        cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, beam_size=1))
    if not nbest_given:
        cfg = dataclasses.replace(
            cfg, decode=dataclasses.replace(cfg.decode, nbest=min(stored_nbest, cfg.decode.beam_size))
        )
    validate(cfg)
    return cfg


def load_model(
    paths: Sequence[str | Path], device: str | torch.device | None = None, overrides: Sequence[str] = ()
) -> LoadedModel:
    """The model of ``paths`` (several are averaged, exactly as `tmt average` does), fp32, eval mode, on ``device``.

    Config and BPE model come from the newest input (highest update), with
    ``overrides`` (see `override_config`). A file that is not a checkpoint
    is refused by `read_checkpoint`, naming the file and the entry.
    """
    paths = _paths(paths)
    device = resolve_device(device)
    ck = read_average(paths)
    cfg = override_config(ck.config, overrides)
    return _loaded(ck, cfg, paths[0], device)


def load_checkpoint(ck: Checkpoint, path: str | Path, device: str | torch.device | None = None) -> LoadedModel:
    """The model of a checkpoint already read (`read_checkpoint`), as `load_model` gives it for ``path`` alone:
    for a command that also writes the checkpoint back (`tmt train-aligner`), so that it reads the file once."""
    return _loaded(ck, ck.config, Path(path), resolve_device(device))


def load_ensemble(
    paths: Sequence[str | Path], device: str | torch.device | None = None, overrides: Sequence[str] = ()
) -> list[LoadedModel]:
    """The models of ``paths``, each whole, to decode together (`transformer_mt.decode.ensemble.Ensemble`).

    Every checkpoint must hold the same BPE model: an ensemble averages the
    models' log-probabilities token id by token id. Each model keeps its own
    shape. Every returned config decodes with the first checkpoint's
    settings (and ``overrides``, applied to each); its max_positions is the
    smallest of the models'.
    """
    paths = _paths(paths)
    device = resolve_device(device)
    checkpoints = [read_average([path]) for path in paths]
    for path, ck in zip(paths[1:], checkpoints[1:], strict=True):
        if ck.spm_model != checkpoints[0].spm_model:
            raise LoadError(
                f"{path}: a different BPE model (vocabulary) than {paths[0]}; an ensemble averages the models' "
                "log-probabilities token by token, so its models must share one vocabulary: ensemble models "
                "trained on the same prepared data (data.dir)"
            )
    configs = [override_config(ck.config, overrides) for ck in checkpoints]
    decode, positions = configs[0].decode, min(c.model.max_positions for c in configs)
    configs = [
        dataclasses.replace(c, decode=decode, model=dataclasses.replace(c.model, max_positions=positions))
        for c in configs
    ]
    return [_loaded(ck, c, path, device) for path, ck, c in zip(paths, checkpoints, configs, strict=True)]


def for_decoding(model: Transformer, cfg: Config) -> Transformer:
    """``model`` with the Linear layers that decode fastest: int8 when ``decode.quantize`` says so, else (fp32 on
    an x86-64 CPU) oneDNN's (`transformer_mt.model.onednn`); the same outputs either way for fp32."""
    if cfg.decode.quantize == "int8":
        from transformer_mt.model.quantize import quantize_int8

        return quantize_int8(model)
    return use_onednn_linears(model)


def _paths(paths: Sequence[str | Path]) -> list[Path]:
    """The checkpoint files of ``-c``: a run directory stands for its average.pt, else its checkpoint_best.pt
    (said on stderr); a directory with neither is refused by `read_checkpoint`, naming what to pass."""
    if not paths:
        raise LoadError("no checkpoint given; pass one or more with -c CHECKPOINT")
    files = []
    for path in map(Path, paths):
        chosen = run_dir_checkpoint(path)
        if chosen is not None:
            print(f"{path} is a run directory: decoding with {chosen}", file=sys.stderr)
        files.append(chosen or path)
    return files


def checkpoint_bpe(ck: Checkpoint, path: Path) -> spm.SentencePieceProcessor:
    """The BPE model a checkpoint carries; bytes sentencepiece cannot read, or a model of too few pieces to hold
    tmt's special tokens, are a LoadError naming the entry."""
    try:
        bpe = load_bpe_bytes(ck.spm_model)
    except RuntimeError:  # sentencepiece's parse error, in protobuf's words
        bpe = None
    if bpe is None or bpe.get_piece_size() <= max(PAD, EOS, BOS, UNK):
        raise LoadError(
            f"{path}: the 'spm_model' entry is not a sentencepiece model tmt wrote; the file is damaged or was not "
            "written by `tmt train` or `tmt average`"
        )
    return bpe


def check_loadable(ck: Checkpoint, path: Path) -> None:
    """Refuse ``ck`` unless `load_model` can load it: a readable BPE model and weights that fit the model its config
    describes (names, shapes, floating point), checked against a model built on the meta device (no memory), so that
    `tmt average` never writes a file that decoding would refuse."""
    bpe = checkpoint_bpe(ck, path)
    with torch.device("meta"):
        expected = Transformer(ck.config.model, bpe.get_piece_size(), pad_id=PAD).state_dict()
    check_weights(path, ck.model, expected)


def _loaded(ck: Checkpoint, cfg: Config, path: Path, device: torch.device) -> LoadedModel:
    """The model of ``ck``: its weights checked against a model built on the meta device, and its size against
    the memory left, before the model is allocated (a crafted config may describe one of 51 GB)."""
    bpe = checkpoint_bpe(ck, path)
    with torch.device("meta"):
        expected = Transformer(cfg.model, bpe.get_piece_size(), pad_id=PAD).state_dict()
    check_weights(path, ck.model, expected)
    check_memory(
        model_bytes(cfg.model, bpe.get_piece_size()),
        f"{path}: the model its config describes ({describe_size(cfg.model, bpe.get_piece_size())})",
        "translate on a machine with more memory",
        LoadError,
    )
    model = Transformer(cfg.model, bpe.get_piece_size(), pad_id=PAD)
    model.load_state_dict(ck.model)
    return LoadedModel(model.to(device).eval(), cfg, bpe, ck.spm_model, device, _aligner(ck, cfg, path, device))


def _aligner(ck: Checkpoint, cfg: Config, path: Path, device: torch.device) -> Aligner | None:
    """The checkpoint's word aligner, its weights checked against the head its shape describes; None without."""
    if ck.aligner is None:
        return None
    shape = AlignerShape.of(ck.aligner["shape"])
    with torch.device("meta"):
        expected = Aligner(cfg.model.d_model, shape).state_dict()
    check_weights(path, ck.aligner["weights"], expected, entry="aligner")
    return from_entry(ck.aligner, cfg.model.d_model).to(device)
