"""`tmt prepare`: clean the parallel text, learn the joint BPE model, binarize every split.

Steps, each streaming so that memory does not grow with the corpus (only the
BPE sample is held in memory):

1. check the inputs (present, same line count on both sides) and hash them;
2. normalize every pair; filter training pairs (empty side, longer than
   ``data.max_len``, length ratio above ``data.max_ratio``), drop only
   empty-sided pairs from valid/test; reservoir-sample ``bpe.sample_sentences``
   training sentences for BPE;
3. learn one sentencepiece BPE model on both sides, or copy the one ``bpe.model``
   names (fine-tuning on new data with a checkpoint's vocabulary);
4. encode every split in ``data.workers`` processes into ids + offsets arrays;
5. move the results into ``data.dir`` and write ``manifest.json`` last,
   atomically: its presence means "complete and matching these inputs".

Work files live in a temporary directory inside ``data.dir`` and the old
manifest is removed before anything is replaced, so an interrupted run never
leaves output that a re-run would take as complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from transformer_mt.config import Config, DataConfig, config_hash
from transformer_mt.cpus import choose_threads
from transformer_mt.data import binarize, clean
from transformer_mt.data.bpe import (
    MODEL_NAME,
    VOCAB_NAME,
    load_bpe,
    model_digest,
    read_given_model,
    train_bpe,
    write_vocab,
)
from transformer_mt.data.dataset import split_paths
from transformer_mt.data.directions import (
    Direction,
    directions,
    languages,
    multilingual,
    prefix,
    prefix_key,
    split_name,
    tag_symbols,
    train_parts,
)
from transformer_mt.data.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    GivenBpe,
    InputFile,
    MalformedManifest,
    Manifest,
    SplitStats,
)
from transformer_mt.data.raw_files import raw_file
from transformer_mt.errors import UserError
from transformer_mt.files import atomic_write_text, check_output_parent
from transformer_mt.progress import progress

TRAINING_ONLY = ("model", "sampling_alpha")  # bpe keys outside the hash of a learned model (see _bpe_hash)
SYNTH_HELD_OUT = 1000  # valid and test pairs of the generated toy corpus


class PrepareError(UserError):
    """A problem with the input data that the user can fix; the message says how."""


@dataclass(frozen=True)
class SplitFiles:
    """One split's two parallel files (of one direction), and the config key that names them."""

    name: str  # train, valid or test; with data.directions, of one direction: train.en-de
    src: Path
    tgt: Path
    key: str  # e.g. data.train
    split: str  # train, valid or test
    src_lang: str
    tgt_lang: str
    synthetic: bool  # a model's translations: cleaned and encoded as any split, kept out of the BPE sample

    @property
    def training(self) -> bool:
        return self.split == "train"


def split_files(cfg: Config) -> list[SplitFiles]:
    """The splits the config names: the training parts (each direction's, then each synthetic corpus's), then
    each direction's valid and test; ``data.test: ""`` means no test split."""
    d = cfg.data
    train = [
        SplitFiles(part.name, raw_file(part.prefix, part.direction.src), raw_file(part.prefix, part.direction.tgt),
                   part.key, "train", part.direction.src, part.direction.tgt, part.synthetic)
        for part in train_parts(d)
    ]  # fmt: skip
    held_out = [
        _split(name, d, way, prefix(d, way, name)) for name in ("valid", "test") for way in directions(d)
        if prefix(d, way, name)
    ]  # fmt: skip
    return train + held_out


def _split(name: str, d: DataConfig, way: Direction, at: str) -> SplitFiles:
    src, tgt = raw_file(at, way.src), raw_file(at, way.tgt)
    return SplitFiles(split_name(name, d, way), src, tgt, prefix_key(d, way, name), name, way.src, way.tgt, False)


NEW_DATA_KEYS = {
    "directions": [],
    "temperature": 1.0,
    "corpora": [],
}  # outside the hash at these values: data prepared before
NEW_CORPUS_KEYS = {"synthetic": False, "tag": False}  # the same, for each data.corpora entry


def prepare_hash(cfg: Config) -> str:
    """Hash of the config keys that change the prepared data (``data.workers`` does not; nor ``data.directions``,
    ``data.temperature`` and ``data.corpora`` at their defaults, so that data prepared before they existed stays
    up to date)."""
    data = dataclasses.asdict(dataclasses.replace(cfg.data, workers=0))
    for key, default in NEW_DATA_KEYS.items():
        if data[key] == default:
            del data[key]
    for corpus in data.get("corpora", []):
        for key, default in NEW_CORPUS_KEYS.items():
            if corpus[key] == default:
                del corpus[key]
    return config_hash(data) + _bpe_hash(cfg)


def _bpe_hash(cfg: Config) -> str:
    """What decides the BPE model: the keys that learn one, or the bytes of the one ``bpe.model`` gives.

    Without ``bpe.model`` the hash is the one from before that key existed, so
    data prepared then stays up to date. With it, only the model's digest
    counts: another model (or the file rewritten) re-prepares, while the
    learning keys, which are ignored, and the path, which may move, do not.
    ``bpe.sampling_alpha`` is read when training, not here: it only asks for
    the training text to be kept (`train_text_files`), which `_up_to_date` checks.
    """
    if not cfg.bpe.model:
        return config_hash({k: v for k, v in dataclasses.asdict(cfg.bpe).items() if k not in TRAINING_ONLY})
    return config_hash({"model_sha256": model_digest(cfg.bpe.model)})


def load_manifest(data_dir: str | Path) -> Manifest | None:
    """The manifest of a complete prepare in ``data_dir``, or None (also for one that is not of `Manifest`'s layout)."""
    path = Path(data_dir) / MANIFEST
    try:
        return Manifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (FileNotFoundError, json.JSONDecodeError, MalformedManifest):
        return None


def is_prepared(cfg: Config) -> bool:
    """True when ``data.dir`` holds a complete prepare of the current inputs and config."""
    manifest = load_manifest(cfg.data.dir)
    splits = split_files(cfg)
    if manifest is None or not all(f.src.is_file() and f.tgt.is_file() for f in splits):
        return False
    return _up_to_date(manifest, cfg, _fingerprints(splits, manifest, quiet=True))


def wait_until_prepared(cfg: Config, waiter: str, poll_seconds: float = 5.0, note_every: float = 300.0) -> None:
    """Return once another process has made ``data.dir`` up to date (`is_prepared`); no timeout.

    For the processes of a distributed run while one of them prepares: at
    WMT size that takes longer than a collective operation may wait, so they
    poll the manifest that `prepare_data` writes last instead. If the preparing
    process fails, its launcher (torchrun) stops the waiting ones. ``waiter``
    names the waiting process in the note printed every ``note_every`` seconds.
    """
    start = last = time.monotonic()
    while not is_prepared(cfg):
        time.sleep(poll_seconds)
        if time.monotonic() - last >= note_every:
            last = time.monotonic()
            _say(
                f"{waiter} has waited {(last - start) / 60:.0f} min for rank 0 to prepare {cfg.data.dir}; if that "
                "directory is not on a file system shared with rank 0's host, stop and run `tmt prepare CONFIG` "
                "on this host first"
            )


def prepare_data(cfg: Config, force: bool = False) -> Path:
    """Make ``data.dir`` up to date with the inputs and config, and return it."""
    out = Path(cfg.data.dir)
    check_output_parent(out / MANIFEST, "data.dir")  # before any work, the toy corpus included
    _maybe_synthesize(cfg)
    splits = split_files(cfg)
    _check_present(cfg, splits)
    if cfg.bpe.model:
        read_given_model(cfg.bpe.model)  # a wrong file stops here, before any input is read
    old = load_manifest(out)
    fingerprints = _fingerprints(splits, old)
    _check_line_counts(splits, fingerprints)
    if not force and old is not None and _up_to_date(old, cfg, fingerprints):
        _say(f"{out} is up to date (inputs and data/bpe config unchanged); nothing to do. --force redoes it.")
        return out
    if old is not None and cfg.bpe.sampling_alpha > 0 and not set(train_text_files(cfg)) <= set(old.files):
        _say(f"{out} holds no training text, which bpe.sampling_alpha re-encodes every epoch: preparing again")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    _remove_stale_work_dirs(out)
    with tempfile.TemporaryDirectory(dir=out, prefix=".prepare-") as tmp:
        manifest = _prepare_in(Path(tmp), cfg, splits, fingerprints)
        for name in manifest.files:
            os.replace(Path(tmp) / name, out / name)
    atomic_write_text(out / MANIFEST, manifest.to_json())
    _say(_summary(out, manifest))
    return out


def _prepare_in(work: Path, cfg: Config, splits: list[SplitFiles], fingerprints: dict[str, InputFile]) -> Manifest:
    """Every step into the work directory; returns the manifest (not yet written)."""
    workers = cfg.data.workers or choose_threads().count  # the CPUs this process may use (quota, affinity)
    seconds, start = {}, time.perf_counter()
    sample, size = None if cfg.bpe.model else BpeSample(cfg), 0  # a given BPE model needs no sample
    stats = {s.name: _clean_checked(s, cfg, work, fingerprints[str(s.src)].lines, sample) for s in splits}
    if sample is not None:
        size = sample.write(work / "bpe_sample.txt")
        first = split_name("train", cfg.data, directions(cfg.data)[0])
        stats[first] = dataclasses.replace(stats[first], bpe_sample=size)
    seconds["clean"] = time.perf_counter() - start
    vocab_size = _copy_bpe(work, cfg) if cfg.bpe.model else _learn_bpe(work, cfg, size, workers)
    seconds["bpe"] = time.perf_counter() - start - seconds["clean"]
    dtype = np.uint16 if vocab_size < 65536 else np.int32
    files = [MODEL_NAME, VOCAB_NAME]
    for s in splits:
        names, counts = _binarize_split(work, cfg, s, stats[s.name].sentences, dtype, workers)
        stats[s.name] = dataclasses.replace(stats[s.name], **dataclasses.asdict(counts))
        files += names
    if cfg.bpe.sampling_alpha > 0:  # re-encoded every epoch (data/bpe_dropout.py): keep the cleaned training text
        for side in ("src", "tgt"):  # through other names: a language may be called src or tgt
            os.replace(work / f"train.{side}.txt", work / f"kept.{side}")
        for side, name in zip(("src", "tgt"), train_text_files(cfg), strict=True):
            os.replace(work / f"kept.{side}", work / name)
        files += train_text_files(cfg)
    seconds["encode"] = time.perf_counter() - start - seconds["clean"] - seconds["bpe"]
    first = directions(cfg.data)[0]
    return Manifest(
        format=FORMAT_VERSION,
        src_lang=first.src,
        tgt_lang=first.tgt,
        directions=[way.name for way in directions(cfg.data)] if multilingual(cfg.data) else [],
        vocab_size=vocab_size,
        ids_dtype=np.dtype(dtype).name,
        config_hash=prepare_hash(cfg),
        config={"data": dataclasses.asdict(cfg.data), "bpe": dataclasses.asdict(cfg.bpe)},
        inputs=fingerprints,
        splits=stats,
        files=files,
        seconds={step: round(t, 3) for step, t in seconds.items()},
        workers=workers,
        bpe_model=_given_bpe(cfg),
    )


def _clean_checked(s: SplitFiles, cfg: Config, work: Path, lines: int, sample: BpeSample | None) -> SplitStats:
    stats = _clean_split(s, cfg, work, lines, sample if s.training else None)
    if stats.sentences == 0:
        raise PrepareError(_empty_message(s, stats))
    return stats


def _learn_bpe(work: Path, cfg: Config, sample_size: int, workers: int) -> int:
    """Train sentencepiece on the sample into ``work/spm.{model,vocab}``; returns the vocabulary size."""
    symbols = tag_symbols(cfg.data)
    tags = f" ({len(symbols)} target tags among them)" if symbols else ""
    _say(f"learning a joint BPE of {cfg.bpe.vocab_size} pieces{tags} from {sample_size} sentences")
    model = train_bpe(
        work / "bpe_sample.txt", work / "spm", cfg.bpe.vocab_size, cfg.bpe.character_coverage, workers, symbols
    )
    os.replace(model, work / MODEL_NAME)
    os.replace(work / "spm.vocab", work / VOCAB_NAME)
    return load_bpe(work / MODEL_NAME).get_piece_size()


def _copy_bpe(work: Path, cfg: Config) -> int:
    """``bpe.model`` into ``work/spm.{model,vocab}``, byte for byte; returns the vocabulary size."""
    blob, sp = read_given_model(cfg.bpe.model)
    _say(
        f"encoding with the BPE model {cfg.bpe.model} ({sp.get_piece_size()} pieces; bpe.model is set, so "
        "bpe.vocab_size, bpe.sample_sentences, bpe.character_coverage and bpe.seed are not used)"
    )
    (work / MODEL_NAME).write_bytes(blob)
    write_vocab(sp, work / VOCAB_NAME)
    return sp.get_piece_size()


def _given_bpe(cfg: Config) -> GivenBpe | None:
    """The manifest's record of ``bpe.model``: where the model came from and its digest; None when learned."""
    if not cfg.bpe.model:
        return None
    return GivenBpe(cfg.bpe.model, model_digest(cfg.bpe.model))


def _binarize_split(
    work: Path, cfg: Config, s: SplitFiles, pairs: int, dtype: type, workers: int
) -> tuple[list[str], binarize.TokenCounts]:
    """Encode one split's cleaned text into ids + offsets arrays; returns their names and the tokens counted."""
    langs = (s.src_lang, s.tgt_lang)
    writers = [binarize.SideWriter(*split_paths(work, s.name, lang), dtype) for lang in langs]
    try:
        counts = binarize.encode_split(
            work / MODEL_NAME,
            work / f"{s.name}.src.txt",
            work / f"{s.name}.tgt.txt",
            *writers,
            pairs=pairs,
            workers=workers,
        )
    finally:
        for w in writers:
            w.close()
    return [p.name for lang in langs for p in split_paths(work, s.name, lang)], counts


# ---------------------------------------------------------------- inputs


def _maybe_synthesize(cfg: Config) -> None:
    """Generate the toy corpus at the train prefix's directory when ``data.synth`` and files are missing."""
    if not cfg.data.synth or all(f.src.is_file() and f.tgt.is_file() for f in split_files(cfg)):
        return
    from transformer_mt.data.synthetic import write_corpus

    corpus = Path(cfg.data.train).parent
    expected = {"data.train": corpus / "train", "data.valid": corpus / "valid", "data.test": corpus / "test"}
    given = {"data.train": cfg.data.train, "data.valid": cfg.data.valid, "data.test": cfg.data.test}
    for key, path in expected.items():
        if given[key] and Path(given[key]) != path:
            raise PrepareError(
                f"data.synth writes the toy corpus as {corpus}/{{train,valid,test}}, but {key} is {given[key]!r}; "
                f"set {key}: {path} (or data.synth: false and point {key} at existing files)"
            )
    _say(f"generating the toy corpus in {corpus} ({cfg.data.synth_pairs} training pairs, seed {cfg.train.seed})")
    write_corpus(
        corpus,
        cfg.data.synth_pairs,
        SYNTH_HELD_OUT,
        SYNTH_HELD_OUT,
        cfg.train.seed,
        cfg.data.src_lang,
        cfg.data.tgt_lang,
    )


def _check_present(cfg: Config, splits: list[SplitFiles]) -> None:
    """Every input file the config names exists (that data.train and data.valid name some: `config.validate`)."""
    for s in splits:
        for path in (s.src, s.tgt):
            if not path.is_file():
                langs = "data.directions" if multilingual(cfg.data) else "data.src_lang or data.tgt_lang"
                raise PrepareError(
                    f"missing input file {path}: {s.key} is {str(s.src)[: -len(s.src_lang) - 1]!r}, so prepare "
                    f"reads {s.src} and {s.tgt} (relative to {Path.cwd()}); fix {s.key}, "
                    f"{langs}{_missing_hint(cfg, path)}"
                )


def _missing_hint(cfg: Config, path: Path) -> str:
    """Where the file would come from, said only for the paths tmt's own configs use: one's own data has none."""
    if "toy" in path.parts and not cfg.data.synth:
        return "; for the toy corpus run `tmt synth` or set data.synth: true"
    if "wmt14_en_de" in path.parts or "wmt14_en_fr" in path.parts:
        return f"; fetch it with `tmt download wmt14 --pair {cfg.data.src_lang}-{cfg.data.tgt_lang}`"
    return ""


def _fingerprints(splits: list[SplitFiles], old: Manifest | None, quiet: bool = False) -> dict[str, InputFile]:
    """sha256, line count, size and mtime of each input file.

    A file whose size and mtime match the old manifest keeps its recorded
    hash, so checking an unchanged WMT-size corpus costs no reading.
    """
    known = old.inputs if old is not None else {}
    result = {}
    for path in sorted({p for s in splits for p in (s.src, s.tgt)}):
        st = path.stat()
        prev = known.get(str(path))
        if prev is not None and prev.size == st.st_size and prev.mtime_ns == st.st_mtime_ns:
            result[str(path)] = prev
        else:
            sha256, lines = _hash_file(path, st.st_size, quiet)
            result[str(path)] = InputFile(sha256, lines, st.st_size, st.st_mtime_ns)
    return result


def _hash_file(path: Path, size: int, quiet: bool) -> tuple[str, int]:
    """The sha256 and line count of ``path`` (a last line without a line break counts)."""
    digest, lines, last = hashlib.sha256(), 0, b"\n"
    with (
        open(path, "rb") as f,
        progress(
            total=size, desc=f"hash {path.name}", unit="B", unit_scale=True, leave=False, disable=quiet or None
        ) as bar,
    ):
        while block := f.read(1 << 22):
            digest.update(block)
            lines += block.count(b"\n")
            last = block[-1:]
            bar.update(len(block))
    return digest.hexdigest(), lines + (last != b"\n")


def _check_line_counts(splits: list[SplitFiles], fingerprints: dict[str, InputFile]) -> None:
    for s in splits:
        n_src, n_tgt = fingerprints[str(s.src)].lines, fingerprints[str(s.tgt)].lines
        if n_src != n_tgt:
            raise PrepareError(
                f"{s.key}: {s.src} has {n_src} lines but {s.tgt} has {n_tgt}; line N of one must be the "
                "translation of line N of the other, so fix the files (an extra or missing line break)"
            )


def train_text_files(cfg: Config) -> list[str]:
    """The cleaned training text (one normalized sentence a line, the pairs of the binarized split), source then
    target: kept in ``data.dir`` only with ``bpe.sampling_alpha`` > 0, which re-encodes it every epoch."""
    return [f"train.{cfg.data.src_lang}.txt", f"train.{cfg.data.tgt_lang}.txt"]


def _up_to_date(manifest: Manifest, cfg: Config, fingerprints: dict[str, InputFile]) -> bool:
    return (
        manifest.format == FORMAT_VERSION
        and (cfg.bpe.sampling_alpha <= 0 or all(name in manifest.files for name in train_text_files(cfg)))
        and manifest.config_hash == prepare_hash(cfg)
        and {k: v.sha256 for k, v in manifest.inputs.items()} == {k: v.sha256 for k, v in fingerprints.items()}
        and all((Path(cfg.data.dir) / name).is_file() for name in manifest.files)
    )


# ---------------------------------------------------------------- cleaning


def _clean_split(s: SplitFiles, cfg: Config, work: Path, total: int, sample: BpeSample | None) -> SplitStats:
    """Normalize and filter one split into ``work/{split}.{src,tgt}.txt``, adding its sentences to ``sample``.

    Returns the counts: pairs read, kept (``sentences``) and dropped per reason.
    """
    train = s.training
    take_src, take_tgt = (False, False) if sample is None or s.synthetic else (sample.claim(s.src), sample.claim(s.tgt))
    dropped: Counter[str] = Counter()
    read = kept = 0
    src_in, tgt_in = clean.read_lines(s.src), clean.read_lines(s.tgt)
    with (
        open(work / f"{s.name}.src.txt", "w", encoding="utf-8") as fs,
        open(work / f"{s.name}.tgt.txt", "w", encoding="utf-8") as ft,
        progress(total=total, desc=f"clean {s.name}", unit="pairs", leave=False) as bar,
    ):
        for raw_src, raw_tgt in zip(src_in, tgt_in, strict=True):
            read += 1
            if read % 4096 == 0:
                bar.update(4096)
            src, tgt = _clean_pair(raw_src, raw_tgt, s, cfg, dropped, train)
            if src is None:
                continue
            fs.write(src + "\n")
            ft.write(tgt + "\n")
            kept += 1
            if take_src:
                sample.add(s.src_lang, src)
            if take_tgt:
                sample.add(s.tgt_lang, tgt)
        bar.update(read % 4096)
    return SplitStats(read=read, sentences=kept, dropped=dict(dropped))


def _clean_pair(
    raw_src: str, raw_tgt: str, s: SplitFiles, cfg: Config, dropped: Counter, train: bool
) -> tuple[str, str] | tuple[None, None]:
    src, tgt = clean.normalize(raw_src), clean.normalize(raw_tgt)
    if train:
        reason = clean.filter_reason(src, tgt, cfg.data.max_len, cfg.data.max_ratio)
    else:
        reason = clean.EMPTY if not src or not tgt else None
    if reason is not None:
        dropped[reason] += 1
        return None, None
    return src, tgt


class BpeSample:
    """The sentences BPE is learned from: ``bpe.sample_sentences`` of the cleaned training text, seeded.

    One pair: one reservoir over both sides, as always. Several languages:
    an equal share per language, so that the language with the most text
    does not take the vocabulary, and each input file is read into it once
    (a multi-way parallel file serves several directions).
    """

    def __init__(self, cfg: Config) -> None:
        k, seed = cfg.bpe.sample_sentences, cfg.bpe.seed
        if multilingual(cfg.data):
            langs = languages(cfg.data)
            self.pools = {lang: Reservoir(k // len(langs), random.Random(f"{seed}-{lang}")) for lang in langs}
        else:
            one = Reservoir(k, random.Random(seed))
            self.pools = {cfg.data.src_lang: one, cfg.data.tgt_lang: one}
        self.claimed: set[Path] = set()

    def claim(self, path: Path) -> bool:
        """Whether the sentences of input file ``path`` go in: yes the first time it is asked."""
        fresh = path not in self.claimed
        self.claimed.add(path)
        return fresh

    def add(self, lang: str, sentence: str) -> None:
        self.pools[lang].add(sentence)

    def write(self, path: Path) -> int:
        """Write the sample one sentence a line, language after language; returns how many."""
        pools = list({id(pool): pool for pool in self.pools.values()}.values())
        with open(path, "w", encoding="utf-8") as f:
            for pool in pools:
                f.writelines(item + "\n" for item in pool.items)
        return sum(len(pool.items) for pool in pools)


class Reservoir:
    """A uniform random sample of ``k`` items from a stream of unknown length (Li's algorithm L).

    Memory is ``k`` items however long the stream; the random skips make
    adding an item not sampled cost one comparison.
    """

    def __init__(self, k: int, rng: random.Random) -> None:
        self.k, self.rng, self.items, self.seen = k, rng, [], 0
        self._w = math.exp(math.log(self._u()) / k) if k > 0 else 0.0
        self._next = k + self._skip()

    def _u(self) -> float:
        return self.rng.random() or 1e-300

    def _skip(self) -> int:
        return int(math.log(self._u()) / math.log1p(-self._w)) if 0.0 < self._w < 1.0 else 0

    def add(self, item: str) -> None:
        if self.seen < self.k:
            self.items.append(item)
        elif self.seen == self._next and self.k > 0:
            self.items[self.rng.randrange(self.k)] = item
            self._w *= math.exp(math.log(self._u()) / self.k)
            self._next += 1 + self._skip()
        self.seen += 1

    def write(self, path: Path) -> int:
        """Write the sample one item a line; returns how many."""
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(item + "\n" for item in self.items)
        return len(self.items)


def _empty_message(s: SplitFiles, stats: SplitStats) -> str:
    reasons = ", ".join(f"{reason}: {n}" for reason, n in stats.dropped.items()) or "no lines"
    if s.name == "train":
        fix = "relax data.max_len and/or data.max_ratio (e.g. --set data.max_ratio=3), or check the files"
    else:
        fix = f"every pair in {s.src} / {s.tgt} has an empty side; check {s.key}"
    return f"{s.key}: no sentence pairs left after cleaning {stats.read} read ({reasons}); {fix}"


# ---------------------------------------------------------------- output


def _remove_stale_work_dirs(out: Path) -> None:
    """Work directories of runs that were killed (an exception cleans up its own)."""
    for stale in out.glob(".prepare-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _summary(out: Path, manifest: Manifest) -> str:
    given = f" (bpe.model {manifest.bpe_model.path})" if manifest.bpe_model is not None else ""
    lines = [f"prepared {out}: joint BPE vocabulary of {manifest.vocab_size} pieces{given}"]
    for name, st in manifest.splits.items():
        dropped = ", ".join(f"{r}: {n}" for r, n in st.dropped.items()) or "none"
        lines.append(
            f"  {name:5s} {st.sentences:>10,} pairs of {st.read:,} read "
            f"({st.src_tokens:,} source / {st.tgt_tokens:,} target BPE tokens{unk_note(st)}); "
            f"dropped: {dropped}"
        )
    return "\n".join(lines)


def unk_note(split_stats: SplitStats) -> str:
    """``, of them 3 / 0 <unk>`` when a split has tokens the BPE model cannot spell, else "" (and in older manifests)."""
    src, tgt = split_stats.src_unk, split_stats.tgt_unk
    return f", of them {src:,} / {tgt:,} <unk>: characters the BPE model never saw" if src or tgt else ""


def _say(message: str) -> None:
    tqdm.write(message, file=sys.stderr)
