"""`tmt export ctranslate2`: a CTranslate2 model directory from a tmt checkpoint.

CTranslate2 is OpenNMT's C++ inference engine for Transformer translation
models (int8, fp16 and bf16 kernels on CPU and GPU). The directory it loads,
written here whole or not at all:

    model.bin               the weights in CTranslate2's format (quantized with --quantization)
    config.json             CTranslate2's settings: special tokens, EOS added to every source, LayerNorm epsilon
    shared_vocabulary.json  the joint BPE vocabulary, one sentencepiece piece per id
    spm.model               the checkpoint's sentencepiece model with tmt's text normalization built in
                            (`export.normalizer`): raw text in, the ids tmt feeds its model out
    tmt_config.yaml         the checkpoint's tmt config: decoding settings and languages

How the model maps onto CTranslate2's TransformerSpec is documented in
`transformer_mt.export.ctranslate2_spec`. The `ctranslate2` package is an
optional dependency, imported only here and by `tmt translate --engine
ctranslate2`, so `tmt --help` and every other command run without it.

`tmt export spm` writes out the sentencepiece model a checkpoint was trained
with (`export_spm`), for ``bpe.model``: `tmt prepare` then encodes a new
corpus with the checkpoint's vocabulary, which fine-tuning on it needs.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.config import ModelConfig
from transformer_mt.decode.ctranslate2_engine import SPM_MODEL, TMT_CONFIG, pieces_of, require_ctranslate2
from transformer_mt.decode.load import load_model
from transformer_mt.errors import UserError, raise_if_stopped
from transformer_mt.files import atomic_open, check_output_file, check_output_parent, is_in_place, naming

QUANTIZATIONS = ("float32", "int8", "int8_float32", "float16", "bfloat16")


class ExportError(UserError):
    """A problem the user can fix; the message names the file or option and the fix."""


def export_ctranslate2(
    checkpoints: Sequence[str | Path], out: str | Path, quantization: str = "float32", force: bool = False
) -> Path:
    """Write the CTranslate2 model of ``checkpoints`` (several are averaged, as `tmt translate` does) to ``out``.

    ``quantization`` is the weight type CTranslate2 stores: float32 (the
    model as trained), int8 (int8 weights, float32 elsewhere), int8_float32
    (the same), float16 or bfloat16 (for GPUs). An existing ``out`` is
    replaced only with ``force``.
    """
    if quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; choose another -o or pass --force to replace it")
    check_output_parent(out)
    ct2 = require_ctranslate2()
    from transformer_mt.export.ctranslate2_spec import TmtConverter
    from transformer_mt.export.normalizer import check_normalization, normalizing_spm

    # the fp32 model as trained, whatever its decode.quantize says: CTranslate2 quantizes on its own
    loaded = load_model(checkpoints, device="cpu", overrides=["decode.quantize=none"])
    check_exportable(loaded.config.model)
    with atomic_directory(out) as tmp:
        converter = TmtConverter(loaded.model, pieces_of(loaded.bpe))
        # The directory is ours and empty: CTranslate2 may recreate it (force=True).
        converter.convert(str(tmp), quantization=None if quantization == "float32" else quantization, force=True)
        normalizing = normalizing_spm(loaded.spm_model)  # raw text through it alone gives tmt's ids
        check_normalization(normalizing, loaded.spm_model)
        (tmp / SPM_MODEL).write_bytes(normalizing)
        (tmp / TMT_CONFIG).write_text(loaded.config.to_yaml(), encoding="utf-8")
        if not ct2.contains_model(str(tmp)):
            raise ExportError(f"CTranslate2 {ct2.__version__} wrote no model.bin into {tmp}")
    return out


def export_spm(checkpoint: str | Path, out: str | Path, force: bool = False) -> int:
    """Write the sentencepiece model stored in ``checkpoint`` to ``out``, byte for byte; returns its size in bytes.

    The bytes are the ones the checkpoint's weights were trained against, so
    data prepared with them (``bpe.model: OUT``) passes `train.init_from`'s
    vocabulary check. An ``out`` with other bytes is replaced only with
    ``force``; one with the same bytes is left as it is, so a script that
    exports before every fine-tuning run can run again.
    """
    out = Path(out)
    check_output_file(out, example="spm.model")
    blob = read_checkpoint(checkpoint).spm_model  # a damaged file: CheckpointError naming it and the entry
    if out.is_file() and out.read_bytes() == blob:
        return len(blob)
    if out.exists() and not force and not is_in_place(out):  # a FIFO, /dev/null: nothing there to keep
        raise ExportError(
            f"{out} already exists and holds another sentencepiece model than {checkpoint}'s; choose another -o "
            "or pass --force to replace it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out, "wb") as f:
        f.write(blob)
    return len(blob)


def check_exportable(model: ModelConfig) -> None:
    """Refuse what CTranslate2's TransformerSpec cannot hold: queries and keys narrower than values (model.d_k),
    an encoder layer without its residual connection (model.encoder_no_residual_layer)."""
    if model.encoder_no_residual_layer:
        raise ExportError(
            f"this model has model.encoder_no_residual_layer={model.encoder_no_residual_layer} (an encoder layer "
            "without its attention residual); CTranslate2's Transformer has a residual around every sublayer, so it "
            "cannot be exported; translate it with tmt itself (tmt translate -c CKPT)"
        )
    head = model.d_model // model.heads
    if model.d_k not in (0, head):
        raise ExportError(
            f"this model has model.d_k={model.d_k} (queries and keys narrower than the values' d_model/heads={head}, "
            "Table 3 row B); CTranslate2's Transformer needs one width for all three, so it cannot be exported; "
            "translate it with tmt itself (tmt translate -c CKPT)"
        )


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``out``; on success it replaces ``out`` by renames.

    A crash or an error never leaves a half-written directory under ``out``:
    the temporary one is removed, and an ``out`` being replaced is moved
    aside first and deleted only once the new one is in place. A writer
    that finds no room names ``out`` (`files.naming`).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    tmp.mkdir()
    try:
        with naming(out):
            yield tmp
            _sync_files(tmp)
        raise_if_stopped()
        old = out.with_name(f".{out.name}.{secrets.token_hex(4)}.old")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _sync_files(directory: Path) -> None:
    """Flush every file of ``directory`` to disk, so that the rename never publishes files still in the page cache."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
