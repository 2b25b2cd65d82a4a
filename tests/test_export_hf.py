"""`tmt export hf`: the exported directory in transformers alone gives tmt's logits and translations.

transformers is a test dependency (the dev extra); tmt itself never imports
it. Equality is checked against tmt under matching decoding settings
(`generation_config`): fairseq's length penalty, k_finished stopping, one
length limit for the batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config, ModelConfig
from transformer_mt.decode.load import load_model
from transformer_mt.decode.search import pad_batch
from transformer_mt.decode.translate import Translator
from transformer_mt.export.hf import HfExportError, check_marian, export_hf, interleave_to_halves

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

MATCHING = [  # tmt's decoding as generate can express it (generation_config's docstring)
    "decode.len_penalty_form=fairseq", "decode.stopping=k_finished", "decode.max_len_a=0", "decode.max_len_b=60",
    "decode.no_repeat_ngram=0",
]  # fmt: skip


def test_the_permutation_turns_tmt_positions_into_marians() -> None:
    d = 16
    pos = torch.arange(40, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    interleaved = torch.zeros(40, d, dtype=torch.float64)
    interleaved[:, 0::2], interleaved[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)  # the paper's, tmt's
    halves = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(40, d).create_weight()
    torch.testing.assert_close(interleaved[:, interleave_to_halves(d)].float(), halves, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "named"),
    [({"norm": "pre"}, "model.norm"), ({"positions": "learned"}, "model.positions"), ({"d_k": 8}, "model.d_k"),
     ({"share_embeddings": False}, "model.share_embeddings"),
     ({"encoder_no_residual_layer": 3}, "model.encoder_no_residual_layer: 3")],
)  # fmt: skip
def test_what_marian_cannot_hold_is_refused(change: dict, named: str) -> None:
    with pytest.raises(HfExportError, match=named):
        check_marian(dataclasses.replace(ModelConfig(), **change))
    check_marian(ModelConfig())


@pytest.fixture(scope="module")
def exported(toy_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    result = CliRunner().invoke(app, ["export", "hf", "-c", str(toy_ckpt), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "note: generate differs from tmt's decoding in the maximum length" in result.output
    return out


def test_the_directory_holds_what_transformers_loads(exported: Path, toy_ckpt: Path) -> None:
    names = {p.name for p in exported.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm",
                     "vocab.json", "tokenizer_config.json", "special_tokens_map.json", "README.md"}  # fmt: skip
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "marian" and config["decoder_start_token_id"] == 2
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["suppress_tokens"] == [0, 2]
    model, info = transformers.MarianMTModel.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info  # every weight found, none left over
    assert "transformer_mt" in (exported / "README.md").read_text()
    result = CliRunner().invoke(app, ["export", "hf", "-c", str(toy_ckpt), "-o", str(exported)])
    assert result.exit_code == 2 and "already exists" in result.output


def test_a_model_marian_cannot_hold_is_one_line(toy_cfg_checkpoint_pre_norm: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["export", "hf", "-c", str(toy_cfg_checkpoint_pre_norm), "-o", str(tmp_path / "x")]
    )
    assert result.exit_code == 2 and result.output.startswith("error: ") and "model.norm: pre" in result.output
    assert not (tmp_path / "x").exists()


@pytest.fixture
def toy_cfg_checkpoint_pre_norm(prepared_toy: Config, tmp_path: Path) -> Path:
    from helpers import write_checkpoint

    pre = dataclasses.replace(prepared_toy, model=dataclasses.replace(prepared_toy.model, norm="pre"))
    write_checkpoint(pre, tmp_path / "pre.pt", seed=1)
    return tmp_path / "pre.pt"


def compare(checkpoint: Path, out: Path, lines: list[str]) -> tuple[float, list[list[str]], list[list[str]], list]:
    """The largest logit difference (teacher-forced on tmt's translations), then tmt's and generate's outputs at
    beam 1 and 4 under matching settings, and which of tmt's beam-4 translations ended before the limit."""
    tokenizer = transformers.MarianTokenizer.from_pretrained(out)
    model = transformers.MarianMTModel.from_pretrained(out).eval()
    ours = Translator.from_checkpoints([checkpoint], "cpu", MATCHING)
    ours.show_progress = False
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    ids = [ours.encode(i, line) for i, line in enumerate(lines)]
    assert batch["input_ids"].tolist() == pad_batch(ids).tolist()  # the tokenizer alone gives tmt's ids
    plain = load_model([checkpoint], "cpu").model
    targets = [ours.bpe.encode(t)[:30] for t in ours.translate_lines(lines)]
    tgt = pad_batch([[2, *t] for t in targets])
    with torch.no_grad():
        mask = tgt.ne(0)
        theirs = model(**batch, decoder_input_ids=tgt, decoder_attention_mask=mask).logits[mask]
        diff = (plain(pad_batch(ids), tgt)[mask] - theirs).abs().max().item()
    tmt_out, hf_out, ended = [], [], []
    for beam in (1, 4):
        tmt_out.append(ours.with_decode({"beam_size": beam}).translate_lines(lines))
        with torch.no_grad():
            gen = model.generate(
                **batch,
                num_beams=beam,
                max_new_tokens=61,
                early_stopping=True,
                length_penalty=0.6,
                no_repeat_ngram_size=0,
            )
        hf_out.append(tokenizer.batch_decode(gen, skip_special_tokens=True))
        ended.append(
            [
                len(ours.bpe.encode(t)) < 60 and len(ours.bpe.encode(h)) < 60
                for t, h in zip(tmt_out[-1], hf_out[-1], strict=True)
            ]
        )
    return diff, tmt_out, hf_out, ended


@pytest.mark.slow
def test_the_toy_model_gives_tmts_logits_and_translations(
    toy_trained_checkpoint: Path, prepared_toy: Config, tmp_path: Path
) -> None:
    out, _ = export_hf([toy_trained_checkpoint], tmp_path / "hf")
    lines = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:40]
    diff, ours, theirs, ended = compare(toy_trained_checkpoint, out, lines)
    assert diff < 1e-4
    assert ours[0] == theirs[0]  # greedy: every line
    assert sum(ended[1]) >= 30 and len(set(ours[1])) > 30
    assert [o for o, e in zip(ours[1], ended[1], strict=True) if e] == [
        t for t, e in zip(theirs[1], ended[1], strict=True) if e
    ]


@pytest.mark.slow
def test_multi30k_200_sentences(multi30k_checkpoint: Path, tmp_path: Path) -> None:
    """200 test2016 sentences: logits within 1e-4; greedy equal on every line; beam 4 on every line that ends
    before the limit in both (at the limit, generate's forced EOS counts as certain, tmt's as the model says)."""
    from conftest import SHARED_MULTI30K

    out, _ = export_hf([multi30k_checkpoint], tmp_path / "hf")
    lines = (SHARED_MULTI30K / "test.en").read_text(encoding="utf-8").splitlines()[:200]
    diff, ours, theirs, ended = compare(multi30k_checkpoint, out, lines)
    assert diff < 1e-4
    assert ours[0] == theirs[0]
    assert sum(ended[1]) >= 150
    assert [o for o, e in zip(ours[1], ended[1], strict=True) if e] == [
        t for t, e in zip(theirs[1], ended[1], strict=True) if e
    ]
