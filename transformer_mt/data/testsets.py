"""The named dev and test sets and how to get them: sacreBLEU's downloader and cache ($SACREBLEU).

One table for the two stages that need it: `tmt download` writes the dev
and test sets next to the training text, and `tmt evaluate NAME` scores
against the same files, so what a model is tested on is what it is scored on.
"""

from __future__ import annotations

from pathlib import Path

from transformer_mt.errors import UserError

# Test sets by their WMT name, and the sacreBLEU test set that holds them; `tmt download`
# writes the first two. newstest2014 is the full 3003-sentence set (sacreBLEU's "wmt14/full",
# statmt's test-full.tgz), the one tensor2tensor evaluated; "wmt14" is the filtered 2737-line subset.
TESTSETS = {
    "newstest2013": "wmt13",
    "newstest2014": "wmt14/full",
    "newstest2014-filtered": "wmt14",
}


class TestsetError(UserError):
    """An unknown test set, a missing direction or a failed download; the message says what to do."""

    __test__ = False  # a name pytest would otherwise collect as a test class


def check_testset_name(name: str) -> None:
    """Refuse an unknown name before anything slow (loading a model, downloading) starts."""
    if name not in TESTSETS:
        raise TestsetError(
            f"unknown test set {name!r}; known: {', '.join(TESTSETS)}; or pass local files with --src and --ref"
        )


def fetch_testset(name: str, src_lang: str, tgt_lang: str, offline_hint: str | None = None) -> tuple[Path, Path]:
    """Source and reference files of a named test set, through sacreBLEU's downloader and cache ($SACREBLEU).

    ``offline_hint`` replaces the advice given when the download fails (the
    default says how to pass local files to `tmt evaluate`).
    """
    check_testset_name(name)
    from sacrebleu.dataset import DATASETS
    from sacrebleu.utils import SACREBLEU_DIR

    dataset, pair = DATASETS[TESTSETS[name]], f"{src_lang}-{tgt_lang}"
    if pair not in dataset.langpairs:
        raise TestsetError(f"{name} has no {pair} direction; it has {', '.join(sorted(dataset.langpairs))}")
    try:
        src = dataset.get_source_file(pair)
        refs = dataset.get_reference_files(pair)
    except (Exception, SystemExit) as err:  # no network, a broken download, a failed checksum (sacreBLEU exits)
        hint = offline_hint or (
            f"without network, pass local files: tmt evaluate {name} -c CKPT --src FILE.{src_lang} "
            f"--ref FILE.{tgt_lang}, or fill the sacreBLEU cache ({SACREBLEU_DIR}, set by the SACREBLEU variable) "
            "on a machine with network"
        )
        raise TestsetError(
            f"could not get {name} ({pair}) through sacreBLEU ({type(err).__name__}: {err}); {hint}"
        ) from None
    return Path(src), Path(refs[0])
