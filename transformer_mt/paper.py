"""The paper's own figures: Table 2 (newstest2014) and Table 3 (model variations on newstest2013).

Vaswani et al., 2017. Every figure is copied from the paper; nothing here is
measured. `tmt report` sets a user's runs beside these rows, the configs of
``configs/table3/`` reproduce the Table 3 rows (their tests check each file
against `TABLE3`), and a run is matched to its row by its config
(`table2_row`, `table3_row`), never by its directory name.

BLEU in both tables is the paper's tokenized, case-sensitive BLEU with
compound splitting (`transformer_mt.metrics.paper_bleu`); Table 3's
perplexities are per BPE token on newstest2013, of single (not averaged)
models. Table 2's training cost is the paper's estimate of hardware FLOPs:
training time x GPUs x a sustained 9.5 TFLOPS per P100 (footnote 5), e.g.
12 hours x 8 x 9.5e12 = 3.3e18 for the base model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from transformer_mt.config import Config, apply_override


@dataclass(frozen=True)
class Table2Row:
    """One line of Table 2; None where the paper's cell is empty. FLOPs: the paper's training-cost estimate."""

    model: str
    bleu_en_de: float | None
    bleu_en_fr: float | None
    flops_en_de: float | None
    flops_en_fr: float | None
    size: str = ""  # "base" or "big" for the Transformer rows a tmt run can match; "" for the other systems
    updates: int | None = None  # training steps (section 5.2), Transformer rows only
    hours: float | None = None  # training time
    hardware: str = ""  # what it trained on


TABLE2: tuple[Table2Row, ...] = (
    Table2Row("ByteNet", 23.75, None, None, None),
    Table2Row("Deep-Att + PosUnk", None, 39.2, None, 1.0e20),
    Table2Row("GNMT + RL", 24.6, 39.92, 2.3e19, 1.4e20),
    Table2Row("ConvS2S", 25.16, 40.46, 9.6e18, 1.5e20),
    Table2Row("MoE", 26.03, 40.56, 2.0e19, 1.2e20),
    Table2Row("Deep-Att + PosUnk Ensemble", None, 40.4, None, 8.0e20),
    Table2Row("GNMT + RL Ensemble", 26.30, 41.16, 1.8e20, 1.1e21),
    Table2Row("ConvS2S Ensemble", 26.36, 41.29, 7.7e19, 1.2e21),
    # The paper gives one cost per Transformer model (one cell spanning both pairs).
    Table2Row("Transformer (base model)", 27.3, 38.1, 3.3e18, 3.3e18, "base", 100_000, 12.0, "8 × P100"),
    Table2Row("Transformer (big)", 28.4, 41.8, 2.3e19, 2.3e19, "big", 300_000, 84.0, "8 × P100"),
)

BASE_PARAMS_M = 65  # Table 3, base row: parameters x 10^6
BIG_MODEL = {"model.d_model": 1024, "model.d_ff": 4096, "model.heads": 16}


@dataclass(frozen=True)
class Table3Row:
    """One line of Table 3: what it changes from the base model, and the paper's figures for it.

    ``changes`` are dotted config keys, as ``--set`` takes them; `config`
    applies them to the defaults (the paper's base model). ``params_m`` is
    None where the paper leaves the cell empty: the base model's 65.
    """

    name: str  # configs/table3/<name>.yaml
    group: str  # "base", "A" .. "E", "big"
    changes: dict[str, Any]
    ppl: float  # perplexity (dev), per BPE token
    bleu: float  # BLEU (dev), the paper's tokenized BLEU
    params_m: int | None  # parameters x 10^6
    note: str = ""  # what the row changes that no column shows

    @property
    def params(self) -> int:
        """The paper's parameter count in millions, the base model's where the cell is empty."""
        return BASE_PARAMS_M if self.params_m is None else self.params_m

    def config(self) -> Config:
        """The paper's base model (the config defaults) with this row's changes."""
        cfg = Config()
        for key, value in self.changes.items():
            cfg = apply_override(cfg, f"{key}={value}")
        return cfg


TABLE3: tuple[Table3Row, ...] = (
    Table3Row("base", "base", {}, 4.92, 25.8, 65),
    Table3Row("a_h1", "A", {"model.heads": 1}, 5.29, 24.9, None),
    Table3Row("a_h4", "A", {"model.heads": 4}, 5.00, 25.5, None),
    Table3Row("a_h16", "A", {"model.heads": 16}, 4.91, 25.8, None),
    Table3Row("a_h32", "A", {"model.heads": 32}, 5.01, 25.4, None),
    Table3Row("b_dk16", "B", {"model.d_k": 16}, 5.16, 25.1, 58),
    Table3Row("b_dk32", "B", {"model.d_k": 32}, 5.01, 25.4, 60),
    Table3Row("c_n2", "C", {"model.encoder_layers": 2, "model.decoder_layers": 2}, 6.11, 23.7, 36),
    Table3Row("c_n4", "C", {"model.encoder_layers": 4, "model.decoder_layers": 4}, 5.19, 25.3, 50),
    Table3Row("c_n8", "C", {"model.encoder_layers": 8, "model.decoder_layers": 8}, 4.88, 25.5, 80),
    Table3Row("c_dmodel256", "C", {"model.d_model": 256}, 5.75, 24.5, 28),
    Table3Row("c_dmodel1024", "C", {"model.d_model": 1024}, 4.66, 26.0, 168),
    Table3Row("c_dff1024", "C", {"model.d_ff": 1024}, 5.12, 25.4, 53),
    Table3Row("c_dff4096", "C", {"model.d_ff": 4096}, 4.75, 26.2, 90),
    Table3Row("d_dropout0", "D", {"model.dropout": 0.0}, 5.77, 24.6, None),
    Table3Row("d_dropout0.2", "D", {"model.dropout": 0.2}, 4.95, 25.5, None),
    Table3Row("d_ls0", "D", {"train.label_smoothing": 0.0}, 4.67, 25.3, None),
    Table3Row("d_ls0.2", "D", {"train.label_smoothing": 0.2}, 5.47, 25.7, None),
    Table3Row(
        "e_learned", "E", {"model.positions": "learned"}, 4.92, 25.7, None, "positional embedding instead of sinusoids"
    ),
    Table3Row("big", "big", {**BIG_MODEL, "model.dropout": 0.3, "train.max_updates": 300_000}, 4.33, 26.4, 213),
)

# The paper's Table 3 columns: header, and how to read the value from a config.
TABLE3_COLUMNS: tuple[tuple[str, str], ...] = (
    ("N", "N"),
    ("d_model", "d_model"),
    ("d_ff", "d_ff"),
    ("h", "h"),
    ("d_k", "d_k"),
    ("d_v", "d_v"),
    ("P_drop", "P_drop"),
    ("ε_ls", "eps_ls"),
    ("train steps", "steps"),
)


def architecture(cfg: Config) -> dict[str, Any]:
    """A config's values in the paper's Table 3 columns (d_k and d_v per head, as the paper lists them)."""
    m = cfg.model
    d_v = m.d_model // m.heads
    layers = m.encoder_layers if m.encoder_layers == m.decoder_layers else f"{m.encoder_layers}+{m.decoder_layers}"
    return {
        "N": layers,
        "d_model": m.d_model,
        "d_ff": m.d_ff,
        "h": m.heads,
        "d_k": m.d_k or d_v,
        "d_v": d_v,
        "P_drop": m.dropout,
        "eps_ls": cfg.train.label_smoothing,
        "steps": cfg.train.max_updates,
    }


def _model_key(cfg: Config) -> tuple[Any, ...]:
    """What makes two models the same architecture, as Tables 2 and 3 distinguish them (d_k resolved)."""
    m = dataclasses.replace(cfg.model, d_k=cfg.model.d_k or cfg.model.d_model // cfg.model.heads)
    return (
        m.d_model, m.d_ff, m.heads, m.d_k, m.encoder_layers, m.decoder_layers, m.norm, m.share_embeddings,
        m.encoder_no_residual_layer,
    )  # fmt: skip


def _variant_key(cfg: Config) -> tuple[Any, ...]:
    """The architecture plus what Table 3 varies besides it: dropout, label smoothing, positions."""
    m = cfg.model
    regularization = (m.dropout, m.attention_dropout, m.activation_dropout, cfg.train.label_smoothing)
    return (*_model_key(cfg), *regularization, m.positions)


def pair(cfg: Config) -> str:
    """The config's language pair as the tables name it: "en-de", "en-fr"; a model of several directions lists
    them ("en-de+de-en"), which matches no row of the paper's."""
    if cfg.data.directions:
        return "+".join(cfg.data.directions)
    return f"{cfg.data.src_lang}-{cfg.data.tgt_lang}"


def table3_row(cfg: Config) -> Table3Row | None:
    """The Table 3 row whose model and regularization ``cfg`` trains (English-German only), or None.

    Training length is not compared: a shorter run of a row is still that
    row, and the report shows its updates beside the paper's steps.
    """
    if pair(cfg) != "en-de":
        return None
    key = _variant_key(cfg)
    return next((row for row in TABLE3 if _variant_key(row.config()) == key), None)


def table2_row(cfg: Config) -> Table2Row | None:
    """The Transformer row of Table 2 (base or big) whose model ``cfg`` trains on en-de or en-fr, or None.

    The big en-fr model used P_drop 0.1 instead of 0.3 (section 6.1); the
    rest is Table 3's base and big rows.
    """
    big = next(r for r in TABLE3 if r.name == "big").config()
    if pair(cfg) == "en-fr":
        big = dataclasses.replace(big, model=dataclasses.replace(big.model, dropout=0.1))
    elif pair(cfg) != "en-de":
        return None
    key = _variant_key(cfg)
    size = next((name for name, c in (("base", Config()), ("big", big)) if _variant_key(c) == key), None)
    return next((row for row in TABLE2 if size and row.size == size), None)
