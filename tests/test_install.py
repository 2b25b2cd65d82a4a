"""A non-editable install, used from a directory outside the checkout: tmt init -> train -> evaluate test.

The wheel is built from a copy of the source tree and installed into a
directory of its own, put first on PYTHONPATH; the commands run in a temporary
directory that holds only the user's corpus. Whatever tmt needs at run time
(the shipped configs, the demo page) must therefore come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_mt.data.synthetic import write_corpus

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "runs", "prepared", "toy", "quickstart", "data", "build",
                                    "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache")  # fmt: skip


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_wheel_install_runs_init_train_evaluate_outside_the_checkout(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=NOT_SOURCE)
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", str(source), "-w", str(wheels)], tmp_path, dict(os.environ))
    (wheel,) = wheels.glob("transformer_mt-*.whl")
    _run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], tmp_path, dict(os.environ))

    work = tmp_path / "project"  # the user's directory: their corpus and nothing of tmt's
    write_corpus(work / "corpus", pairs=600, valid=20, test=20, seed=3)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "2"}
    tmt = [sys.executable, "-m", "transformer_mt"]
    where = _run([sys.executable, "-c", "import transformer_mt; print(transformer_mt.__file__)"], work, env)
    assert where.strip().startswith(str(site)), where  # the wheel's code, not the checkout's

    said = _run([*tmt, "init", "--train", "corpus/train", "--valid", "corpus/valid", "--test", "corpus/test",
                 "--src", "en", "--tgt", "de", "-o", "mine.yaml"], work, env)  # fmt: skip
    assert "wrote mine.yaml" in said and "next: tmt train mine.yaml" in said
    small = ["--set", "train.max_updates=12", "--set", "train.validate_every=6", "--set", "bpe.vocab_size=300",
             "--set", "model.d_model=64", "--set", "model.d_ff=128", "--set", "train.valid_bleu_sentences=0"]  # fmt: skip
    _run([*tmt, "train", "mine.yaml", *small], work, env)
    _run([*tmt, "evaluate", "test", "-c", "runs/mine", "--beam", "1", "--set", "decode.max_len_b=5"], work, env)
    scores = json.loads(next((work / "runs" / "mine").glob("eval_*/scores.json")).read_text())
    assert scores["sacrebleu"]["signature"].startswith("nrefs:1")
    assert sorted(p.name for p in work.iterdir()) == ["corpus", "mine.yaml", "prepared", "runs"]
