"""Builders shared by the tests: a run's config, its metric records, a tiny random-weight Transformer, a checkpoint
file's stored dict as it is on disk, a random-weight checkpoint on a prepared corpus, and a fake decoder whose
next-token probabilities come from a table; for `tmt serve`, a real server process, the translations it must answer and a
headless browser.

Fixtures live in conftest.py (``prepared_toy``, ``one_thread``, ...); these are plain functions and classes, imported
as ``from helpers import run_config, metric_records`` (pytest puts this directory on the import path). Test modules
import their shared builders from here, never from one another.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from transformer_mt.config import Config, ModelConfig, load_config
from transformer_mt.data.bpe import BOS, EOS, PAD, load_bpe
from transformer_mt.decode.search import Hypothesis
from transformer_mt.decode.settings import length_penalty
from transformer_mt.decode.translate import Translator
from transformer_mt.model.transformer import Transformer
from transformer_mt.run_names import METRICS_NAME


def run_config(cfg: Config, save_dir: str | Path, **train: Any) -> Config:
    """``cfg`` training into ``save_dir`` on one thread (tiny matrices: two threads spin-waiting against other
    processes on a busy 2-core machine are about 5x slower), with ``train`` keys set over it."""
    train = {"num_threads": 1, **train}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_dir=str(save_dir), **train))


def assert_resume_is_bit_exact(cfg: Config, root: Path, updates: int = 12) -> Path:
    """Train ``cfg`` for ``updates`` at once (in root/whole) and cut in two halves (root/cut, resumed); assert both
    end with the same weights, bit for bit. Returns the uninterrupted run's directory."""
    from transformer_mt.train.trainer import train_model

    train_model(run_config(cfg, root / "whole", max_updates=updates))
    cut = run_config(cfg, root / "cut", max_updates=updates // 2)
    train_model(cut)
    train_model(dataclasses.replace(cut, train=dataclasses.replace(cut.train, max_updates=updates)))
    name = f"checkpoint_u{updates:07d}.pt"
    a = torch.load(root / "whole" / name, weights_only=True)["model"]
    b = torch.load(root / "cut" / name, weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return root / "whole"


def metric_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics.jsonl, in file order, each line parsed strictly: a test must fail on a
    malformed line, which `transformer_mt.runs.read_metrics` (for users' runs, crashed ones included) passes over."""
    return [json.loads(line) for line in (Path(run_dir) / METRICS_NAME).read_text(encoding="utf-8").splitlines()]


def tiny_transformer(embed_scale: float, eos_scale: float = 1.0) -> Transformer:
    """A 2+2-layer d_model-32 Transformer over 24 tokens with seed-0 weights, in eval mode, for the search tests.

    The embeddings (tied with the output layer) are scaled by ``embed_scale``: larger gives sharper distributions,
    so that beam hypotheses differ and end; smaller, flatter ones, so that samples vary. ``eos_scale`` scales the
    end-of-sentence row once more (below 1: hypotheses run longer before they end).
    """
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
    model = Transformer(cfg, vocab_size=24).eval()
    with torch.no_grad():
        model.embed.weight.mul_(embed_scale)
        model.embed.weight[EOS].mul_(eos_scale)
    return model


def load_state(path: str | Path) -> dict[str, Any]:
    """The dict a checkpoint file stores, read as torch reads it (safely), no entry checked: what tests inspect to
    see the format on disk, independent of `transformer_mt.checkpoint`'s reader."""
    return torch.load(path, map_location="cpu", weights_only=True)


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Store ``state`` as a checkpoint file would, unchecked: how tests craft old, damaged or foreign checkpoints,
    which `transformer_mt.checkpoint.write_checkpoint` (a valid `Checkpoint` only) never writes."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def write_checkpoint(
    cfg: Config, path: Path, seed: int, with_spm: bool = True, silent: bool = False
) -> dict[str, torch.Tensor]:
    """A random-weight checkpoint; ``silent``: one whose every translation is empty (EOS first, always)."""
    spm_path = Path(cfg.data.dir) / "spm.model"
    vocab = load_bpe(spm_path).get_piece_size()
    torch.manual_seed(seed)
    model = Transformer(cfg.model, vocab)
    with torch.no_grad():
        model.embed.weight.mul_(8.0)  # peaky distributions: outputs differ by sentence and end before max length
        if silent:  # the decoder's last LayerNorm outputs a constant that points at EOS, the longest embedding
            model.embed.weight[EOS] *= 2 * model.embed.weight.norm(dim=1).max() / model.embed.weight[EOS].norm()
            last = model.decoder_norm or model.decoder[-1].norm3  # the stack's last LayerNorm (pre- or post-norm)
            last.weight.zero_()
            last.bias.copy_(model.embed.weight[EOS])
    state = {"model": model.state_dict(), "config": cfg.to_dict(), "update": seed}
    if with_spm:
        state["spm_model"] = torch.from_numpy(np.frombuffer(spm_path.read_bytes(), dtype=np.uint8).copy())
    save_state(path, state)
    return model.state_dict()


# --- a fake decoder for the search tests: next-token probabilities looked up in a table ---------------------------


A, B_ = 4, 5  # the two "word" tokens of the fake vocabulary
V = 6  # PAD, UNK, BOS, EOS, A, B_

Table = Callable[[int, tuple[int, ...]], list[float]]  # (sentence, prefix) -> probabilities over V


@dataclass
class FakeEnc:
    sent: torch.Tensor  # (B,) sentence id of each row

    def reorder(self, index: torch.Tensor) -> FakeEnc:
        return FakeEnc(self.sent.index_select(0, index))


@dataclass
class FakeCache:
    sent: torch.Tensor  # (n,) the "cross-attention state", one row per sentence: which sentence it is
    prefix: torch.Tensor  # (n*k, T) the "self-attention state": target tokens fed so far, one row per beam
    beams: int

    @property
    def length(self) -> int:
        return self.prefix.shape[1]

    def reorder(
        self, index: torch.Tensor, sentences: torch.Tensor | None = None, beams: int | None = None
    ) -> FakeCache:
        kept = torch.arange(self.sent.shape[0]) if sentences is None else sentences
        wider = self.beams if beams is None else beams
        assert torch.equal(index // self.beams, kept.repeat_interleave(wider)), "a beam left its sentence"
        self.beams = wider
        self.prefix = self.prefix.index_select(0, index)
        if sentences is not None:
            self.sent = self.sent.index_select(0, sentences)
        return self


class FakeModel:
    """A decoder whose probabilities are looked up in ``table(sentence, prefix)``; the sentence id is src[:, 0]."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.decode_calls = 0

    def encode(self, src: torch.Tensor) -> FakeEnc:
        return FakeEnc(src[:, 0].clone())

    def init_cache(self, enc: FakeEnc, beams: int = 1, capacity: int = 16) -> FakeCache:
        return FakeCache(enc.sent.clone(), torch.zeros(enc.sent.shape[0] * beams, 0, dtype=torch.long), beams)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x  # decode_features looked the log-probabilities up already

    def decode_features(self, tgt_in: torch.Tensor, enc: FakeEnc, cache: FakeCache | None = None) -> torch.Tensor:
        return self.decode(tgt_in, enc, cache)

    def decode(self, tgt_in: torch.Tensor, enc: FakeEnc, cache: FakeCache | None = None) -> torch.Tensor:
        self.decode_calls += 1
        if cache is None:
            sent, full = enc.sent, tgt_in
        else:
            # as Transformer.decode: with a cache the encoder output is not read (the search no longer reorders it)
            cache.prefix = torch.cat([cache.prefix, tgt_in], dim=1)
            sent, full = cache.sent.repeat_interleave(cache.beams), cache.prefix
        assert bool((full[:, 0] == BOS).all())
        out = torch.empty(full.shape[0], tgt_in.shape[1], V)
        T = full.shape[1]
        for r in range(full.shape[0]):
            for j in range(tgt_in.shape[1]):
                prefix = tuple(full[r, 1 : T - tgt_in.shape[1] + j + 1].tolist())
                probs = torch.tensor(self.table(int(sent[r]), prefix), dtype=torch.float64)
                out[r, j] = probs.log().float()  # log(0) = -inf: impossible tokens
        return out


def probs(eos: float = 0.0, a: float = 0.0, b: float = 0.0, unk: float = 0.0) -> list[float]:
    return [0.0, unk, 0.0, eos, a, b]


def fake_src(sentence_ids: list[int], src_len: int) -> torch.Tensor:
    rows = [[s + 10] + [7] * (src_len - 1) + [EOS] for s in sentence_ids]
    return torch.tensor(rows)


def hyp_tuples(hyps: list[Hypothesis]) -> list[tuple[int, ...]]:
    return [tuple(h.tokens) for h in hyps]


def hand_table(s: int, prefix: tuple[int, ...]) -> list[float]:
    """P(a)=.6, P(b)=.4; after a: EOS .4 a .5 b .1; after b: EOS .8 a .1 b .1; after aa: EOS 1; otherwise EOS .5."""
    return {
        (): probs(a=0.6, b=0.4),
        (A,): probs(eos=0.4, a=0.5, b=0.1),
        (B_,): probs(eos=0.8, a=0.1, b=0.1),
        (A, A): probs(eos=1.0),
    }.get(prefix, probs(eos=0.5, a=0.25, b=0.25))


def never_ending(s: int, prefix: tuple[int, ...]) -> list[float]:
    return probs(eos=1e-6, a=0.6, b=0.4 - 1e-6)


def random_table(seed: int, unk: bool = False, eos_bias: float = 0.0) -> Table:
    def table(s: int, prefix: tuple[int, ...]) -> list[float]:
        rng = random.Random(f"{seed}/{s}/{prefix}")
        w = [rng.random() + 0.05 for _ in range(4)]
        w[0] += eos_bias
        return probs(eos=w[0], a=w[1], b=w[2], unk=w[3] if unk else 0.0)

    return table


def exhaustive(table: Table, s: int, max_len: int, alpha: float, form: str) -> list[tuple[float, tuple[int, ...]]]:
    """Every hypothesis of up to max_len words (a, b) then EOS, with its normalized score, best first."""
    out = []
    for n in range(max_len + 1):
        for words in itertools.product([A, B_], repeat=n):
            lp = 0.0
            for t in range(n + 1):
                p = table(s, words[:t])
                tok = words[t] if t < n else EOS
                lp += math.log(p[tok] / sum(p))
            out.append((lp / length_penalty(float(n + 1), alpha, form), words))  # type: ignore[arg-type]
    return sorted(out, key=lambda x: -x[0])


def reference_beam(table: Table, s: int, k: int, alpha: float, max_len: int) -> list[Hypothesis]:
    """The documented search for one sentence, written plainly with Python lists (gnmt penalty)."""

    def lp(n: float) -> float:
        return ((5 + n) / 6) ** alpha

    live: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    finished: list[Hypothesis] = []
    for step in range(max_len + 1):
        cands = []
        for score, prefix in live:
            p = table(s, prefix)
            for tok in range(len(p)):
                if tok in (PAD, BOS) or p[tok] == 0 or (step == max_len and tok != EOS):
                    continue
                cands.append((score + math.log(p[tok] / sum(p)), prefix, tok))
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * k]
        for score, prefix, tok in cands[:k]:
            if tok == EOS:
                finished.append(Hypothesis(list(prefix), score / lp(step + 1), score))
        finished = sorted(finished, key=lambda h: -h.score)[:k]
        live = [(score, prefix + (tok,)) for score, prefix, tok in cands if tok != EOS][:k]
        if not live:
            break
        bound = live[0][0] / max(lp(step + 2), lp(max_len + 1))
        if len(finished) == k and (k == 1 or bound < finished[-1].score):
            break
    return finished


def real_src(lengths: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths) + 1), PAD)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, 24, (n,), generator=g)
        src[i, n] = EOS
    return src


# --- `tmt` in a new process and its one-line user error; a config for `tmt prepare` -------------------------------


def tmt(*args: str, close_stdin: bool = False, **kwargs: object) -> subprocess.CompletedProcess:
    """``tmt ARGS`` in a new process, stdin empty (or closed, as `<&-` leaves it): what a user sees."""
    return subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args],
        stdin=subprocess.DEVNULL,
        preexec_fn=(lambda: os.close(0)) if close_stdin else None,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, and stderr ends with one line `error: ...` holding every fragment (after any progress); returns it."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], done.stderr
    for fragment in fragments:
        assert fragment in lines[-1]
    return lines[-1]


def prepare_config(root: Path, *extra: str) -> Config:
    """A config for `tmt prepare` of the corpus under ``root``/c (train, valid, test) into ``root``/out, BPE 120."""
    return load_config(
        None,
        [
            f"data.train={root}/c/train",
            f"data.valid={root}/c/valid",
            f"data.test={root}/c/test",
            f"data.dir={root}/out",
            "data.workers=1",
            "data.max_len=30",
            "bpe.vocab_size=120",
            *extra,
        ],
    )


# ---------------------------------------------------------------- tmt serve: a real process, a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def quiet_translator(checkpoint: Path) -> Translator:
    """``checkpoint``'s translator on the CPU, without a progress bar: what a test compares a server's answers with."""
    t = Translator.from_checkpoints([checkpoint], device="cpu")
    t.show_progress = False
    return t


def serve_alone(checkpoint: Path, lines: list[str]) -> dict[str, str]:
    """`tmt translate`'s output for each line, translated alone: what a server must answer for it."""
    t = quiet_translator(checkpoint)
    return {line: t.translate_lines([line])[0] for line in lines}


def request_json(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON answer) of a GET (``body`` None) or a JSON POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def start_server(checkpoint: Path, port: int, *args: str) -> subprocess.Popen:
    """A real `tmt serve` process of ``checkpoint`` on ``port`` (one thread), once its /health answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", "serve", "-c", str(checkpoint), "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tmt serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if request_json(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("tmt serve did not answer /health within 120 s")


def browser() -> Any:
    """Headless Chromium through its chromedriver (Selenium); skipped where they are missing, failed under CI
    (``CI=true``), which must run the browser tests (`.ci/run` installs both)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the browser test: .ci/run installs chromium and chromium-driver")
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@contextmanager
def browser_and_server(checkpoint: Path, port: int, *args: str) -> Iterator[Any]:
    """A browser and a real `tmt serve` (`start_server`) on ``port``: the browser first, so that a machine without
    Chromium skips before a server is started; the driver, then a server that stops cleanly, no traceback."""
    driver = browser()
    try:
        proc = start_server(checkpoint, port, *args)
    except BaseException:
        driver.quit()
        raise
    try:
        yield driver
    finally:
        driver.quit()
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "Traceback" not in output, output
