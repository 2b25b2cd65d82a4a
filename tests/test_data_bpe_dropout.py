"""bpe.sampling_alpha: subword regularization (BPE-dropout) re-encodes the training text every epoch.

Against its definition: off (0) changes nothing, neither the prepared data nor the batches or the losses; on,
each epoch's encoding differs from the others and from the fixed one, spells the same text, is the same for the
same seed on every rank, decides the epoch's batches by its own lengths, and a resumed run stays bit-exact.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_state, metric_records

from transformer_mt.config import Config, ConfigError, load_config
from transformer_mt.data.batching import epoch_batches
from transformer_mt.data.bpe import load_bpe
from transformer_mt.data.bpe_dropout import BpeDropout, chunk_seed, sample_epoch
from transformer_mt.data.prepare import is_prepared, load_manifest, prepare_data, prepare_hash, train_text_files
from transformer_mt.run_names import checkpoint_name
from transformer_mt.train.build import load_run_data
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.epochs import Epochs
from transformer_mt.train.run_files import batching_changes, batching_key
from transformer_mt.train.trainer import train_model

ALPHA = 0.1
CPU = torch.device("cpu")


def _with(cfg: Config, alpha: float, **train) -> Config:
    train = {"num_threads": 1, **train}
    return dataclasses.replace(
        cfg,
        bpe=dataclasses.replace(cfg.bpe, sampling_alpha=alpha),
        train=dataclasses.replace(cfg.train, **train),
    )


@pytest.fixture(scope="module")
def sampled_toy(prepared_toy: Config, tmp_path_factory) -> Config:
    """The toy corpus prepared again with bpe.sampling_alpha, into its own data.dir."""
    root = tmp_path_factory.mktemp("sampled")
    cfg = _with(prepared_toy, ALPHA)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(root / "prepared")))
    prepare_data(cfg)
    return cfg


def _text(cfg: Config) -> tuple[Path, Path]:
    src, tgt = train_text_files(cfg)
    return Path(cfg.data.dir) / src, Path(cfg.data.dir) / tgt


def _epochs(cfg: Config, rank: int = 0, world_size: int = 1) -> Epochs:
    env = DistEnv(rank, world_size, rank, CPU, rank == 0)
    return Epochs(cfg, env, load_run_data(cfg, env))


def test_the_key_is_off_by_default_and_in_the_paper_configs():
    for name in (None, "tmt:base.yaml", "tmt:big.yaml", "tmt:multi30k.yaml"):
        assert load_config(name).bpe.sampling_alpha == 0.0
    with pytest.raises(ConfigError, match=r"bpe.sampling_alpha must be in \[0, 1\)"):
        load_config(None, ["bpe.sampling_alpha=1.5"])


def test_off_keeps_the_prepared_data_and_batches(prepared_toy):
    """alpha 0 is today's run: the same prepare hash, no text kept, the prepared ids and the same batch key."""
    manifest = load_manifest(prepared_toy.data.dir)
    assert manifest.config_hash == prepare_hash(prepared_toy)
    assert not set(train_text_files(prepared_toy)) & set(manifest.files)
    epochs = _epochs(_with(prepared_toy, 0.0))
    assert epochs.dataset(1) is epochs.data.train and epochs.dataset(2) is epochs.data.train
    ds, tc = epochs.data.train, prepared_toy.train
    expected = epoch_batches(ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, 2, 0, 1, epochs.data.max_len)
    assert all(np.array_equal(a, b) for a, b in zip(epochs.batches(2), expected, strict=True))
    lens = np.array([3, 4, 5])
    assert "sampling_alpha" not in batching_key(lens, lens, 512, 1, 256, 0.0).to_dict()


def test_the_alpha_does_not_make_prepared_data_stale_but_the_missing_text_does(prepared_toy, sampled_toy):
    assert prepare_hash(_with(prepared_toy, ALPHA)) == prepare_hash(prepared_toy)  # the value is read when training
    assert is_prepared(sampled_toy) and all(p.is_file() for p in _text(sampled_toy))
    assert set(train_text_files(sampled_toy)) <= set(load_manifest(sampled_toy.data.dir).files)
    # a data.dir prepared without the text: up to date with alpha 0, not with alpha > 0
    assert is_prepared(prepared_toy) and not is_prepared(_with(prepared_toy, ALPHA))


def test_the_kept_text_is_the_cleaned_text_of_the_prepared_ids(sampled_toy):
    sp = load_bpe(Path(sampled_toy.data.dir) / "spm.model")
    ds = _epochs(sampled_toy).data.train
    src, tgt = (path.read_text(encoding="utf-8").splitlines() for path in _text(sampled_toy))
    assert len(src) == len(tgt) == len(ds)
    assert [sp.decode(ds.src_ids(i).tolist()) for i in range(0, len(ds), 37)] == src[::37]
    assert [sp.decode(ds.tgt_ids(i).tolist()) for i in range(0, len(ds), 37)] == tgt[::37]


def test_epochs_differ_repeat_for_the_same_seed_and_decode_to_the_same_text(sampled_toy):
    data_dir, text, dtype = sampled_toy.data.dir, _text(sampled_toy), np.uint16
    one, again = (sample_epoch(data_dir, text, ALPHA, 1, 1, dtype).dataset for _ in range(2))
    two = sample_epoch(data_dir, text, ALPHA, 1, 2, dtype).dataset
    other_seed = sample_epoch(data_dir, text, ALPHA, 2, 1, dtype).dataset
    fixed = _epochs(sampled_toy).data.train
    for side in ("_src_ids", "_src_off", "_tgt_ids", "_tgt_off"):
        assert np.array_equal(getattr(one, side), getattr(again, side)), side
    n = len(fixed)
    assert len(one) == len(two) == n

    def rows(ds, side):
        return [getattr(ds, side)(i).tolist() for i in range(n)]

    for side in ("src_ids", "tgt_ids"):
        a, b, c, f = rows(one, side), rows(two, side), rows(other_seed, side), rows(fixed, side)
        assert sum(x != y for x, y in zip(a, b, strict=True)) > n // 10  # epochs differ
        assert sum(x != y for x, y in zip(a, c, strict=True)) > n // 10  # seeds differ
        assert sum(x != y for x, y in zip(a, f, strict=True)) > n // 10  # not the fixed encoding
    assert one.src_lens.sum() > fixed.src_lens.sum()  # dropped merges: more, shorter pieces
    sp = load_bpe(Path(data_dir) / "spm.model")
    assert [sp.decode(one.src_ids(i).tolist()) for i in range(n)] == [
        sp.decode(fixed.src_ids(i).tolist()) for i in range(n)
    ]
    assert [sp.decode(two.tgt_ids(i).tolist()) for i in range(n)] == [
        sp.decode(fixed.tgt_ids(i).tolist()) for i in range(n)
    ]


def test_worker_processes_give_the_same_epoch(sampled_toy, monkeypatch):
    from transformer_mt.data import binarize, bpe_dropout

    monkeypatch.setattr(binarize, "CHUNK_PAIRS", 300)  # 7 chunks of the 2000 pairs, cut in this process
    monkeypatch.setattr(bpe_dropout, "PARALLEL_PAIRS", 0)
    args = (sampled_toy.data.dir, _text(sampled_toy), ALPHA, 1, 3, np.uint16)
    serial = sample_epoch(*args).dataset
    parallel = sample_epoch(*args, workers=2, pairs=2000).dataset
    for side in ("_src_ids", "_src_off", "_tgt_ids", "_tgt_off"):
        assert np.array_equal(getattr(serial, side), getattr(parallel, side)), side


def test_chunk_seeds_differ_by_seed_epoch_chunk_and_side():
    seeds = {chunk_seed(s, e, c, side) for s in (1, 2) for e in (1, 2) for c in range(3) for side in (0, 1)}
    assert len(seeds) == 24 and chunk_seed(-1, 1, 0, 0) == chunk_seed(-1, 1, 0, 0)


def test_without_dropout_the_encoding_is_sentencepiece_s(sampled_toy):
    """`BpeDropout` at alpha 0 is sentencepiece's BPE, id for id, on the whole corpus; unknown characters too."""
    sp = load_bpe(Path(sampled_toy.data.dir) / "spm.model")
    bpe = BpeDropout(sp)
    lines = [line for path in _text(sampled_toy) for line in path.read_text(encoding="utf-8").splitlines()]
    lines += ["", "x", "Ein  Mann", "ein \u00e6\u00e6 Haus \u4e2d", "\u2603"]  # empty, doubled space, <unk> runs
    assert [bpe.encode(line, 0.0, random.Random(0)) for line in lines] == sp.encode(lines, out_type=int)


def test_the_dropout_rule_is_sentencepiece_s(sampled_toy):
    """The same rule as sentencepiece's sampling (its draws differ): as many more pieces on average, within 1%."""
    sp = load_bpe(Path(sampled_toy.data.dir) / "spm.model")
    bpe, rng = BpeDropout(sp), random.Random(0)
    lines = _text(sampled_toy)[1].read_text(encoding="utf-8").splitlines()
    fixed = sum(map(len, sp.encode(lines, out_type=int)))
    ours = sum(len(bpe.encode(line, 0.3, rng)) for line in lines)
    theirs = sum(map(len, sp.encode(lines, out_type=int, enable_sampling=True, alpha=0.3, nbest_size=-1)))
    assert ours > 1.1 * fixed and ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.slow
def test_the_draws_are_the_same_in_another_process(sampled_toy):
    """What a resumed run needs, and what sentencepiece's own sampling does not give (its seed holds per process)."""
    code = (
        "import sys, numpy as np; from pathlib import Path; from transformer_mt.data.bpe_dropout import sample_epoch; "
        "d = sys.argv[1]; ds = sample_epoch(d, (Path(sys.argv[2]), Path(sys.argv[3])), 0.1, 1, 2, np.uint16).dataset; "
        "sys.stdout.write(ds._src_ids.tobytes().hex() + ' ' + ds._tgt_ids.tobytes().hex())"
    )
    src, tgt = _text(sampled_toy)
    out = subprocess.run(
        [sys.executable, "-c", code, sampled_toy.data.dir, str(src), str(tgt)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    here = sample_epoch(sampled_toy.data.dir, (src, tgt), 0.1, 1, 2, np.uint16).dataset
    assert out == here._src_ids.tobytes().hex() + " " + here._tgt_ids.tobytes().hex()


def test_batches_follow_the_sampled_lengths_and_every_rank_sees_the_same_epoch(sampled_toy):
    tc, epochs = sampled_toy.train, _epochs(sampled_toy)
    ds = epochs.dataset(2)
    assert ds is not epochs.data.train and epochs.dataset(2) is ds  # built once per epoch
    expected = epoch_batches(ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, 2, 0, 1, epochs.data.max_len)
    assert all(np.array_equal(a, b) for a, b in zip(epochs.batches(2), expected, strict=True))
    batch = epochs.collate(([epochs.batches(2)[0]], 2, 1))[0]
    first = epochs.batches(2)[0]
    assert batch.src.shape[1] == ds.src_lens[first].max() and batch.tgt_in.shape[1] == ds.tgt_lens[first].max()
    ranks = [_epochs(sampled_toy, rank, 2) for rank in (0, 1)]
    for rank, e in enumerate(ranks):
        assert np.array_equal(e.dataset(2)._tgt_ids, ds._tgt_ids)  # the same sampled epoch ...
        shard = epoch_batches(ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, 2, rank, 2, epochs.data.max_len)
        assert all(np.array_equal(a, b) for a, b in zip(e.batches(2), shard, strict=True))  # ... its own shard
    seen = np.sort(np.concatenate([b for e in ranks for b in e.batches(2)]))
    assert np.array_equal(seen, np.sort(np.concatenate(epochs.batches(2))))


def test_a_change_of_alpha_is_named_on_resume():
    lens = np.array([3, 4, 5])
    assert batching_changes(batching_key(lens, lens, 512, 1, 256), batching_key(lens, lens, 512, 1, 256, 0.1)) == [
        "bpe.sampling_alpha was 0, now 0.1"
    ]


@pytest.mark.slow
def test_resume_with_sampling_is_bit_identical(sampled_toy, tmp_path, capsys):
    """8 updates, stop, resume, 8 more == 16 straight, crossing into the second (re-encoded) epoch."""
    common = dict(max_tokens=4096, update_freq=2, validate_every=100, save_every_updates=4, log_every=4, keep_last=50)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train_model(_with(sampled_toy, ALPHA, save_dir=str(straight), max_updates=16, **common))
    train_model(_with(sampled_toy, ALPHA, save_dir=str(interrupted), max_updates=8, **common))
    capsys.readouterr()
    result = train_model(_with(sampled_toy, ALPHA, save_dir=str(interrupted), max_updates=16, **common))
    err = capsys.readouterr().err
    assert "resuming from" in err and "training text re-encoded with BPE-dropout 0.1" in err
    assert result.epoch >= 2
    a = load_state(straight / checkpoint_name(16))
    b = load_state(interrupted / checkpoint_name(16))
    assert (a["epoch"], a["batch_in_epoch"]) == (b["epoch"], b["batch_in_epoch"])
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key

    def losses(run):
        return [(m["update"], m["loss"]) for m in metric_records(run) if m["kind"] == "train"]

    assert losses(interrupted) == losses(straight)
