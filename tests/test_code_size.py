"""The package stays easy to change: the training loop in one short module and no function too long to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_mt"
FUNCTION_LINES_MAX = 60  # from the def line to the last, decorators aside
TRAINER_LINES_MAX = 300  # train/trainer.py is the loop; its parts live in modules named for them (docs/architecture.md)


def test_no_function_in_the_package_is_longer_than_60_lines() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], "split these into functions named for what they do"


def test_the_trainer_is_the_loop() -> None:
    lines = len((PACKAGE / "train" / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert lines <= TRAINER_LINES_MAX, f"train/trainer.py has {lines} lines: move a part to a module of its own"
