"""`tmt translate`: raw text in, detokenized translations out, one line per line, in input order.

Each line is normalized (`transformer_mt.data.clean.normalize`, the function
`tmt prepare` applied to the training text), BPE-encoded with the
sentencepiece model stored in the checkpoint, translated with beam search and
decoded back to plain text. Lines are batched by source tokens in length
order (long lines first, so memory problems show at once) and the
translations are put back in input order. An empty line (or one that
normalizes to nothing) gives an empty line without running the model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import sentencepiece as spm
import torch
from tqdm import tqdm

from transformer_mt.config import Config, ConfigError, DecodeConfig, config_from_dict
from transformer_mt.data.bpe import EOS, PAD, load_bpe_bytes
from transformer_mt.data.clean import normalize
from transformer_mt.decode.search import beam_search
from transformer_mt.model.transformer import Transformer


class TranslateError(RuntimeError):
    """Input or checkpoint problems a user can fix; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Translation:
    """One hypothesis: detokenized ``text``, normalized ``score`` and raw ``log_prob`` (natural log, EOS included)."""

    text: str
    score: float
    log_prob: float


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load(path: Path) -> dict[str, Any]:
    from transformer_mt.train.checkpoint import CheckpointError, load_checkpoint

    try:
        state = load_checkpoint(path)
    except CheckpointError as err:
        raise TranslateError(str(err)) from None
    for key, why in (("config", "config"), ("spm_model", "BPE model (spm_model)")):
        if key not in state:
            raise TranslateError(
                f"{path}: the checkpoint holds no {why}, so it cannot translate raw text; it was not written by "
                "`tmt train`: use a checkpoint from `tmt train` or the output of `tmt average`"
            )
    return state


def load_averaged(paths: Sequence[Path]) -> dict[str, Any]:
    """The first checkpoint with its ``model`` replaced by the mean over all ``paths``, like `tmt average`.

    Parameters are summed in float64, one checkpoint in memory at a time; all
    must have the same parameter names and shapes and the same BPE model.
    """
    first = _load(paths[0])
    if len(paths) == 1:
        return first
    ref = first["model"]
    total = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in ref.items()}
    for path in paths[1:]:
        state = _load(path)
        model = state["model"]
        if set(model) != set(ref) or any(model[k].shape != ref[k].shape for k in ref):
            raise TranslateError(
                f"{path}: different parameters than {paths[0]}; only checkpoints of the same model can be averaged"
            )
        if not torch.equal(state["spm_model"], first["spm_model"]):
            raise TranslateError(f"{path}: a different BPE model than {paths[0]}; average checkpoints of one run only")
        for key, value in model.items():
            if value.is_floating_point():
                total[key] += value.to(torch.float64)
        del state, model
    n = len(paths)
    first["model"] = {k: (v / n).to(ref[k].dtype) if ref[k].is_floating_point() else v for k, v in total.items()}
    return first


class Translator:
    """A model, its BPE model and decoding settings; `translate_lines` is the whole text-to-text path."""

    def __init__(
        self, model: Transformer, bpe: spm.SentencePieceProcessor, cfg: Config, device: str | torch.device
    ) -> None:
        self.model = model.eval()
        self.bpe = bpe
        self.cfg = cfg
        self.device = torch.device(device)
        self.show_progress = True

    @property
    def decode_cfg(self) -> DecodeConfig:
        return self.cfg.decode

    @classmethod
    def from_checkpoints(
        cls,
        paths: Sequence[str | Path],
        device: str | torch.device | None = None,
        beam: int | None = None,
        lenpen: float | None = None,
        nbest: int | None = None,
        batch_tokens: int | None = None,
    ) -> Translator:
        """Load one checkpoint, or average several on the fly (parameter averaging, as `tmt average` does).

        Decoding settings come from the config stored in the (first) checkpoint;
        the arguments that are not None override them.
        """
        paths = [Path(p) for p in paths]
        if not paths:
            raise TranslateError("no checkpoint given; pass one or more with -c CHECKPOINT")
        state = load_averaged(paths)
        try:
            cfg = config_from_dict(state["config"], origin=str(paths[0]))
        except ConfigError as err:
            raise TranslateError(str(err)) from None
        bpe = load_bpe_bytes(state["spm_model"].numpy().tobytes())
        cfg = dataclasses.replace(cfg, decode=_override(cfg.decode, beam, lenpen, nbest, batch_tokens))
        device = torch.device(device or default_device())
        model = _build_model(cfg, state["model"], bpe, paths[0]).to(device)
        return cls(model, bpe, cfg, device)

    # -- text to text

    def translate_lines(self, lines: Sequence[str]) -> list[str]:
        """One detokenized translation per line, in order; empty lines give empty lines."""
        return [hyps[0].text for hyps in self.translate_lines_nbest(lines, nbest=1)]

    def translate_lines_nbest(self, lines: Sequence[str], nbest: int | None = None) -> list[list[Translation]]:
        """The ``nbest`` (default: decode.nbest) best translations of every line, best first.

        An empty line gets ``nbest`` empty translations with score 0.
        """
        nbest = self.decode_cfg.nbest if nbest is None else nbest
        if not 1 <= nbest <= self.decode_cfg.beam_size:
            raise TranslateError(f"--nbest {nbest} must be between 1 and the beam size ({self.decode_cfg.beam_size})")
        ids = [self.encode(i, line) for i, line in enumerate(lines)]
        results: list[list[Translation]] = [[Translation("", 0.0, 0.0)] * nbest if not x else [] for x in ids]
        todo = [i for i, x in enumerate(ids) if x]
        with tqdm(
            total=len(lines), unit="sent", desc="translate", file=sys.stderr, disable=not self.show_progress
        ) as bar:
            bar.update(len(lines) - len(todo))
            for batch in batches_by_tokens(todo, [len(ids[i]) for i in todo], self.decode_cfg.batch_tokens):
                for i, hyps in zip(batch, self._translate_batch([ids[i] for i in batch], nbest), strict=True):
                    results[i] = hyps
                bar.update(len(batch))
        return results

    def encode(self, index: int, line: str) -> list[int]:
        """Normalized, BPE-encoded source ids plus EOS ([] for an empty line), truncated to the model's positions."""
        text = normalize(line)
        if not text:
            return []
        ids = self.bpe.encode(text, out_type=int)
        limit = self.cfg.model.max_positions - 1
        if len(ids) > limit:
            tqdm.write(
                f"warning: line {index + 1}: {len(ids)} BPE tokens, more than the model's max_positions "
                f"({self.cfg.model.max_positions}) allow; translating only its first {limit} tokens",
                file=sys.stderr,
            )
            ids = ids[:limit]
        return ids + [EOS]

    def _translate_batch(self, sources: list[list[int]], nbest: int) -> list[list[Translation]]:
        d = self.decode_cfg
        src = torch.full((len(sources), max(map(len, sources))), PAD, dtype=torch.long)
        for row, ids in enumerate(sources):
            src[row, : len(ids)] = torch.tensor(ids)
        out = beam_search(
            self.model, src.to(self.device), beam_size=d.beam_size, len_penalty=d.len_penalty,
            len_penalty_form=d.len_penalty_form, max_len_a=d.max_len_a, max_len_b=d.max_len_b, nbest=nbest,
            max_positions=self.cfg.model.max_positions,
        )  # fmt: skip
        results = []
        for hyps in out:
            found = [Translation(self.bpe.decode(h.tokens), h.score, h.log_prob) for h in hyps]
            results.append(found + [Translation("", float("-inf"), float("-inf"))] * (nbest - len(found)))
        return results


def _override(
    d: DecodeConfig, beam: int | None, lenpen: float | None, nbest: int | None, batch_tokens: int | None
) -> DecodeConfig:
    changes = {"beam_size": beam, "len_penalty": lenpen, "nbest": nbest, "batch_tokens": batch_tokens}
    d = dataclasses.replace(d, **{k: v for k, v in changes.items() if v is not None})
    if nbest is None and beam is not None:
        d = dataclasses.replace(d, nbest=min(d.nbest, d.beam_size))  # a smaller --beam also shortens the saved n-best
    for flag, value in (("--beam", d.beam_size), ("--batch-tokens", d.batch_tokens), ("--nbest", d.nbest)):
        if value < 1:
            raise TranslateError(f"{flag} must be at least 1, got {value}")
    if d.nbest > d.beam_size:
        raise TranslateError(f"--nbest {d.nbest} cannot exceed the beam size ({d.beam_size}); raise --beam")
    return d


def _build_model(
    cfg: Config, params: dict[str, torch.Tensor], bpe: spm.SentencePieceProcessor, path: Path
) -> Transformer:
    vocab = bpe.get_piece_size()
    model = Transformer(cfg.model, vocab, pad_id=PAD)
    try:
        model.load_state_dict(params)
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise TranslateError(
            f"{path}: the weights do not fit the model its config describes (vocabulary {vocab}): {first}"
        ) from None
    return model


def batches_by_tokens(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group ``indices`` longest first so that sentences x longest length (padded tokens) <= batch_tokens.

    A sentence longer than ``batch_tokens`` still gets a batch of its own: nothing is ever dropped.
    """
    order = sorted(range(len(indices)), key=lambda j: -lengths[j])  # stable: equal lengths keep input order
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for j in order:
        if current and max(longest, lengths[j]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(indices[j])
        longest = max(longest, lengths[j])
    if current:
        batches.append(current)
    return batches


# -- files


def read_text_lines(stream: BinaryIO, name: str) -> list[str]:
    """Lines of a UTF-8 byte stream split on '\\n' only (a trailing '\\r' is dropped), so that Unicode line
    separators inside a line never shift the output; invalid UTF-8 is an error naming the line."""
    data = stream.read()
    if not data:
        return []
    raw_lines = data.split(b"\n")
    if data.endswith(b"\n"):
        raw_lines.pop()
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as err:
            raise TranslateError(
                f"{name}, line {number}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                "convert the input to UTF-8, e.g. `iconv -f latin1 -t utf-8 in.txt > in.utf8.txt`"
            ) from None
    return lines


def write_lines_atomic(path: Path, lines: Iterable[str]) -> None:
    """Write lines to a temporary file beside ``path`` and rename it: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(line + "\n" for line in lines)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_nbest(results: Sequence[Sequence[Translation]]) -> list[str]:
    """``index<TAB>score<TAB>text`` lines: 0-based input line index, normalized score (higher is better)."""
    return [f"{i}\t{t.score:.4f}\t{t.text}" for i, hyps in enumerate(results) for t in hyps]


def translate_file(
    checkpoints: Sequence[str | Path],
    input: str | Path | None = None,
    output: str | Path | None = None,
    beam: int | None = None,
    lenpen: float | None = None,
    nbest: int | None = None,
    batch_tokens: int | None = None,
    device: str | None = None,
) -> None:
    """Translate ``input`` (stdin when None) to ``output`` (stdout when None); see `tmt translate --help`."""
    if input is None:
        lines = read_text_lines(sys.stdin.buffer, "<stdin>")
    else:
        try:
            with open(input, "rb") as f:
                lines = read_text_lines(f, str(input))
        except OSError as err:
            raise TranslateError(f"{input}: cannot read the input ({err.strerror})") from None
    translator = Translator.from_checkpoints(
        checkpoints, device=device, beam=beam, lenpen=lenpen, nbest=nbest, batch_tokens=batch_tokens
    )
    k = translator.decode_cfg.nbest
    if k == 1:
        out_lines = translator.translate_lines(lines)
    else:
        out_lines = format_nbest(translator.translate_lines_nbest(lines, nbest=k))
    if output is None:
        text = "".join(line + "\n" for line in out_lines)
        stdout = getattr(sys.stdout, "buffer", None)
        if stdout is not None:  # UTF-8 whatever the locale says
            sys.stdout.flush()
            stdout.write(text.encode("utf-8"))
            stdout.flush()
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
    else:
        write_lines_atomic(Path(output), out_lines)
