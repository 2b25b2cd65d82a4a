"""`tmt backtranslate` and `tmt distill`: a corpus of a model's translations, resumable after a kill.

The toy checkpoint translates en -> de: as a "teacher" it distils English
text, as a "reverse model" it back-translates text named in neither
language. A real process is killed (SIGKILL, no chance to clean up) after
its first windows are saved; the second call must translate only the rest
and write exactly the corpus of an uninterrupted run, sampled lines included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformer_mt.config import Config
from transformer_mt.data.clean import InputError
from transformer_mt.decode.translate import Translator
from transformer_mt.synthetic_corpus import CorpusError, make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text(prepared_toy: Config) -> list[str]:
    return Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:40]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_the_corpus_pairs_each_line_with_its_translation(toy_ckpt: Path, text: list[str], tmp_path: Path) -> None:
    src, tgt = make_corpus([toy_ckpt], _write(tmp_path / "train.en", text), tmp_path / "kd", window_lines=15)
    assert (src.name, tgt.name) == ("kd.en", "kd.de")
    t = Translator.from_checkpoints([toy_ckpt], device="cpu")
    t.show_progress = False
    assert src.read_text(encoding="utf-8").splitlines() == text
    assert tgt.read_text(encoding="utf-8").splitlines() == t.translate_lines(text)
    assert not (tmp_path / "kd.parts").exists()


@pytest.mark.slow
def test_a_killed_backtranslation_resumes_at_its_window_and_equals_an_uninterrupted_run(
    toy_ckpt: Path, text: list[str], tmp_path: Path
) -> None:
    mono = _write(tmp_path / "mono.txt", text * 15)  # 600 lines, 60 windows
    sampled = ["--sample", "topk:5", "--seed", "3"]
    expected = make_corpus(
        [toy_ckpt], mono, tmp_path / "whole", ["decode.sampling=topk:5", "decode.seed=3", "decode.beam_size=1"],
        window_lines=10,
    )[1].read_text(encoding="utf-8")  # fmt: skip
    command = [sys.executable, "-m", "transformer_mt", "backtranslate", "-c", str(toy_ckpt), "-i", str(mono),
               "-o", str(tmp_path / "bt"), "--window-lines", "10", *sampled]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    parts = tmp_path / "bt.parts"
    deadline = time.monotonic() + 120
    while len(list(parts.glob("*.de"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    done = len(list(parts.glob("*.de")))
    assert 3 <= done < 60 and not (tmp_path / "bt.de").exists()
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {done * 10} of 600 lines were translated already" in again.stderr
    assert (tmp_path / "bt.de").read_text(encoding="utf-8") == expected
    assert (tmp_path / "bt.en").read_text(encoding="utf-8") == mono.read_text(encoding="utf-8")
    assert not parts.exists()


def test_a_restart_with_another_plan_is_refused_and_force_starts_over(
    toy_ckpt: Path, text: list[str], tmp_path: Path
) -> None:
    mono = _write(tmp_path / "mono.txt", text)
    parts = tmp_path / "bt.parts"
    parts.mkdir()
    (parts / "plan.json").write_text('{"input": "other.txt"}\n', encoding="utf-8")
    (parts / "000000.de").write_text("stale\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"another input, input_sha256, lines, .*pass --force to start over"):
        make_corpus([toy_ckpt], mono, tmp_path / "bt", window_lines=10)
    src, tgt = make_corpus([toy_ckpt], mono, tmp_path / "bt", window_lines=10, force=True)
    assert "stale" not in tgt.read_text(encoding="utf-8").splitlines()
    with pytest.raises(CorpusError, match="bt.en exists already; pass --force"):
        make_corpus([toy_ckpt], mono, tmp_path / "bt", window_lines=10)


@pytest.mark.parametrize(
    ("name", "content", "error", "says"),
    [
        ("mono.txt", b"A dog runs.\n\nA cat sleeps.\n", CorpusError, r"mono.txt, line 2: an empty line"),
        ("mono.txt", b"A dog runs.\n \t\n", CorpusError, r"mono.txt, line 2: an empty line"),
        ("mono.txt", b"A dog runs.\nA \xff cat.\n", InputError, r"mono.txt, line 2"),
        ("mono.txt", b"", CorpusError, r"mono.txt: no lines to translate"),
        ("mono.de", b"Ein Hund rennt.\n", CorpusError, r"mono.de: the file is named for 'de', but the model translates en-de"),
        ("mono.txt", "Ένας σκύλος τρέχει στο πάρκο.\n".encode() * 5, CorpusError, r"mono.txt: .* are not in the model's vocabulary"),
    ],
)  # fmt: skip
def test_input_that_would_make_a_wrong_corpus_is_refused_naming_file_and_line(
    toy_ckpt: Path, tmp_path: Path, name: str, content: bytes, error: type, says: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(error, match=says):
        make_corpus([toy_ckpt], path, tmp_path / "bt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_nbest_or_alignments_are_no_corpus(toy_ckpt: Path, text: list[str], tmp_path: Path) -> None:
    mono = _write(tmp_path / "mono.txt", text)
    with pytest.raises(CorpusError, match="one plain translation per line"):
        make_corpus([toy_ckpt], mono, tmp_path / "bt", ["decode.alignment=hard"])


def test_the_command_line_is_one_line_per_refusal(toy_ckpt: Path, tmp_path: Path) -> None:
    path = tmp_path / "mono.txt"
    path.write_text("A dog.\n\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "distill", "-c", str(toy_ckpt), "-i", str(path), "-o",
         str(tmp_path / "kd")], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {path}, line 2: an empty line; a corpus pairs sentences, one per line: remove the empty lines "
        f"first (grep -v '^[[:space:]]*$' {path} > cleaned)"
    ], done.stderr
