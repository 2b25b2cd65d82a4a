"""Which decoding choices combine: the command line, a config file and the server's API give one verdict.

Every combination of sampling, beam, n-best, constraints, prefixes, word
alignments, engine and ensemble is judged by `mode_conflict` and by the real
entry points of each surface: `tmt translate`'s checks before and after the
model loads (the config's validation of the flags included), a config
file's decode section, and ``/v1/translate``'s parser. No surface may accept
what another refuses.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from transformer_mt.cli import Engine, _check_translate_args
from transformer_mt.config import (
    API_NAMES,
    CLI_NAMES,
    Config,
    ConfigError,
    DecodeMode,
    config_from_dict,
    mode_conflict,
)
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.lines import EmptyCount, translated_windows
from transformer_mt.decode.load import decode_flags, load_model, override_config
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import UserError
from transformer_mt.serve.protocol import Limits, RequestError, parse_v1

MODES = [
    DecodeMode(*values)
    for values in itertools.product(
        (False, True),
        (1, 3),
        (1, 2, 4),
        (False, True),
        (False, True),
        (False, True),
        ("pytorch", "ctranslate2"),
        (False, True),
    )
]  # sampling, beam, nbest, constraints, prefixes, alignment, engine, ensemble


def expected(mode: DecodeMode) -> bool:
    """The verdict: True when the combination is accepted."""
    return mode_conflict(mode) is None


def test_the_rules() -> None:
    """The rules themselves, spelled out: what a user of each surface is told."""
    assert mode_conflict(DecodeMode()) is None
    assert mode_conflict(DecodeMode(sampling=True, beam=1, nbest=4)) is None  # K samples need no beam
    assert mode_conflict(DecodeMode(sampling=True, beam=3))[0] == "beam"
    assert mode_conflict(DecodeMode(beam=3, nbest=4))[0] == "nbest"
    assert mode_conflict(DecodeMode(nbest=0))[0] == "nbest"
    assert mode_conflict(DecodeMode(constraints=True, prefixes=True))[0] == "constraints"
    assert mode_conflict(DecodeMode(constraints=True, sampling=True, beam=1))[0] == "constraints"
    assert mode_conflict(DecodeMode(constraints=True, engine="ctranslate2"))[0] == "constraints"
    assert mode_conflict(DecodeMode(ensemble=True, engine="ctranslate2"))[0] == "ensemble"
    assert mode_conflict(DecodeMode(alignment=True, ensemble=True))[0] == "alignment"
    assert "--sample" in mode_conflict(DecodeMode(sampling=True, beam=3), CLI_NAMES)[1]
    assert "'sample'" in mode_conflict(DecodeMode(sampling=True, beam=3), API_NAMES)[1]
    assert sum(map(expected, MODES)) not in (0, len(MODES))


def test_a_config_file_judges_its_decode_section_alike() -> None:
    """A config file holds sampling, beam, n-best and alignment; the rest are the caller's."""
    for mode in {DecodeMode(m.sampling, m.beam, m.nbest, alignment=m.alignment) for m in MODES}:
        decode = {"beam_size": mode.beam, "nbest": mode.nbest, "sampling": "topk:5" if mode.sampling else "none",
                  "alignment": "hard" if mode.alignment else "none"}  # fmt: skip
        try:
            config_from_dict({**Config().to_dict(), "decode": {**Config().to_dict()["decode"], **decode}})
            accepted = True
        except ConfigError:
            accepted = False
        assert accepted == expected(mode), mode


def _cli_accepts(mode: DecodeMode, loaded, engine_search) -> bool:
    """`tmt translate`'s own checks in their order: the flags before loading, the flags applied to the
    checkpoint's config, then the loaded translator's check at the first window."""
    try:
        _check_translate_args(
            [], [Path("ckpt.pt")], mode.constraints, Engine(mode.engine), mode.ensemble, mode.prefixes
        )
        flags = decode_flags(beam=mode.beam, nbest=mode.nbest, sample="topk:5" if mode.sampling else "none",
                             alignment="hard" if mode.alignment else "none")  # fmt: skip
        cfg = override_config(loaded.config, flags)
        model = Ensemble([loaded.model, loaded.model]) if mode.ensemble else loaded.model
        engine = engine_search if mode.engine == "ctranslate2" else None
        translator = Translator(None if engine else model, loaded.bpe, cfg, "cpu", search=engine)
        window = ([], [] if mode.prefixes else None)
        list(translated_windows(translator, [window], EmptyCount(), constraints=mode.constraints))
    except UserError:
        return False
    return True


def test_the_command_line_judges_alike(toy_ckpt: Path) -> None:
    loaded = load_model([toy_ckpt], "cpu")
    loaded = dataclasses.replace(loaded, config=override_config(loaded.config, ["decode.beam_size=4"]))
    for mode in MODES:
        assert _cli_accepts(mode, loaded, lambda sources, nbest, prefixes: []) == expected(mode), mode


def _api_accepts(mode: DecodeMode, cfg: Config) -> bool:
    raw = {"sources": ["a", "b"], "beam": mode.beam, "nbest": mode.nbest}
    if mode.sampling:
        raw["sample"] = "topk:5"
    if mode.constraints:
        raw["constraints"] = [["x"], []]
    if mode.prefixes:
        raw["prefixes"] = ["y", ""]
    if mode.alignment:
        raw["alignment"] = "hard"
    try:
        parse_v1(raw, cfg, Limits(), mode.engine, mode.ensemble)
    except RequestError as err:
        assert err.status == 400
        return False
    return True


@pytest.mark.parametrize("served_beam", [1, 4])
def test_the_api_judges_alike(served_beam: int) -> None:
    cfg = Config()
    cfg.decode.beam_size = served_beam  # a request's own beam is what counts
    for mode in MODES:
        assert _api_accepts(mode, cfg) == expected(mode), mode
