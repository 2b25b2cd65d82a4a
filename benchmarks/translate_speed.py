"""Beam-search speed: tmt against Hugging Face `generate` on a Marian model of the same shape.

Both decode the same random source batch (64 sentences of 10-40 tokens,
vocabulary 8000) with beam 4 in one batch, and both are forced to produce
exactly ``--length`` tokens per sentence (90 by default, EOS included) by
suppressing EOS until then, so the work is identical whatever the (random) weights prefer:
tmt through a wrapper that gives EOS a logit of -1e4 (EOS is then only taken
when the search forces it at the maximum length), HF with ``min_new_tokens``.
Reported: sentences/s and target tokens/s, the median of ``--repeats`` runs
taken alternately, and the tmt/HF ratio (compare ratios: this machine's runs
vary by 10-25%).

    python benchmarks/translate_speed.py --shape tiny
    python benchmarks/translate_speed.py --shape base --repeats 3
    python benchmarks/translate_speed.py --checkpoint runs/base/average.pt --natural

The peer needs `pip install transformers` (not a tmt dependency); without it
only tmt is measured. ``--natural`` also times tmt at natural output lengths
(meaningful with a trained ``--checkpoint``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_mt.config import ModelConfig  # noqa: E402
from transformer_mt.data.bpe import BOS, EOS, PAD  # noqa: E402
from transformer_mt.decode.search import beam_search  # noqa: E402
from transformer_mt.model.transformer import Transformer, count_parameters  # noqa: E402

SHAPES = {
    "tiny": dict(d_model=256, d_ff=1024, heads=4, encoder_layers=3, decoder_layers=3),
    "base": dict(d_model=512, d_ff=2048, heads=8, encoder_layers=6, decoder_layers=6),
}


class NoEarlyEos:
    """Wraps a model so that EOS is (almost) never chosen before the search forces it at the maximum length."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def encode(self, src: torch.Tensor) -> Any:
        return self.model.encode(src)

    def init_cache(self, enc: Any, beams: int = 1, capacity: int = 16) -> Any:
        return self.model.init_cache(enc, beams, capacity)

    def decode(self, tgt_in: torch.Tensor, enc: Any, cache: Any = None) -> torch.Tensor:
        logits = self.model.decode(tgt_in, enc, cache)
        logits[..., EOS] = -1e4
        return logits


def random_sources(n: int, vocab: int, seed: int) -> torch.Tensor:
    """n sentences of 10-40 random tokens + EOS, right-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 41, (n,), generator=g)
    src = torch.full((n, int(lengths.max()) + 1), PAD, dtype=torch.long)
    for i, n_tok in enumerate(lengths.tolist()):
        src[i, :n_tok] = torch.randint(4, vocab, (n_tok,), generator=g)
        src[i, n_tok] = EOS
    return src


def tmt_model(args: argparse.Namespace) -> tuple[Transformer, int]:
    if args.checkpoint:
        from transformer_mt.decode.translate import Translator

        translator = Translator.from_checkpoints([args.checkpoint], device=args.device)
        return translator.model, translator.bpe.get_piece_size()
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[args.shape], dropout=0.0, max_positions=1024)
    return Transformer(cfg, args.vocab).eval().to(args.device), args.vocab


def hf_marian(cfg: ModelConfig, vocab: int, device: str) -> Any:
    """A Marian model of tmt's shape: post-norm, sinusoidal positions, scaled and tied embeddings, ReLU."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab, d_model=cfg.d_model, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function="relu", dropout=0.0,
        max_position_embeddings=1024, scale_embedding=True, share_encoder_decoder_embeddings=True,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS, bos_token_id=BOS, forced_eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    return MarianMTModel(config).eval().to(device)


def time_tmt(model: Any, src: torch.Tensor, args: argparse.Namespace, forced: bool) -> tuple[float, int]:
    start = time.perf_counter()
    out = beam_search(
        NoEarlyEos(model) if forced else model, src, beam_size=args.beam, len_penalty=0.6,
        max_len_a=0.0 if forced else 1.0, max_len_b=args.length - 1 if forced else 50, max_positions=1024,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    return seconds, sum(len(h[0].tokens) + 1 for h in out)  # + EOS


def time_hf(model: Any, src: torch.Tensor, args: argparse.Namespace) -> tuple[float, int]:
    mask = src.ne(PAD)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=src, attention_mask=mask, num_beams=args.beam, max_new_tokens=args.length,
            min_new_tokens=args.length, length_penalty=0.6, do_sample=False, early_stopping=False,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    return seconds, int(out[:, 1:].ne(PAD).sum())


def report(name: str, runs: list[tuple[float, int]], n: int) -> float:
    seconds = statistics.median(r[0] for r in runs)
    tokens = runs[0][1]
    print(f"{name:22s} {n / seconds:8.2f} sent/s {tokens / seconds:10.1f} tgt tok/s  ({tokens} tokens, "
          f"median of {len(runs)}: {seconds:.2f} s)")  # fmt: skip
    return n / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="random model of this shape")
    parser.add_argument("--checkpoint", help="a tmt checkpoint instead of a random model")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--length", type=int, default=90, help="forced output tokens per sentence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--natural", action="store_true", help="also time tmt at natural output lengths")
    parser.add_argument("--no-peer", action="store_true", help="skip Hugging Face")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, vocab = tmt_model(args)
    src = random_sources(args.sentences, vocab, seed=1).to(args.device)
    peer = None
    if not args.no_peer:
        try:
            peer = hf_marian(model.cfg, vocab, args.device)
        except ImportError:
            print("transformers is not installed (pip install transformers): measuring tmt only", file=sys.stderr)
    print(f"device {args.device}, {torch.get_num_threads()} threads; model {count_parameters(model) / 1e6:.1f}M "
          f"parameters; {args.sentences} sentences, beam {args.beam}, {args.length} forced output tokens")  # fmt: skip
    time_tmt(model, src[:4], args, forced=True)  # warm-up
    if peer is not None:
        time_hf(peer, src[:4], args)
    tmt_runs, hf_runs, natural_runs = [], [], []
    for _ in range(args.repeats):
        tmt_runs.append(time_tmt(model, src, args, forced=True))
        if peer is not None:
            hf_runs.append(time_hf(peer, src, args))
        if args.natural:
            natural_runs.append(time_tmt(model, src, args, forced=False))
    tmt_rate = report("tmt beam_search", tmt_runs, args.sentences)
    if peer is not None:
        hf_rate = report("HF Marian generate", hf_runs, args.sentences)
        print(f"ratio tmt / HF: {tmt_rate / hf_rate:.2f}x")
    if natural_runs:
        report("tmt natural length", natural_runs, args.sentences)


if __name__ == "__main__":
    main()
