"""Beam-search speed: tmt (fp32 and int8) against CTranslate2 (fp32 and int8) and Hugging Face `generate`.

All engines decode the same random source batch (64 sentences of 10-40
tokens, vocabulary 8000) with beam 4 in one batch, and all are forced to
produce exactly ``--length`` tokens per sentence (90 by default, EOS
included) so the work is identical whatever the (random) weights prefer:
tmt through a wrapper that gives EOS a logit of -1e4 (EOS is then only taken
when the search forces it at the maximum length), CTranslate2 with
``min_decoding_length = max_decoding_length``, HF with ``min_new_tokens``.

CTranslate2 runs the same weights: the tmt model is converted by the
converter of `tmt export ctranslate2` (fp32, and again with
``--quantization int8``). tmt int8 is ``decode.quantize: int8``. The HF peer is
a Marian model of the same shape with its own random weights.

Each engine runs in a process of its own (two OpenMP runtimes in one process
slow each other down), and the processes take turns: engine A, B, C, D, then
A again ..., one at a time, so that a machine busy with other work slows
every engine alike. Reported: sentences/s and target tokens/s per engine,
each the median of ``--repeats`` runs, and the ratios of tmt to each peer
from those medians.

    python benchmarks/translate_speed.py --shape tiny --threads 1
    python benchmarks/translate_speed.py --shape base --repeats 3
    python benchmarks/translate_speed.py --checkpoint runs/base/average.pt --natural
    python benchmarks/translate_speed.py --checkpoint runs/m30k/average.pt --text test.en --threads 1

``--text FILE`` (with ``--checkpoint``) times whole `Translator.translate_lines`
calls on real text instead, at natural output lengths: tmt's own engine on
the checkpoint against ``--engine ctranslate2`` on its `tmt export
ctranslate2` directories (fp32 and int8), both with tmt's line handling, BPE
and batches, and the length penalty CTranslate2 implements (``len **
alpha``, ``decode.len_penalty_form: fairseq``). By default the searches
still differ in when they stop: tmt goes on while a live hypothesis could
still win (exact), CTranslate2 stops once k have finished, so tmt decodes
more steps; ``--stopping k_finished`` gives tmt CTranslate2's rule
(``decode.stopping``), and then both decode the same steps.

The peers are optional (pip install -e ".[bench]": ctranslate2, transformers);
a missing one is skipped with a note. ``--natural`` also times tmt at natural
output lengths (meaningful with a trained ``--checkpoint``).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_mt.config import ModelConfig  # noqa: E402
from transformer_mt.data.bpe import BOS, EOS, PAD  # noqa: E402
from transformer_mt.decode.search import beam_search  # noqa: E402
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.malloc import keep_freed_memory  # noqa: E402
from transformer_mt.model.onednn import use_onednn_linears  # noqa: E402
from transformer_mt.model.quantize import quantize_int8  # noqa: E402
from transformer_mt.model.transformer import Transformer, count_parameters  # noqa: E402

SHAPES = {
    "tiny": dict(d_model=256, d_ff=1024, heads=4, encoder_layers=3, decoder_layers=3),
    "base": dict(d_model=512, d_ff=2048, heads=8, encoder_layers=6, decoder_layers=6),
}

Timer = Callable[[torch.Tensor], tuple[float, int]]  # source batch -> (seconds, target tokens)


class NoEarlyEos:
    """Wraps a model so that EOS is (almost) never chosen before the search forces it at the maximum length."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def encode(self, src: torch.Tensor) -> Any:
        return self.model.encode(src)

    def init_cache(self, enc: Any, beams: int = 1, capacity: int = 16) -> Any:
        return self.model.init_cache(enc, beams, capacity)

    def decode_features(self, tgt_in: torch.Tensor, enc: Any, cache: Any = None) -> torch.Tensor:
        return self.model.decode_features(tgt_in, enc, cache)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(x)
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


def tmt_model(args: argparse.Namespace, quantize: str = "none") -> tuple[Transformer, list[str]]:
    """The model as `tmt translate` decodes with it (``quantize``: decode.quantize), and its vocabulary (pieces
    by id): a checkpoint's, or a random model with placeholder pieces."""
    if args.checkpoint:
        from transformer_mt.decode.ctranslate2_engine import pieces_of
        from transformer_mt.decode.translate import Translator

        overrides = [f"decode.quantize={quantize}"]
        translator = Translator.from_checkpoints([args.checkpoint], device=args.device, overrides=overrides)
        return translator.model, pieces_of(translator.bpe)
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[args.shape], dropout=0.0, max_positions=1024)
    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(4, args.vocab)]
    model = Transformer(cfg, args.vocab).eval().to(args.device)
    # as Translator loads a model to decode: int8, or fp32 through oneDNN on an x86-64 CPU
    return (quantize_int8(model) if quantize == "int8" else use_onednn_linears(model)), pieces


def tmt_timer(model: Any, args: argparse.Namespace, forced: bool = True) -> Timer:
    def run(src: torch.Tensor) -> tuple[float, int]:
        start = time.perf_counter()
        settings = SearchSettings(
            beam_size=args.beam, len_penalty=args.lenpen, max_len_a=0.0 if forced else 1.0,
            max_len_b=args.length - 1 if forced else 50, max_positions=1024,
        )  # fmt: skip
        out = beam_search(NoEarlyEos(model) if forced else model, src, settings)
        seconds = time.perf_counter() - start
        return seconds, sum(len(h[0].tokens) + 1 for h in out)  # + EOS

    return run


def export_ct2(model: Transformer, pieces: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Path]:
    """The model's weights as CTranslate2 fp32 and int8 directories, converted as `tmt export ctranslate2` does
    (with ``--text``: by `tmt export ctranslate2` itself). Empty when ctranslate2 is not installed."""
    try:
        from transformer_mt.export import export_ctranslate2
        from transformer_mt.export.ctranslate2_spec import TmtConverter
    except ImportError:
        print("ctranslate2 is not installed (pip install ctranslate2): skipping CTranslate2", file=sys.stderr)
        return {}
    directories = {}
    for name, quantization in (("CTranslate2 fp32", "float32"), ("CTranslate2 int8", "int8")):
        directories[name] = workdir / quantization
        if args.text:
            export_ctranslate2([args.checkpoint], directories[name], quantization=quantization)
        else:
            converter = TmtConverter(model.cpu(), pieces)
            converter.convert(str(directories[name]), quantization=None if quantization == "float32" else quantization)
    return directories


def ct2_timer(directory: Path, pieces: list[str], args: argparse.Namespace) -> Timer:
    import ctranslate2

    translator = ctranslate2.Translator(
        str(directory), device=args.device, inter_threads=1, intra_threads=torch.get_num_threads()
    )

    def run(src: torch.Tensor) -> tuple[float, int]:
        tokens = [[pieces[i] for i in row if i not in (PAD, EOS)] for row in src.tolist()]  # CT2 adds EOS
        start = time.perf_counter()
        out = translator.translate_batch(
            tokens, beam_size=args.beam, length_penalty=args.lenpen, min_decoding_length=args.length,
            max_decoding_length=args.length, max_input_length=0, max_batch_size=0,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        return seconds, sum(len(r.hypotheses[0]) for r in out)

    return run


def hf_timer(cfg: ModelConfig, vocab: int, args: argparse.Namespace) -> Timer:
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
    model = MarianMTModel(config).eval().to(args.device)

    def run(src: torch.Tensor) -> tuple[float, int]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=src, attention_mask=src.ne(PAD), num_beams=args.beam, max_new_tokens=args.length,
                min_new_tokens=args.length, length_penalty=args.lenpen, do_sample=False, early_stopping=False,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        return seconds, int(out[:, 1:].ne(PAD).sum())

    return run


def text_timer(name: str, args: argparse.Namespace, directory: Path | None) -> Timer:
    """Timed `translate_lines` of the first ``len(src)`` lines of ``--text`` (tmt's text path, either engine)."""
    from transformer_mt.decode.translate import Translator

    lines = Path(args.text).read_text(encoding="utf-8").splitlines()
    settings = [
        "decode.len_penalty_form=fairseq",
        f"decode.len_penalty={args.lenpen}",
        f"decode.stopping={args.stopping}",
    ]
    if name.startswith("tmt"):
        quantize = ["decode.quantize=int8"] if name == "tmt int8" else []
        translator = Translator.from_checkpoints([args.checkpoint], device=args.device, overrides=settings + quantize)
    else:
        translator = Translator.from_ctranslate2([directory], device=args.device, overrides=settings)
    translator.show_progress = False

    def run(src: torch.Tensor) -> tuple[float, int]:
        start = time.perf_counter()
        out = translator.translate_lines(lines[: src.shape[0]])
        seconds = time.perf_counter() - start
        return seconds, sum(len(translator.bpe.encode(line)) + 1 for line in out)

    return run


def engine_timer(name: str, args: argparse.Namespace, directory: Path | None) -> Timer:
    """The timer of engine ``name``, built inside its own process (the tmt model is rebuilt from the same seed)."""
    if args.text:
        return text_timer(name, args, directory)
    model, pieces = tmt_model(args, "int8" if name == "tmt int8" else "none")
    if name in ("tmt fp32", "tmt int8"):
        return tmt_timer(model, args)
    if name == "tmt natural length":
        return tmt_timer(model, args, forced=False)
    if name.startswith("CTranslate2") and directory is not None:
        return ct2_timer(directory, pieces, args)
    return hf_timer(model.cfg, len(pieces), args)


def serve(name: str, args: argparse.Namespace, directory: Path | None, conn: Connection) -> None:
    """A worker process: build one engine, then time it on the batch each time the parent asks, until None."""
    if name.startswith("tmt"):
        keep_freed_memory()  # as every tmt command does (TMT_MALLOC=system measures without)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = engine_timer(name, args, directory)
    src = conn.recv()
    run(src[:4])  # warm-up
    conn.send("ready")
    while conn.recv() is not None:
        conn.send(run(src))


def engines(args: argparse.Namespace, ct2_dirs: dict[str, Path]) -> list[str]:
    names = ["tmt fp32"] + (["tmt int8"] if args.device == "cpu" else []) + (["tmt natural length"] * args.natural)
    if args.no_peer:
        return names
    names += list(ct2_dirs)
    if args.text:
        return names  # the HF peer has its own random weights: no translations of this text
    if importlib.util.find_spec("transformers") is None:
        print("transformers is not installed (pip install transformers): skipping HF", file=sys.stderr)
    else:
        names.append("HF Marian generate")
    return names


def time_in_turns(names: list[str], args: argparse.Namespace, ct2_dirs: dict[str, Path], src: torch.Tensor):
    """``args.repeats`` timings of every engine, each in its own process, the processes taking turns."""
    context = multiprocessing.get_context("spawn")
    workers = {}
    for name in names:
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(name, args, ct2_dirs.get(name), child), daemon=True)
        process.start()
        parent.send(src)
        workers[name] = (process, parent)
    for _, conn in workers.values():
        conn.recv()  # built and warmed up
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name, (_, conn) in workers.items():
            conn.send("run")
            runs[name].append(conn.recv())
    for process, conn in workers.values():
        conn.send(None)
        process.join()
    return runs


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
    parser.add_argument("--no-peer", action="store_true", help="measure tmt only")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads of every engine (0: torch's default)")
    parser.add_argument("--text", help="with --checkpoint: time translate_lines on this file's lines (all of them)")
    parser.add_argument("--lenpen", type=float, default=0.6, help="length penalty alpha of every engine")
    parser.add_argument(
        "--stopping", choices=["exact", "k_finished"], default="exact",
        help="with --text: tmt's decode.stopping (CTranslate2 always stops at k finished hypotheses)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.text and not args.checkpoint:
        parser.error("--text needs --checkpoint (the model that translates it)")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, pieces = tmt_model(args)
    if args.text:  # the batch only says how many lines each run translates
        args.sentences = len(Path(args.text).read_text(encoding="utf-8").splitlines())
    src = random_sources(args.sentences, len(pieces), seed=1)
    with tempfile.TemporaryDirectory() as workdir:
        ct2_dirs = {} if args.no_peer else export_ct2(model, pieces, args, Path(workdir))
        names = engines(args, ct2_dirs)
        work = f"the lines of {args.text}, natural lengths" if args.text else f"{args.length} forced output tokens"
        print(
            f"device {args.device}, {torch.get_num_threads()} threads; model {count_parameters(model) / 1e6:.1f}M "
            f"parameters; {args.sentences} sentences, beam {args.beam}, {work}; engines in turn, one process each"
        )
        runs = time_in_turns(names, args, ct2_dirs, src.to(args.device))
    rates = {name: report(name, r, args.sentences) for name, r in runs.items()}
    for ours, peer in (("tmt fp32", "CTranslate2 fp32"), ("tmt int8", "CTranslate2 int8"), ("tmt int8", "CTranslate2 fp32"),
                       ("tmt fp32", "HF Marian generate")):  # fmt: skip
        if ours in rates and peer in rates:
            print(f"ratio {ours} / {peer}: {rates[ours] / rates[peer]:.2f}x")


if __name__ == "__main__":
    main()
