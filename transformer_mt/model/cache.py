"""Incremental decoding state for beam search: keys/values stored once, beams followed by ancestry.

Beam search keeps k hypotheses per sentence in k consecutive rows; after each
step the k best extensions replace them, each with any of the k as its parent.
A cache that holds one row of keys/values per hypothesis (fairseq's) must then
copy every hypothesis' past to its new row: a full copy of the self-attention
cache per step into freshly allocated memory, as much memory traffic as the
attention itself. This cache copies nothing when beams are reordered:

- Cross-attention keys/values are computed once per sentence and held once;
  the k beams' queries attend to them side by side
  (`transformer_mt.model.attention.group_queries`).
- Self-attention keys/values are written once, where they were computed: per
  sentence, position and beam slot, in a buffer allocated for the longest
  output the search allows (or grown by doubling when no length is given). A
  hypothesis' history is one slot per position; ``ancestry[s, b, t]`` names
  the slot of position t for the hypothesis now in beam b of sentence s. The
  k queries of a sentence attend to all k*L entries of that sentence, masked
  so that each sees exactly its own history (with k = 1, no mask at all). A
  reorder rewrites only this small (n, k, L) table of slot numbers.
- Sentences that leave the batch are dropped by an index_select over
  sentences, the only copy of cached keys/values.
- Beam search decodes its first step with one hypothesis per sentence (a
  cache of 1 beam), then widens it to k (``reorder(..., beams=k)``): the
  buffers get k slots per position, and every beam's history so far is
  that one hypothesis' slot.

Masked entries get exactly zero attention weight, so each hypothesis attends
to the same keys and values, at the same positions, as with per-row copies.

Sentences may also join a running search (`transformer_mt.decode.continuous`):
`DecoderCache.join` appends them at the current position, which becomes
their start (``starts``). A sentence's queries see nothing before its start
(the mask), its positions count from it (`DecoderCache.offsets`), and the
positions before every sentence's start are dropped once they are half the
cache (`DecoderCache.make_room`), so a server's buffers stay within about
twice its oldest sentence's length instead of growing with its uptime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from transformer_mt.model.attention import additive_mask

MIN_CAPACITY = 16  # positions allocated at least; a full buffer doubles


@dataclass(frozen=True)
class Step:
    """What every decoder layer needs for one cached `decode` call: where the new positions go and what they see."""

    length: int  # positions cached before this call (the position of the first new one)
    beams: int  # k: consecutive rows per sentence
    mask: Tensor | None  # (n, 1, k*T, (length+T)*k) float, added to the scores: 0 or -inf; None: everything
    capacity: int = MIN_CAPACITY  # positions to allocate when the buffers are created


@dataclass
class LayerCache:
    """Keys/values of one decoder layer."""

    self_k: Tensor | None  # (n, H, capacity, k, Dh): positions [:length] written; None before the first step
    self_v: Tensor | None
    cross_k: Tensor  # (n, H, S, Dh), one row per sentence, shared by its beams
    cross_v: Tensor

    def append(self, k: Tensor, v: Tensor, step: Step) -> tuple[Tensor, Tensor]:
        """Store new keys/values (n*k, H, T, Dh) after ``step.length`` positions; return all: (n, H, (length+T)*k, Dh).

        The returned views list each sentence's entries position-major (the k
        slots of position 0, then of position 1, ...), the key order of
        `DecoderCache.step`'s mask; no entry is copied.
        """
        self.self_k = _write(self.self_k, k, step)
        self.self_v = _write(self.self_v, v, step)
        end = step.length + k.shape[2]
        return self.self_k[:, :, :end].flatten(2, 3), self.self_v[:, :, :end].flatten(2, 3)

    def keep_sentences(self, sentences: Tensor, moved: Tensor, length: int) -> None:
        """Keep the sentences ``sentences`` (LongTensor), in that order: the only copy of cached keys/values.

        Only the ``length`` positions written so far are copied, not the whole capacity.
        """
        self.cross_k = _keep_rows(self.cross_k, sentences, moved)
        self.cross_v = _keep_rows(self.cross_v, sentences, moved)
        if self.self_k is not None and self.self_v is not None:
            self.self_k = _keep_rows(self.self_k, sentences, moved, length)
            self.self_v = _keep_rows(self.self_v, sentences, moved, length)

    def join(self, other: LayerCache, length: int) -> None:
        """Append ``other``'s sentences (a fresh cache, nothing written yet) behind these, which have written
        ``length`` positions; the longer source sets the cross-attention width (`DecoderCache.join`).

        Their self-attention entries before ``length`` are zeroed (masked, never NaN); rows come from the room
        `_keep_rows` left in the buffers when there is some, so joins rarely allocate.
        """
        n, m = self.cross_k.shape[0], other.cross_k.shape[0]
        width = max(self.cross_k.shape[2], other.cross_k.shape[2])
        for name in ("cross_k", "cross_v"):
            mine = _with_rows(_widened(getattr(self, name), width), n + m)
            mine[n:] = _widened(getattr(other, name), width)
            setattr(self, name, mine)
        for name in ("self_k", "self_v"):
            buffer = getattr(self, name)
            if buffer is not None:
                grown = _with_rows(buffer, n + m, length)
                grown[n:, :, :length] = 0.0
                setattr(self, name, grown)

    def drop_front(self, dropped: int, length: int) -> None:
        """Move positions [dropped:length] of the self-attention buffers to the front (`DecoderCache.make_room`)."""
        for name in ("self_k", "self_v"):
            buffer = getattr(self, name)
            if buffer is not None:
                buffer[:, :, : length - dropped] = buffer[:, :, dropped:length].clone()

    def widen(self, beams: int, length: int) -> None:
        """Room for ``beams`` slots per position; the ``length`` positions written so far keep their slots.

        The new slots of those positions are zeroed, never left uninitialized:
        a masked entry gets attention weight 0, and 0 times a NaN left in
        fresh memory would still be NaN.
        """
        for name in ("self_k", "self_v"):
            buffer = getattr(self, name)
            if buffer is not None and buffer.shape[3] < beams:
                setattr(self, name, _regrown(buffer, buffer.shape[2], beams, length))


def _moved_rows(rows: Tensor) -> Tensor:
    """The places i where ``rows[i] != i``: the rows a keep has to move."""
    return (rows != torch.arange(rows.numel(), device=rows.device)).nonzero().squeeze(1)


def _keep_rows(buffer: Tensor, rows: Tensor, moved: Tensor, length: int | None = None) -> Tensor:
    """``buffer``'s rows ``rows`` (positions [:length] on dim 2 of a self-attention buffer; all of a cross one).

    When the rows are fewer than the buffer's, in place: the ``moved`` rows
    (`_moved_rows`) are read first, then written to their new places, and the
    result is a view of the buffer's first rows. Beam search keeps most
    sentences where they are (`search.kept_sentences`), so dropping f
    sentences copies f rows, not the whole cache. More rows than the buffer
    has (repeated sentences) take a new buffer of the same capacity.
    """
    positions = (slice(None), slice(0, length))  # dims 1 and 2: positions [:length], or all of them
    if rows.numel() <= buffer.shape[0]:
        if moved.numel() > 0:  # the right side is gathered before anything is written
            buffer[(moved, *positions)] = buffer[(rows.index_select(0, moved), *positions)]
        return buffer[: rows.numel()]
    kept = buffer.new_empty(rows.numel(), *buffer.shape[1:])
    torch.index_select(buffer[(slice(None), *positions)], 0, rows, out=kept[(slice(None), *positions)])
    return kept


def _with_rows(buffer: Tensor, rows: int, length: int | None = None) -> Tensor:
    """``buffer`` with ``rows`` rows (dim 0), its first rows kept: a view of its own memory when that has room
    (the rows `_keep_rows` let go), else a new buffer of at least twice the rows. Rows past the old ones are
    unwritten; a self-attention buffer copies only its ``length`` written positions."""
    have = buffer.shape[0]
    if rows <= have:
        return buffer[:rows]
    room = (buffer.untyped_storage().nbytes() // buffer.element_size() - buffer.storage_offset()) // buffer.stride(0)
    if buffer.is_contiguous() and buffer.stride(0) == buffer[0].numel() and rows <= room:
        return buffer.as_strided((rows, *buffer.shape[1:]), buffer.stride())
    grown = buffer.new_empty(max(rows, 2 * have), *buffer.shape[1:])
    positions = (slice(None), slice(None), slice(0, length))  # all of a cross-attention buffer
    grown[:have][positions] = buffer[positions]
    return grown[:rows]


def _widened(buffer: Tensor, width: int) -> Tensor:
    """A cross-attention buffer (n, H, S, Dh) zero-padded to ``width`` source positions (masked by the caller)."""
    if buffer.shape[2] >= width:
        return buffer
    wide = buffer.new_zeros(*buffer.shape[:2], width, buffer.shape[3])
    wide[:, :, : buffer.shape[2]] = buffer
    return wide


def _regrown(buffer: Tensor, positions: int, slots: int, length: int) -> Tensor:
    """A new self-attention buffer (n, H, positions, slots, Dh) holding ``buffer``'s first ``length`` positions.

    The slots ``buffer`` did not have are zeroed at those positions (`LayerCache.widen`); everything past
    ``length`` is left unwritten, to be written before it is read.
    """
    n, H, _, old_slots, Dh = buffer.shape
    grown = buffer.new_empty(n, H, positions, slots, Dh)
    grown[:, :, :length, :old_slots] = buffer[:, :, :length]
    if slots > old_slots:
        grown[:, :, :length, old_slots:] = 0.0
    return grown


def _write(buffer: Tensor | None, new: Tensor, step: Step) -> Tensor:
    """``buffer`` with ``new`` (n*k, H, T, Dh) written at positions length .. length+T-1, grown first if too short."""
    rows, H, T, Dh = new.shape
    end = step.length + T
    if buffer is None:
        buffer = new.new_empty(rows // step.beams, H, max(end, step.capacity), step.beams, Dh)
    elif buffer.shape[2] < end:
        buffer = _regrown(buffer, max(end, 2 * buffer.shape[2]), step.beams, step.length)
    new = new.unflatten(0, (rows // step.beams, step.beams))  # (n, k, H, T, Dh)
    if T == 1:  # a beam step: one position, copied as a 4-d view (the 5-d strided copy took twice as long)
        buffer.select(2, step.length).copy_(new.select(3, 0).transpose(1, 2))
    else:
        buffer[:, :, step.length : end] = new.permute(0, 2, 3, 1, 4)
    return buffer


@dataclass
class DecoderCache:
    """Incremental decoding state of n sentences x k beams, passed explicitly to `Transformer.decode`.

    Row r of a decode batch is beam r % k of sentence r // k. `reorder` after
    each beam step rewrites the ancestry table only (see the module docstring).
    """

    layers: list[LayerCache]
    cross_mask: Tensor | None  # (n, 1, 1, S) float, 0 where attending is allowed, -inf at padding; None: no padding
    beams: int  # k: rows per sentence
    ancestry: Tensor  # (n, k, length) long: the slot holding each position of each beam's history
    capacity: int = MIN_CAPACITY  # target positions to allocate at the first step (more are added by doubling)
    starts: Tensor | None = None  # (n,) long: the position of each sentence's BOS (`join`); None: all 0

    @property
    def length(self) -> int:
        """Target positions already cached (the position offset of the next step)."""
        return self.ancestry.shape[2]

    @property
    def rows(self) -> int:
        """Rows a `decode` batch must have: sentences x beams."""
        return self.ancestry.shape[0] * self.beams

    def step(self, new: int) -> Step:
        """The `Step` of a decode call with ``new`` positions, its self-attention mask built once for all layers.

        Query (beam b, new position j) may attend to the entry (position t,
        slot c) when t <= length + j and c is the slot of position t in the
        history of beam b (its own slot for the new positions).
        """
        n, k, length = self.ancestry.shape
        if k == 1 and new == 1 and self.starts is None:
            return Step(length, k, None, self.capacity)  # one query per sentence, its whole history: no mask
        slots = torch.arange(k, device=self.ancestry.device)
        history = self._history(new)[:, :, None, :, None] == slots  # (n, k, 1, length+new, k)
        positions = torch.arange(length + new, device=self.ancestry.device)
        causal = positions[None, :] <= (length + positions[:new])[:, None]  # (new, length+new)
        mask = history & causal[None, None, :, :, None]  # (n, k, new, length+new, k)
        if self.starts is not None:  # nothing before a sentence's own BOS
            mask &= (positions >= self.starts[:, None])[:, None, None, :, None]
        return Step(length, k, additive_mask(mask.view(n, 1, k * new, (length + new) * k)), self.capacity)

    def offsets(self) -> int | Tensor:
        """The position of the next step's first new entry in each row's own sequence: ``length``, or with
        ``starts`` (rows,) ``length`` minus its sentence's start."""
        if self.starts is None:
            return self.length
        return (self.length - self.starts).repeat_interleave(self.beams)

    def join(self, other: DecoderCache) -> DecoderCache:
        """Append the sentences of ``other`` (a fresh cache of as many beams, nothing decoded yet), starting at
        the current position; in place, returns self. Rows of the next `decode` are these sentences', then
        ``other``'s. The cross-attention width becomes the longer source's, padding masked."""
        if other.length or other.beams != self.beams:
            raise ValueError(
                f"join takes a fresh cache of {self.beams} beams, got {other.beams} beams, length {other.length}"
            )
        n, m, length = self.ancestry.shape[0], other.ancestry.shape[0], self.length
        width = max(self.layers[0].cross_k.shape[2], other.layers[0].cross_k.shape[2])
        device = self.ancestry.device
        masks = [_padded_mask(c.cross_mask, c.layers[0].cross_k, width) for c in (self, other)]
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.join(theirs, length)
        self.cross_mask = torch.cat(masks)
        starts = torch.zeros(n, dtype=torch.long, device=device) if self.starts is None else self.starts
        self.starts = torch.cat([starts, torch.full((m,), length, dtype=torch.long, device=device)])
        past = torch.zeros(m, self.beams, length, dtype=torch.long, device=device)  # masked: before their start
        self.ancestry = torch.cat([self.ancestry, past])
        return self

    def make_room(self) -> int:
        """Drop the positions before every sentence's start, which no query reads any more, once they are half
        of the positions cached (each step's self-attention reads them all, masked). Returns how many were
        dropped: the caller's position-aligned state drops as many. Without it, a search that sentences keep
        joining would grow its buffers, and each step's attention, with its lifetime; so attention reads at
        most twice the positions of its oldest sentence, and the copy happens at most once per that many steps.
        """
        buffer = self.layers[0].self_k
        if self.starts is None or buffer is None:
            return 0
        dropped = int(self.starts.min())
        if dropped == 0 or 2 * dropped < self.length:
            return 0
        for layer in self.layers:
            layer.drop_front(dropped, self.length)
        self.ancestry = self.ancestry[:, :, dropped:]
        self.starts = self.starts - dropped
        return dropped

    def advance(self, new: int) -> None:
        """Record ``new`` positions written by every layer, each beam in its own slot."""
        self.ancestry = self._history(new)

    def _history(self, new: int) -> Tensor:
        """(n, k, length+new): the ancestry followed by each beam's own slot for the new positions."""
        n, k, _ = self.ancestry.shape
        own = torch.arange(k, device=self.ancestry.device).view(1, k, 1).expand(n, k, new)
        return torch.cat([self.ancestry, own], dim=2)

    def reorder(self, index: Tensor, sentences: Tensor | None = None, beams: int | None = None) -> DecoderCache:
        """Row r now continues the hypothesis of old row ``index[r]`` (LongTensor); in place, returns self.

        Beam search calls this after each step with the parent of each new
        beam. Beams stay within their sentence: ``index[r] // k`` must be
        sentence ``r // k'`` or, when ``sentences`` (n',) is given to drop
        (or repeat) sentences, sentence ``sentences[r // k']``, where k' is
        ``beams`` (more rows per sentence from now on; the search starts each
        sentence with one) or k. Only when sentences are dropped or repeated
        are cached keys/values copied, once per kept sentence.
        """
        n, k, length = self.ancestry.shape
        wider = k if beams is None else beams
        if wider < k:
            raise ValueError(f"reorder can give a sentence more beams, not fewer: {k} -> {wider}")
        kept = torch.arange(n, device=index.device) if sentences is None else sentences
        _check_within_sentences(index, kept, k, wider)
        self.ancestry = self.ancestry.flatten(0, 1).index_select(0, index).view(kept.numel(), wider, length)
        if sentences is not None:
            moved = _moved_rows(sentences)  # the same for every layer
            for layer in self.layers:
                layer.keep_sentences(sentences, moved, length)
            if self.cross_mask is not None:
                self.cross_mask = self.cross_mask.index_select(0, sentences)
            if self.starts is not None:
                self.starts = self.starts.index_select(0, sentences)
        if wider > k:
            for layer in self.layers:
                layer.widen(wider, length)
            self.beams = wider
        return self


def _padded_mask(mask: Tensor | None, cross_k: Tensor, wider: int) -> Tensor:
    """The cross-attention mask of keys ``cross_k`` (n, H, S, Dh), (n, 1, 1, S) or None for no padding, as
    (n, 1, 1, wider): -inf past S."""
    n, _, width, _ = cross_k.shape
    padded = torch.full((n, 1, 1, wider), float("-inf"), device=cross_k.device)
    padded[..., :width] = 0.0 if mask is None else mask
    return padded


def _check_within_sentences(index: Tensor, kept: Tensor, k: int, wider: int) -> None:
    """Refuse an index that moves a row to another sentence: the cache holds one ancestry per sentence.

    ``index`` has ``wider`` rows per kept sentence and points at rows of k per sentence.
    """
    expected = kept.repeat_interleave(wider)
    if index.shape != expected.shape:
        raise ValueError(f"reorder got {index.numel()} rows for {kept.numel()} sentences x {wider} beams")
    sentence = index.div(k, rounding_mode="floor")
    if not torch.equal(sentence, expected):  # one check per beam step; the details only on failure
        r = int((sentence != expected).nonzero()[0])
        raise ValueError(
            f"reorder moves row {int(index[r])} (sentence {int(index[r]) // k}) to row {r} of sentence "
            f"{int(expected[r])}; a beam continues a hypothesis of its own sentence, and sentences are dropped or "
            "repeated only through `sentences`"
        )
