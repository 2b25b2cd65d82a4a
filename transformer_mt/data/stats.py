"""`tmt data-stats`: what the prepared data looks like to the trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from transformer_mt.config import Config
from transformer_mt.data.batching import batch_by_size, ordered_indices, too_long
from transformer_mt.data.bpe import MODEL_NAME, load_bpe
from transformer_mt.data.dataset import ParallelDataset
from transformer_mt.data.directions import TrainPart, directions, mixed, split_name, train_parts, weights
from transformer_mt.data.mix import CorpusMix, temperature_shares, train_mix
from transformer_mt.data.prepare import PrepareError, load_manifest, unk_note

PERCENTILES = (50, 90, 99)


def positions(batches: list[np.ndarray], lens: np.ndarray) -> tuple[int, int]:
    """(real tokens, padded positions = sentences x longest) over ``batches``, for one side."""
    real = sum(int(lens[b].sum()) for b in batches)
    padded = sum(len(b) * int(lens[b].max()) for b in batches if len(b))
    return real, padded


def padding_fraction(batches: list[np.ndarray], src_lens: np.ndarray, tgt_lens: np.ndarray) -> dict[str, float]:
    """Share of padding among the positions of ``batches``: per side and over both sides together."""
    (rs, ps), (rt, pt) = positions(batches, src_lens), positions(batches, tgt_lens)
    return {"src": _share(rs, ps), "tgt": _share(rt, pt), "all": _share(rs + rt, ps + pt)}


def _share(real: int, padded: int) -> float:
    return 1.0 - real / padded if padded else 0.0


def _length_line(name: str, lens: np.ndarray) -> str:
    pct = "  ".join(f"p{p} {int(np.percentile(lens, p))}" for p in PERCENTILES)
    return f"    {name} length (tokens incl. EOS/BOS): mean {lens.mean():.1f}  {pct}  max {int(lens.max())}"


def format_stats(cfg: Config) -> str:
    """A report of every prepared split, and of the training batches at ``train.max_tokens``."""
    manifest = load_manifest(cfg.data.dir)
    if manifest is None:
        raise PrepareError(f"{cfg.data.dir} holds no complete prepared data; run `tmt prepare CONFIG` first")
    d = cfg.data
    lines = [f"{cfg.data.dir}: joint BPE vocabulary {manifest.vocab_size}, ids stored as {manifest.ids_dtype}"]
    sides = {split_name(s, d, way): way for s in ("train", "valid", "test") for way in directions(d)}
    sides |= {part.name: part.direction for part in train_parts(d)}  # synthetic corpora's splits too
    for split, st in manifest.splits.items():
        way = sides.get(split, directions(d)[0])  # a split of another config: DatasetError names its files
        ds = ParallelDataset(d.dir, split, way.src, way.tgt)
        dropped = ", ".join(f"{r} {n}" for r, n in st.dropped.items()) or "none"
        lines.append(
            f"  {split}: {len(ds):,} pairs ({st.read:,} read, dropped: {dropped}); "
            f"{st.src_tokens:,} source / {st.tgt_tokens:,} target BPE tokens{unk_note(st)}"
        )
        lines.append(_length_line("source", ds.src_lens))
        lines.append(_length_line("target", ds.tgt_lens))
    train = _training_set(cfg)
    if isinstance(train, CorpusMix):
        lines.append(shares_line(cfg, train))
    lines.append(_batch_line(cfg, train))
    return "\n".join(lines)


def _training_set(cfg: Config) -> ParallelDataset | CorpusMix:
    """The training pairs: the one pair's, or every part's (directions, synthetic corpora) behind its tags."""
    d = cfg.data
    if not mixed(d):
        return ParallelDataset(d.dir, "train", d.src_lang, d.tgt_lang)
    return train_mix(Path(d.dir), d, load_bpe(Path(d.dir) / MODEL_NAME))


def shares_line(cfg: Config, train: CorpusMix) -> str:
    """Each part's share of an epoch at data.temperature (`temperature_shares`) beside its share of the data, and
    the shares of the corpora marked synthetic and of the rest when some are."""
    t, parts = cfg.data.temperature, train_parts(cfg.data)
    shares = temperature_shares(train.sizes, t, weights(cfg.data))
    each = ", ".join(
        f"{_part_name(part)} {share:.1%} ({size:,} pairs, {size / train.sizes.sum():.1%} of the data)"
        for part, share, size in zip(parts, shares, train.sizes, strict=True)
    )
    line = f"  each epoch at data.temperature={t:g}{' and data.corpora weights' if cfg.data.corpora else ''}: {each}"
    synthetic = sum(share for part, share in zip(parts, shares, strict=True) if part.synthetic)
    # By the config's marks, not by origin: a student's data.train holds a teacher's translations, yet is unmarked.
    marked = f"\n  each epoch: corpora marked synthetic {synthetic:.1%}, the rest (data.train's included) {1 - synthetic:.1%}"
    return line + (marked if synthetic else "")


def _part_name(part: TrainPart) -> str:
    """``en-de``, or for a synthetic corpus ``en-de synthetic (tagged) data/bt``."""
    if not part.synthetic:
        return part.direction.name
    return f"{part.direction.name} synthetic{' (tagged)' if part.tagged else ''} {part.prefix}"


def _batch_line(cfg: Config, ds: ParallelDataset | CorpusMix) -> str:
    max_tokens = cfg.train.max_tokens
    order = ordered_indices(ds.src_lens, ds.tgt_lens, (cfg.train.seed, 1))
    max_len = min(max_tokens, cfg.model.max_positions)  # what training skips, see trainer.max_sentence_len
    batches = batch_by_size(order, ds.src_lens, ds.tgt_lens, max_tokens, max_len)
    pad = padding_fraction(batches, ds.src_lens, ds.tgt_lens)
    sizes = np.array([len(b) for b in batches])
    n_long = int(too_long(ds.src_lens, ds.tgt_lens, max_len).sum())
    return (
        f"  train batches at train.max_tokens={max_tokens}: {len(batches):,} per epoch, "
        f"{sizes.mean():.1f} sentences each on average; padding {pad['all']:.1%} of all positions "
        f"({pad['src']:.1%} of source, {pad['tgt']:.1%} of target); {n_long} sentences longer than {max_len} tokens "
        "(min of train.max_tokens, model.max_positions) skipped"
    )
