"""`tmt report`: the paper's Table 2 and Table 3 with a user's runs beside them, as Markdown (and a PNG).

Every figure of both tables is printed on a line marked ``paper``; under it
come the runs that match the row (`transformer_mt.paper.table2_row`,
`table3_row`: by model and regularization, not by name), or a line saying
"not run". Runs that match no row get a table of their own, first. Everything is
read from the run directories (`transformer_mt.runs`).

The two BLEU figures of `tmt evaluate` are both shown, each labelled: the
paper's metric (tokenized, compound-split BLEU, what both tables print) and
sacreBLEU. Training cost differs in kind between the two sides, and says
so: the paper's is hardware time (hours x GPUs x sustained FLOP/s), tmt's is
model FLOPs (updates x target tokens per update x FLOPs per target token).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_mt.config import Config
from transformer_mt.files import atomic_write_text
from transformer_mt.paper import TABLE2, TABLE3, TABLE3_COLUMNS, Table2Row, Table3Row, architecture, pair
from transformer_mt.paper import table2_row as match_table2
from transformer_mt.paper import table3_row as match_table3
from transformer_mt.runs import Run

TABLE2_TESTSET = "newstest2014"
TABLE3_TESTSET = "newstest2013"
NOT_RUN = "not run"

NOTES = """\
How to read these tables:

- **paper BLEU** is the paper's metric: tokenized, case-sensitive BLEU after Moses tokenization, with compound
  splitting for German (tensor2tensor's `get_ende_bleu.sh`). **sacreBLEU** is 13a, cased, on detokenized output
  (its signature is in each run's `scores.json`); it runs 0.7-1.5 points lower on newstest2014 en-de.
- **Training cost**: the paper's FLOPs are its estimate of hardware work, training time x GPUs x 9.5 TFLOPS
  sustained per P100. tmt's are model FLOPs: updates x target tokens per update x training FLOPs per target token
  (forward and backward, `flops_per_token`), for the whole run. Wall time and device are the run's own.
- **PPL (dev)** is perplexity per BPE token on newstest2013 at the run's last validation (the paper: per wordpiece,
  single models, no checkpoint averaging). Table 2 scores newstest2014, Table 3 newstest2013.
- Parameters: the paper's column in millions; tmt's count of the run's model (the tied embedding once).
- An empty cell on a paper line of Table 3 is the base model's value, as in the paper.
"""


# ---------------------------------------------------------------- formatting


def _num(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _paper(x: float | None) -> str:
    """A paper figure as the paper prints it (27.3, 23.75), not padded to a fixed number of digits."""
    return "" if x is None else f"{x:g}"


def _sci(x: float | None) -> str:
    """3.3e18 as the paper writes it: 3.3·10^18."""
    if x is None:
        return ""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}·10^{int(exponent)}"


def _duration(hours: float | None) -> str:
    if hours is None:
        return ""
    if hours < 1:
        return f"{hours * 60:.1f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def _steps(updates: int | None) -> str:
    return "" if updates is None else (f"{updates // 1000}K" if updates % 1000 == 0 and updates else f"{updates:,}")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


# ---------------------------------------------------------------- what a run contributes


def _bleu(run: Run, testset: str) -> tuple[str, str]:
    """(paper BLEU, sacreBLEU) of ``run`` on ``testset``, or a note saying it was not evaluated."""
    scores = run.scores.get(testset)
    if scores is None:
        return f"not evaluated on {testset}", ""
    return _num(scores["paper_bleu"]["score"]), _num(scores["sacrebleu"]["score"])


def _device(run: Run) -> str:
    start = run.start or {}
    if "device" not in start:
        return ""
    n = start.get("world_size", 1)
    return f"{n} × {start['device']}" if n > 1 else start["device"]


def _params(run: Run) -> str:
    n = (run.start or {}).get("parameters")
    return "" if n is None else f"{n / 1e6:.1f}"


def _cost(run: Run) -> tuple[str, str, str]:
    """(model FLOPs, wall time, device) of a run."""
    minutes = run.minutes
    flops = run.training_flops
    return (
        _sci(flops) + " (model)" if flops else "",
        _duration(None if minutes is None else minutes / 60),
        _device(run),
    )


def _label(run: Run) -> str:
    return f"tmt: `{run.path}`"


# ---------------------------------------------------------------- Table 2

TABLE2_HEADER = (
    "model", "source", "BLEU EN-DE (paper BLEU)", "BLEU EN-FR (paper BLEU)", "sacreBLEU",
    "training cost EN-DE (FLOPs)", "training cost EN-FR (FLOPs)", "updates", "wall time", "device",
)  # fmt: skip


def _table2_lines(row: Table2Row, runs: list[Run]) -> list[list[str]]:
    paper = [
        row.model, "paper", _paper(row.bleu_en_de), _paper(row.bleu_en_fr), "", _sci(row.flops_en_de),
        _sci(row.flops_en_fr), _steps(row.updates), _duration(row.hours), row.hardware,
    ]  # fmt: skip
    lines = [paper]
    for run in runs:
        bleu, sacre = _bleu(run, TABLE2_TESTSET)
        flops, wall, device = _cost(run)
        de = pair(run.cfg) == "en-de"
        lines.append([
            row.model, _label(run), bleu if de else "", "" if de else bleu, sacre, flops if de else "",
            "" if de else flops, f"{run.updates:,}", wall, device,
        ])  # fmt: skip
    if row.size and not runs:
        lines.append([row.model, "tmt", NOT_RUN, *[""] * (len(TABLE2_HEADER) - 3)])
    return lines


# ---------------------------------------------------------------- Table 3

TABLE3_HEADER = (
    "row", *(name for name, _ in TABLE3_COLUMNS), "source", "PPL (dev)", "BLEU (dev, paper BLEU)",
    "sacreBLEU (dev)", "params ×10⁶", "training cost (FLOPs)", "wall time", "device",
)  # fmt: skip


def _row_label(row: Table3Row) -> str:
    group = row.group if row.group in ("base", "big") else f"({row.group})"
    return f"{group} {row.note}".strip()


def _paper_columns(row: Table3Row) -> list[str]:
    """The row's architecture as the paper prints it: every value for base, only what changes elsewhere."""
    values, base = architecture(row.config()), architecture(Config())
    cells = []
    for _, key in TABLE3_COLUMNS:
        if row.group != "base" and values[key] == base[key]:
            cells.append("")
        else:
            cells.append(_steps(values[key]) if key == "steps" else str(values[key]))
    return cells


def _table3_lines(row: Table3Row, runs: list[Run]) -> list[list[str]]:
    label, blank = _row_label(row), [""] * (len(TABLE3_COLUMNS) - 1)
    params = _paper(row.params_m)  # empty where the paper's is: the base model's
    lines = [[label, *_paper_columns(row), "paper", _num(row.ppl), _paper(row.bleu), "", params, "", "", ""]]
    for run in runs:
        bleu, sacre = _bleu(run, TABLE3_TESTSET)
        flops, wall, device = _cost(run)
        steps = f"{run.updates:,}"
        lines.append(
            [label, *blank, steps, _label(run), _num(run.dev_ppl), bleu, sacre, _params(run), flops, wall, device]
        )
    if not runs:
        lines.append([label, *blank, "", "tmt", NOT_RUN, *[""] * 6])
    return lines


# ---------------------------------------------------------------- runs of no row

OTHER_HEADER = (
    "run", "pair", "N", "d_model", "d_ff", "h", "updates", "PPL (dev)", "test set", "paper BLEU", "sacreBLEU",
    "params ×10⁶", "training cost (FLOPs)", "wall time", "device",
)  # fmt: skip


def _other_lines(run: Run) -> list[list[str]]:
    """One line per test set the run was evaluated on (one saying "not evaluated" if none)."""
    a = architecture(run.cfg)
    head = [_label(run), pair(run.cfg), str(a["N"]), str(a["d_model"]), str(a["d_ff"]), str(a["h"])]
    head += [f"{run.updates:,}", _num(run.dev_ppl)]
    tail = [_params(run), *_cost(run)]
    if not run.scores:
        return [[*head, "not evaluated", "", "", *tail]]
    return [[*head, name, *_bleu(run, name), *tail] for name in sorted(run.scores)]


DIRECTIONS_HEADER = ("run", "direction", "updates", "PPL (dev)", "valid sacreBLEU")


def _direction_lines(run: Run) -> list[list[str]]:
    """A run of several directions: each direction's figures at its last validation that holds them."""
    last = next((r for r in reversed(run.kind("valid")) if isinstance(r.get("directions"), dict)), None)
    if last is None:
        return []
    lines = []
    for name, d in last["directions"].items():
        d = d if isinstance(d, dict) else {}
        number = {k: v for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        lines.append(
            [_label(run), name, f"{last.get('update', 0):,}", _num(number.get("ppl")), _num(number.get("bleu"))]
        )
    return lines


# ---------------------------------------------------------------- the report


def report_markdown(runs: Sequence[Run]) -> str:
    """The whole report: notes, Table 2, Table 3 and the runs of no row, each run on the row it matches."""
    table2: dict[str, list[Run]] = {row.model: [] for row in TABLE2}
    table3: dict[str, list[Run]] = {row.name: [] for row in TABLE3}
    other: list[Run] = []
    for run in runs:
        row2, row3 = match_table2(run.cfg), match_table3(run.cfg)
        if row2 is not None:
            table2[row2.model].append(run)
        if row3 is not None:
            table3[row3.name].append(run)
        if row2 is None and row3 is None:
            other.append(run)
    listed = ", ".join(f"`{run.path}`" for run in runs) or "none"
    lines = ["# tmt report: the paper's tables beside your runs", "", f"Runs: {listed}.", "", NOTES]
    if other:  # a run on one's own corpus first, before some 50 rows of the paper's
        lines += ["## Runs that are no row of the paper's tables", ""]
        lines += _table(OTHER_HEADER, [line for run in other for line in _other_lines(run)]) + [""]
    directions = [line for run in runs for line in _direction_lines(run)]
    if directions:
        lines += ["## Each direction of the runs of several languages", ""]
        lines += _table(DIRECTIONS_HEADER, directions) + [""]
    lines += ["## Table 2: newstest2014, BLEU and training cost", ""]
    lines += _table(TABLE2_HEADER, [line for row in TABLE2 for line in _table2_lines(row, table2[row.model])])
    lines += ["", "## Table 3: variations of the base model, newstest2013 (dev)", ""]
    lines += _table(TABLE3_HEADER, [line for row in TABLE3 for line in _table3_lines(row, table3[row.name])])
    return "\n".join(lines) + "\n"


def table3_points(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The chart's bars: first each run of no paper row (its first test set's sacreBLEU and its dev PPL, no paper
    bar), then per Table 3 row its label, the paper's PPL and BLEU and those of the first matching run (None if
    none). What `transformer_mt.plots.report_figure` draws beside the tables.
    """
    points = [_own_point(run) for run in runs if match_table2(run.cfg) is None and match_table3(run.cfg) is None]
    for row in TABLE3:
        mine = next((run for run in runs if match_table3(run.cfg) is row), None)
        scores = None if mine is None else mine.scores.get(TABLE3_TESTSET)
        points.append({
            "label": row.name, "paper_ppl": row.ppl, "paper_bleu": row.bleu,
            "ppl": None if mine is None else mine.dev_ppl,
            "bleu": None if scores is None else scores["paper_bleu"]["score"],
        })  # fmt: skip
    return points


def _own_point(run: Run) -> dict[str, Any]:
    """A run on one's own corpus: sacreBLEU of its first evaluated test set (by name), its dev PPL."""
    name = min(run.scores, default=None)
    label = f"{Path(run.path).name}" + (f" ({name}, sacreBLEU)" if name else " (not evaluated)")
    bleu = None if name is None else run.scores[name]["sacrebleu"]["score"]
    return {"label": label, "paper_ppl": None, "paper_bleu": None, "ppl": run.dev_ppl, "bleu": bleu}


def write_report(runs: Sequence[Run], out: Path) -> str:
    """Write the Markdown report to ``out`` (its directory created; whole or not at all); returns its text."""
    text = report_markdown(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return text
