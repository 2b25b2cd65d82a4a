"""The epoch's batches: which batches each update trains on, and the position in the epoch after it.

An epoch's batch order is a pure function of the seed, the epoch and what
`batching_key` records (`epoch_batches`), so a position, (epoch, batches of
it consumed), is all a checkpoint needs to go on with the same batches. With
``bpe.sampling_alpha`` > 0 the epoch's training set itself is re-encoded
(`transformer_mt.data.bpe_dropout`), also from (seed, epoch) alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from transformer_mt.config import Config
from transformer_mt.cpus import choose_threads
from transformer_mt.data.batching import epoch_batches
from transformer_mt.data.dataset import Batch, ParallelDataset, collate, pad_to_multiple
from transformer_mt.data.directions import weights
from transformer_mt.data.mix import CorpusMix, epoch_selection
from transformer_mt.train.build import RunData
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.step import TrainError

Pairs = ParallelDataset | CorpusMix
Group = tuple[list[np.ndarray], int, int]  # one update's batch indices, and the (epoch, position) after it


class Epochs:
    """This rank's batches, epoch by epoch, computed once per epoch (seconds on WMT's 4.5M sentences)."""

    def __init__(self, cfg: Config, env: DistEnv, data: RunData) -> None:
        self.cfg, self.env, self.data = cfg, env, data
        self._cache: dict[int, list[np.ndarray]] = {}  # the current and the next epoch (batches are read ahead)
        self._sampled: dict[int, Pairs] = {}  # bpe.sampling_alpha or data.temperature: those epochs' training sets

    def dataset(self, epoch: int) -> Pairs:
        """The training set of ``epoch``: the prepared one, with ``bpe.sampling_alpha`` its own encoding, with
        ``data.directions`` the pairs it draws from each direction."""
        alpha = self.cfg.bpe.sampling_alpha
        if isinstance(self.data.train, CorpusMix):
            return self._mixed(epoch, self.data.train)
        if alpha <= 0:
            return self.data.train
        if epoch in self._sampled:
            return self._sampled[epoch]
        from transformer_mt.data.bpe_dropout import sample_epoch
        from transformer_mt.data.prepare import train_text_files

        text = tuple(self.data.dir / name for name in train_text_files(self.cfg))
        fixed = self.data.train
        workers = self.cfg.data.workers or choose_threads(ranks=self.env.world_size).count  # ranks share hosts
        sampled = sample_epoch(
            self.data.dir, text, alpha, self.cfg.train.seed, epoch, fixed._src_ids.dtype, workers, len(fixed)
        )
        if len(sampled.dataset) != len(fixed):
            raise TrainError(
                f"{self.data.dir}: the training text has {len(sampled.dataset):,} pairs, the prepared ids "
                f"{len(fixed):,}; run `tmt prepare --force CONFIG`"
            )
        if self.env.is_main:
            tokens = int(fixed.src_lens.sum() + fixed.tgt_lens.sum()) - 2 * len(fixed)  # the lengths count EOS/BOS
            more = (sampled.src_tokens + sampled.tgt_tokens) / max(1, tokens)
            tqdm.write(
                f"epoch {epoch}: training text re-encoded with BPE-dropout {alpha:g} in {sampled.seconds:.1f} s "
                f"({len(fixed):,} pairs; {sampled.src_tokens:,} source / {sampled.tgt_tokens:,} target tokens, "
                f"{more - 1:+.1%} on the fixed encoding)",
                file=sys.stderr,
            )
        self._sampled = {e: d for e, d in self._sampled.items() if e >= epoch - 1} | {epoch: sampled.dataset}
        return sampled.dataset

    def _mixed(self, epoch: int, mix: CorpusMix) -> CorpusMix:
        """The directions' pairs ``epoch`` draws at data.temperature (`epoch_selection`); all of them at 1."""
        d = self.cfg.data
        selection = epoch_selection(mix.sizes, d.temperature, self.cfg.train.seed, epoch, weights(d))
        if selection is None:
            return mix
        if epoch not in self._sampled:
            self._sampled = {e: d for e, d in self._sampled.items() if e >= epoch - 1} | {epoch: mix.select(selection)}
        return self._sampled[epoch]

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch``; the epoch before it is the oldest one kept."""
        if epoch in self._cache:
            return self._cache[epoch]
        ds, tc, env = self.dataset(epoch), self.cfg.train, self.env
        batches = epoch_batches(
            ds.src_lens, ds.tgt_lens, tc.max_tokens, tc.seed, epoch, env.rank, env.world_size, self.data.max_len
        )
        if not batches:
            raise TrainError(
                f"{self.data.dir}: no training batch: every sentence is longer than {self.data.max_len} tokens "
                f"(min of train.max_tokens={tc.max_tokens} and model.max_positions={self.cfg.model.max_positions}); "
                "raise train.max_tokens"
            )
        self._cache = {e: b for e, b in self._cache.items() if e >= epoch - 1}
        self._cache[epoch] = batches
        return batches

    def updates(self, epoch: int, position: int) -> Iterator[Group]:
        """This rank's batch groups, one per update, from (epoch, position) on; ends when an epoch limit is hit.

        Each group comes with the position after it: (epoch, batches of it
        consumed). The trainer moves its progress there as it trains on the
        group, not when the group is read (one update ahead, `prefetched`), so
        a checkpoint written after an update records where the next one starts.
        """
        tc = self.cfg.train
        while True:
            batches = self.batches(epoch)
            while position < len(batches):
                group = batches[position : position + tc.update_freq]
                position += len(group)
                yield group, epoch, position
            if tc.max_epochs > 0 and epoch >= tc.max_epochs:
                return  # the trainer names the stop once the last group has trained, not when it is read
            epoch, position = epoch + 1, 0

    def collate(self, item: Group) -> list[Batch | None]:
        """The padded batches of one update (None: an empty shard), pinned on CUDA; run in the background."""
        group, tc = item[0], self.cfg.train
        ds = self.dataset(item[1])  # the epoch's, already built: `updates` cut its batches
        pin = self.env.device.type == "cuda"
        batches: list[Batch | None] = []
        for idx in group:
            if not len(idx):
                batches.append(None)
                continue
            batch = pad_to_multiple(collate(ds, idx), tc.pad_to_multiple, self.cfg.model.max_positions)
            batches.append(batch.pin_memory() if pin else batch)
        return batches
