"""Scores: sacreBLEU as the library computes it, the paper's compound-split BLEU by hand, test sets offline."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
from helpers import save_state
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import Config
from transformer_mt.errors import UserError
from transformer_mt.evaluate import evaluate_checkpoint
from transformer_mt.metrics import EvaluateError, compound_split, format_scores, moses_tokenize, read_lines, score_files

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "wmt14_en_de"  # beside the repository

HYPS = [
    "Die Fußgänger-Ampel ist alt.",
    "Hallo, Welt!",
    "Am Dienstag wurde die neue B 33-Fußgängerampel in Betrieb genommen.",
]
REFS = [
    "Die Fußgänger-Ampel ist neu.",
    "Hallo, Welt!",
    "Am Dienstag ist in Gutach die neue B 33-Fußgängerampel in Betrieb genommen worden.",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_compound_split_is_the_perl_regex() -> None:
    assert compound_split("Fußgänger-Ampel") == "Fußgänger ##AT##-##AT## Ampel"
    # perl's s///g scans left to right without overlap: the 'b' consumed by the first match cannot start another.
    assert compound_split("a-b-c d-e") == "a ##AT##-##AT## b-c d ##AT##-##AT## e"
    assert compound_split("- x -y z- x - y") == "- x -y z- x - y"


def test_moses_tokenization() -> None:
    assert moses_tokenize(["Die Fußgänger-Ampel ist neu.", "Hallo, Welt!", "A & B"], "de") == [
        "Die Fußgänger-Ampel ist neu .",
        "Hallo , Welt !",
        "A &amp; B",
    ]
    assert moses_tokenize(["„Ja“, sagte er…"], "de") == ["„ Ja &quot; , sagte er ..."]  # unicode punctuation replaced


def test_paper_bleu_hand_counted(tmp_path: Path) -> None:
    """Two sentences, counted by hand after tokenization and compound splitting:

    hyp 1  Die Fußgänger ##AT##-##AT## Ampel ist alt .   (7 tokens)
    ref 1  Die Fußgänger ##AT##-##AT## Ampel ist neu .   (7 tokens)
           matches 1-gram 6/7, 2-gram 4/6, 3-gram 3/5, 4-gram 2/4
    hyp 2 = ref 2 = Hallo , Welt !                         (4 tokens): 4/4, 3/3, 2/2, 1/1
    corpus: 10/11, 7/9, 5/7, 3/5; lengths 11 = 11, so BP = 1.
    Without compound splitting sentence 1 has only 2/4 bigrams and 0/2 4-grams: the split matters.
    """
    hyp, ref = write(tmp_path / "hyp", HYPS[:2]), write(tmp_path / "ref", REFS[:2])
    scores = score_files(hyp, ref)
    expected = 100 * math.exp((math.log(10 / 11) + math.log(7 / 9) + math.log(5 / 7) + math.log(3 / 5)) / 4)
    p = scores["paper_bleu"]
    assert p["score"] == pytest.approx(expected, abs=1e-3)
    assert p["precisions"] == pytest.approx([1000 / 11, 700 / 9, 500 / 7, 60.0], abs=1e-3)
    assert p["bp"] == 1.0 and p["hyp_len"] == p["ref_len"] == 11
    assert "compound splitting" in p["metric"]
    no_split = score_files(hyp, ref, lang="en")["paper_bleu"]  # English: tokenized only, 5 + 4 tokens
    assert no_split["precisions"] == pytest.approx([800 / 9, 500 / 7, 300 / 5, 100 / 3], abs=1e-3)


def test_sacrebleu_and_chrf_equal_the_library(tmp_path: Path) -> None:
    hyp, ref = write(tmp_path / "hyp.de", HYPS), write(tmp_path / "ref.de", REFS)
    scores = score_files(hyp, ref)
    lib = sacrebleu.corpus_bleu(HYPS, [REFS])
    assert scores["sacrebleu"]["score"] == pytest.approx(lib.score, abs=1e-4)
    assert scores["sacrebleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert scores["chrf"]["score"] == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score, abs=1e-4)
    assert scores["sentences"] == 3
    text = format_scores(scores)
    assert "sacreBLEU" in text and "paper BLEU" in text and "tok:13a" in text


def test_ter_against_its_definition(tmp_path: Path) -> None:
    """TER = edits (insertions, deletions, substitutions, and shifts of a whole phrase) / reference words."""
    ref = write(tmp_path / "ref.de", ["a b c d", "a b c d e f g h"])
    substituted = score_files(write(tmp_path / "sub.de", ["a b x d", "a b c d e f g h"]), ref)["ter"]
    assert substituted["score"] == pytest.approx(100 * 1 / 12, abs=1e-4)  # one substitution over 4 + 8 reference words
    shifted = score_files(write(tmp_path / "shift.de", ["c d a b", "a b c d e f g h"]), ref)["ter"]
    assert shifted["score"] == pytest.approx(100 * 1 / 12, abs=1e-4)  # "a b" moved as one phrase: one edit
    assert "tok:tercom" in shifted["signature"]
    lib = sacrebleu.corpus_ter(HYPS, [REFS]).score
    assert score_files(write(tmp_path / "h.de", HYPS), write(tmp_path / "r.de", REFS))["ter"]["score"] == pytest.approx(
        lib, abs=1e-4
    )
    assert "TER" in format_scores(score_files(tmp_path / "h.de", tmp_path / "r.de"))


def test_line_count_mismatch_names_both_files(tmp_path: Path) -> None:
    hyp, ref = write(tmp_path / "hyp.de", HYPS[:2]), write(tmp_path / "ref.de", REFS)
    with pytest.raises(EvaluateError, match=r"hyp\.de has 2 lines but .*ref\.de has 3"):
        score_files(hyp, ref)
    result = CliRunner().invoke(app, ["score", "--hyp", str(hyp), "--ref", str(ref)])
    assert result.exit_code == 2 and "has 2 lines" in result.output


def test_score_cli(tmp_path: Path) -> None:
    hyp, ref = write(tmp_path / "hyp.de", HYPS), write(tmp_path / "ref.de", REFS)
    out = tmp_path / "s.json"
    result = CliRunner().invoke(app, ["score", "--hyp", str(hyp), "--ref", str(ref), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "paper BLEU" in result.stdout
    assert json.loads(out.read_text())["sacrebleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)


# -- sacreBLEU's cache, in a fresh interpreter so that $SACREBLEU is read at import as in real use

_NO_NETWORK = """
import sys, sacrebleu.utils, sacrebleu.dataset.base
def no_network(*args, **kwargs):
    raise OSError("network is unreachable (test)")
sacrebleu.utils.download_file = no_network
sacrebleu.dataset.base.download_file = no_network
if sys.argv[1] == "evaluate":
    from transformer_mt.cli import app
    app(sys.argv[1:])
from transformer_mt.data.testsets import TestsetError, fetch_testset
try:
    src, ref = fetch_testset(sys.argv[1], "en", "de")
    print(src.read_text().count(chr(10)), ref.read_text().count(chr(10)))
except TestsetError as err:
    print("TestsetError:", err)
"""


def run_offline(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """Run with $SACREBLEU set before sacreBLEU is imported, as a user would, and every download failing."""
    env = {**os.environ, "SACREBLEU": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", _NO_NETWORK, *args], env=env, capture_output=True, text=True, timeout=300
    )


def fill_sacrebleu_cache(cache: Path, src: list[str], ref: list[str]) -> None:
    """What sacreBLEU leaves in its cache after processing wmt14/full en-de: one text file per field."""
    d = cache / "wmt14" / "full"
    d.mkdir(parents=True)
    n = len(src)
    fields = {"src": src, "ref": ref, "docid": ["doc1"] * n, "genre": ["news"] * n, "origlang": ["en"] * n}
    for field, content in fields.items():
        write(d / f"wmt14_full.en-de.{field}", content)


def test_prefilled_sacrebleu_cache_works_offline(tmp_path: Path) -> None:
    fill_sacrebleu_cache(tmp_path / "cache", [f"sentence {i} ." for i in range(3)], [f"Satz {i} ." for i in range(3)])
    out = run_offline(tmp_path / "cache", "newstest2014")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3 3"


def test_no_network_says_how_to_pass_local_files(tmp_path: Path) -> None:
    out = run_offline(tmp_path / "empty", "newstest2013").stdout.strip()
    assert out.startswith("TestsetError: could not get newstest2013 (en-de) through sacreBLEU")
    assert "--src FILE.en --ref FILE.de" in out


# -- evaluate end to end on a random-weight toy checkpoint


def test_evaluate_local_files_offline(toy_ckpt: Path, prepared_toy: Config, tmp_path: Path, capsys) -> None:
    src_lines = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:4]
    ref_lines = Path(f"{prepared_toy.data.test}.de").read_text(encoding="utf-8").splitlines()[:4]
    src, ref = write(tmp_path / "nt.en", src_lines), write(tmp_path / "nt.de", ref_lines)
    scores = evaluate_checkpoint(
        [toy_ckpt], testset="newstest2014", src=src, ref=ref, output=tmp_path / "out", overrides=["decode.beam_size=2"]
    )
    hyps = (tmp_path / "out" / "hyp.de").read_text(encoding="utf-8").split("\n")
    assert len(hyps) == 5 and hyps[-1] == ""
    saved = json.loads((tmp_path / "out" / "scores.json").read_text())
    assert saved["testset"] == "newstest2014" and saved["decode"]["beam_size"] == 2
    assert saved["sacrebleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hyps[:-1], [ref_lines]).score)
    assert scores["paper_bleu"] == saved["paper_bleu"]
    assert saved["empty_hypotheses"] == sum(1 for h in hyps[:-1] if not h)
    assert "paper BLEU" in capsys.readouterr().out


def test_evaluate_warns_and_counts_empty_hypotheses(prepared_toy: Config, tmp_path: Path, capsys) -> None:
    from helpers import write_checkpoint

    write_checkpoint(prepared_toy, tmp_path / "silent.pt", seed=0, silent=True)  # translates everything to nothing
    src_lines = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:5]
    ref_lines = Path(f"{prepared_toy.data.test}.de").read_text(encoding="utf-8").splitlines()[:5]
    src, ref = write(tmp_path / "t.en", src_lines), write(tmp_path / "t.de", ref_lines)
    scores = evaluate_checkpoint(
        [tmp_path / "silent.pt"], src=src, ref=ref, output=tmp_path / "out", overrides=["decode.beam_size=1"]
    )
    assert scores["empty_hypotheses"] == 5 and scores["sacrebleu"]["score"] == 0
    assert json.loads((tmp_path / "out" / "scores.json").read_text())["empty_hypotheses"] == 5
    err = capsys.readouterr().err
    assert "warning: 5 of 5 non-empty input lines (100.0%) got an empty translation" in err
    assert "undertrained checkpoint" in err


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the WMT14 newstest2014 files of the shared data directory")
def test_evaluate_cli_on_newstest2014_lines(toy_ckpt: Path, tmp_path: Path) -> None:
    src = write(tmp_path / "newstest2014.en", (SHARED / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:3])
    ref = write(tmp_path / "newstest2014.de", (SHARED / "newstest2014.de").read_text(encoding="utf-8").splitlines()[:3])
    args = [
        "evaluate",
        "newstest2014",
        "-c",
        str(toy_ckpt),
        "--src",
        str(src),
        "--ref",
        str(ref),
        "-o",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(app, [*args, "--beam", "1"])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "o" / "hyp.de").read_text(encoding="utf-8").splitlines()) == 3
    assert "sacreBLEU" in result.stdout


@pytest.mark.slow
def test_evaluate_named_testset_from_prefilled_cache(toy_ckpt: Path, prepared_toy: Config, tmp_path: Path) -> None:
    src = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:3]
    ref = Path(f"{prepared_toy.data.test}.de").read_text(encoding="utf-8").splitlines()[:3]
    fill_sacrebleu_cache(tmp_path / "cache", src, ref)
    out = run_offline(tmp_path / "cache", "evaluate", "newstest2014", "-c", str(toy_ckpt), "-o", str(tmp_path / "o"))
    assert out.returncode == 0, out.stderr
    assert "sacreBLEU" in out.stdout
    scores = json.loads((tmp_path / "o" / "scores.json").read_text())
    assert scores["testset"] == "newstest2014" and scores["sentences"] == 3
    assert scores["src"].endswith("wmt14_full.en-de.src")


def test_evaluate_errors(toy_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown test set"):
        evaluate_checkpoint([toy_ckpt], testset="newstest1999")
    result = CliRunner().invoke(app, ["evaluate", "dev", "-c", str(toy_ckpt)])  # the fix is named: test, valid
    assert result.exit_code == 2 and "known: test and valid (the checkpoint config's own" in result.output
    with pytest.raises(EvaluateError, match="pass both --src and --ref"):
        evaluate_checkpoint([toy_ckpt], src=tmp_path / "x.en")
    a, b = write(tmp_path / "a.en", ["one", "two"]), write(tmp_path / "b.de", ["eins"])
    with pytest.raises(EvaluateError, match=r"a\.en has 2 lines but .*b\.de has 1"):
        evaluate_checkpoint([toy_ckpt], src=a, ref=b)


def test_evaluate_set_changes_decoding(toy_ckpt: Path, prepared_toy: Config, tmp_path: Path) -> None:
    lines = Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8").splitlines()[:2]
    refs = Path(f"{prepared_toy.data.test}.de").read_text(encoding="utf-8").splitlines()[:2]
    src, ref = write(tmp_path / "nt.en", lines), write(tmp_path / "nt.de", refs)
    args = ["evaluate", "-c", str(toy_ckpt), "--src", str(src), "--ref", str(ref), "-o", str(tmp_path / "o")]
    result = CliRunner().invoke(app, [*args, "--beam", "1", "--set", "decode.max_len_b=1", "-s", "decode.max_len_a=0"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "o" / "scores.json").read_text())
    assert (saved["decode"]["max_len_a"], saved["decode"]["max_len_b"]) == (0.0, 1)
    hyps = (tmp_path / "o" / "hyp.de").read_text(encoding="utf-8").splitlines()
    assert all(len(h.split()) <= 1 for h in hyps)  # at most one BPE token (and EOS) per sentence
    result = CliRunner().invoke(app, [*args, "--set", "data.tgt_lang=fr"])
    assert result.exit_code == 2 and "only takes decode.* keys and model.max_positions" in result.output


def test_read_lines_splits_on_newline_only(tmp_path: Path) -> None:
    path = tmp_path / "ref.de"
    path.write_bytes("a\u2028b\x1cc\x1dd\x1ee\x85f\r\nzwei\n\ndrei".encode())
    assert read_lines(path, "reference") == ["a\u2028b\x1cc\x1dd\x1ee\x85f", "zwei", "", "drei"]
    path.write_bytes(b"eins\r\nzwei\n\xff\n")
    with pytest.raises(UserError, match=r"ref\.de, line 3: not valid UTF-8 \(byte 0xff at column 1\)"):
        read_lines(path, "reference")
    with pytest.raises(EvaluateError, match=r"missing\.de: cannot read the reference file"):
        read_lines(tmp_path / "missing.de", "reference")


# -- the checkpoint config's own test and valid splits


@pytest.fixture(scope="module")
def split_ckpt(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose config names 4-line test and 3-line valid splits, in a directory of their own."""
    import dataclasses

    from helpers import write_checkpoint

    root = tmp_path_factory.mktemp("splits")
    for split, n in (("test", 4), ("valid", 3)):
        for lang in ("en", "de"):
            lines = Path(f"{prepared_toy.data.test}.{lang}").read_text(encoding="utf-8").splitlines()
            write(root / f"{split}.{lang}", lines[10 * n : 11 * n])
    data = dataclasses.replace(prepared_toy.data, test=str(root / "test"), valid=str(root / "valid"))
    decode = dataclasses.replace(prepared_toy.decode, max_len_a=0.5, max_len_b=3)
    path = root / "run" / "ckpt.pt"
    path.parent.mkdir()
    write_checkpoint(dataclasses.replace(prepared_toy, data=data, decode=decode), path, seed=0)
    return path


@pytest.mark.parametrize("split,lines", [("test", 4), ("valid", 3)])
def test_evaluate_scores_the_config_split_beside_the_checkpoint(split_ckpt: Path, split: str, lines: int) -> None:
    root = split_ckpt.parent.parent
    result = CliRunner().invoke(app, ["evaluate", split, "-c", str(split_ckpt), "--beam", "2"])
    assert result.exit_code == 0, result.output
    out = split_ckpt.parent / f"eval_{split}"
    scores = json.loads((out / "scores.json").read_text())
    assert scores["testset"] == split and scores["sentences"] == lines
    assert scores["src"] == str(root / f"{split}.en") and scores["ref"] == str(root / f"{split}.de")
    hyps = (out / "hyp.de").read_text(encoding="utf-8").splitlines()
    expected = evaluate_checkpoint([split_ckpt], src=root / f"{split}.en", ref=root / f"{split}.de",
                                   output=out.parent / "by_files", overrides=["decode.beam_size=2"])  # fmt: skip
    assert len(hyps) == lines and scores["sacrebleu"] == expected["sacrebleu"]


def test_evaluate_a_run_directory_writes_inside_it(split_ckpt: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    shutil.copy(split_ckpt, run / "checkpoint_best.pt")
    result = CliRunner().invoke(app, ["evaluate", "test", "-c", str(run), "--beam", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads((run / "eval_test" / "scores.json").read_text())["sentences"] == 4
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mine"]  # not runs/eval_test


def test_evaluate_split_errors_name_the_key_and_the_fix(prepared_toy: Config, split_ckpt: Path, tmp_path: Path) -> None:
    import dataclasses

    from helpers import write_checkpoint

    no_test = tmp_path / "no_test.pt"
    write_checkpoint(
        dataclasses.replace(prepared_toy, data=dataclasses.replace(prepared_toy.data, test="")), no_test, 0
    )
    with pytest.raises(EvaluateError, match=r"no_test\.pt: its config has no test split \(data\.test is empty\)"):
        evaluate_checkpoint([no_test], testset="test")
    gone = tmp_path / "gone.pt"
    data = dataclasses.replace(prepared_toy.data, valid="relative/elsewhere/valid")
    write_checkpoint(dataclasses.replace(prepared_toy, data=data), gone, 0)
    with pytest.raises(
        EvaluateError, match=r"relative/elsewhere/valid\.en not found: .*data\.valid=.*run tmt evaluate"
    ):
        evaluate_checkpoint([gone], testset="valid")
    result = CliRunner().invoke(app, ["evaluate", "-c", str(split_ckpt)])
    assert result.exit_code == 2 and "test, valid" in result.output  # the names a user may give


def test_evaluate_ensemble_decodes_the_checkpoints_together(split_ckpt: Path, prepared_toy: Config) -> None:
    from transformer_mt.decode.translate import Translator

    other = split_ckpt.parent / "other.pt"
    state = torch.load(split_ckpt, weights_only=True)
    state["model"] = {k: v.flip(0) if v.dim() == 2 else v for k, v in state["model"].items()}  # another model
    save_state(other, state)
    out = split_ckpt.parent / "eval_ensemble"
    args = ["evaluate", "test", "-c", str(split_ckpt), "-c", str(other), "--beam", "2", "-o", str(out)]
    result = CliRunner().invoke(app, [*args, "--ensemble"])
    assert result.exit_code == 0, result.output
    scores = json.loads((out / "scores.json").read_text())
    assert scores["ensemble"] is True and scores["checkpoints"] == [str(split_ckpt), str(other)]
    t = Translator.from_checkpoints([split_ckpt, other], device="cpu", overrides=["decode.beam_size=2"], ensemble=True)
    t.show_progress = False
    sources = (split_ckpt.parent.parent / "test.en").read_text(encoding="utf-8").splitlines()
    assert (out / "hyp.de").read_text(encoding="utf-8").splitlines() == t.translate_lines(sources)


def test_evaluate_of_a_run_directory_records_the_file_the_model_card_finds(
    split_ckpt: Path, prepared_toy: Config, tmp_path: Path
) -> None:
    """`tmt evaluate test -c RUN_DIR` records the checkpoint it decoded, so that `tmt export hf -c RUN_DIR/FILE`
    puts its score in the model card; a record of an older tmt, which named the directory, still counts; an
    evaluation that replaces an earlier one in the same directory says so on stderr, naming it."""
    import shutil

    from transformer_mt.export.hf import model_card

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(split_ckpt, run / "checkpoint_best.pt")
    first = CliRunner().invoke(app, ["evaluate", "test", "-c", str(run), "--beam", "1"])
    assert first.exit_code == 0, first.output
    assert "replaced" not in first.stderr
    scores = json.loads((run / "eval_test" / "scores.json").read_text())
    assert scores["checkpoints"] == [str((run / "checkpoint_best.pt").resolve())]
    row = f"| test | {scores['sacrebleu']['score']:.2f} |"
    assert row in model_card(prepared_toy, [run / "checkpoint_best.pt"], 1, [])

    (run / "eval_test" / "scores.json").write_text(json.dumps({**scores, "checkpoints": [str(run)]}))  # the old way
    assert row in model_card(prepared_toy, [run / "checkpoint_best.pt"], 1, [])

    again = CliRunner().invoke(app, ["evaluate", "test", "-c", str(run / "checkpoint_best.pt"), "--beam", "2"])
    assert again.exit_code == 0, again.output
    (line,) = [x for x in again.stderr.splitlines() if "replaced" in x]
    assert line.startswith(f"replaced the earlier evaluation in {run / 'eval_test'} (of {run}, sacreBLEU ")
    assert "-o DIR" in line
    assert json.loads((run / "eval_test" / "scores.json").read_text())["decode"]["beam_size"] == 2
