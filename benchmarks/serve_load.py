"""`tmt serve` under load: sentences/s and latency at 1, 8 and 32 concurrent clients, beside offline translation.

Starts a real `tmt serve` process on a free port of 127.0.0.1 (nothing leaves
this machine), then for each client count runs that many client threads,
each sending single sentences of ``--text`` to ``POST /translate`` over its
own keep-alive connection, one request at a time, until every line has been
sent once. Every answer is checked against the offline translation of its
line: a lost, merged or misplaced answer is counted, never tolerated.

The peers, measured in this same run, in this process, before the server
starts (the server then has the cores to itself but for the clients):

- offline: `Translator.translate_lines` of the whole file, batched by length,
  what `tmt translate -i FILE` spends after loading: the throughput goal is
  at least 70% of it at 32 clients;
- alone: each of the first ``--alone`` lines translated by itself; the latency
  goal is a median at 1 client of at most 1.5x its median.

Also reported: the server's peak resident memory (VmHWM) after the run, and
the sentences its continuous search held per step (from ``GET /health``).

    python benchmarks/serve_load.py -c runs/multi30k/average.pt --text ../shared/data/multi30k/test.en
    python benchmarks/serve_load.py -c CK --text FILE --quantize int8 --clients 1 8 32
    python benchmarks/serve_load.py -c CK --text FILE --replicas 2 --clients 32   # two servers, clients spread

A model of several directions: ``--directions en-de de-en en-fr ...`` with ``--text`` a prefix
(``../shared/data/multi30k/test`` reads test.en, test.de, ...) measures two workloads on the same lines, in
the same run: line i of the first direction alone ("en-de"), and line i in direction i mod N ("mixed": the
same captions, 4-way parallel, spread over the directions, each request naming its ``source`` and ``target``).
Their ratio is what spreading the clients over the directions costs the one running search; offline is each
workload translated a direction at a time:

    python benchmarks/serve_load.py -c runs/multi30k_multilingual/average.pt --text ../shared/data/multi30k/test \
        --directions en-de de-en en-fr fr-en en-cs cs-en --clients 32

With ``--replicas N`` every client count is spread over N servers on their own ports, as a round-robin balancer
would (their counters summed, their peaks added).

What a server option costs: ``--serve-args`` passes more `tmt serve` arguments, ``--keys`` starts it with an
``--api-keys`` file of one key per client (a limit far above what the run sends, so that every request passes
the key check and the limiter) and makes each client send its own ``api_key``, and ``--baseline-src DIR``
measures, in the same run, a server of the code in DIR (another checkout: ``git worktree add ../before main``)
without either, in turn with this one (before, after, before, after... for ``--rounds``), so that both see the
same machine:

    python benchmarks/serve_load.py -c CK --text FILE --clients 32 --keys --serve-args "--log-format json" \
        --baseline-src ../before --rounds 2

A server's stderr (its access log included) goes to a file, as it would to a journal.

Bounded: each request times out after 60 s and the whole run after
``--deadline`` seconds; the server is stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from transformer_mt.data.directions import Direction
from transformer_mt.decode.load import decode_flags
from transformer_mt.decode.translate import Translator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int, timeout: float = 60) -> dict:
    """The server's `GET /health` answer; OSError while it cannot answer (not started, or not 200)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        if response.status != 200:
            raise OSError(f"GET /health answered {response.status}")
        return json.loads(response.read())
    finally:
        conn.close()


@dataclass
class Variant:
    """One kind of server measured: its name, the code it runs (None: this checkout), its extra `tmt serve`
    arguments, the keys its clients send (None: none), and its running processes and their ports."""

    name: str
    src: Path | None = None
    extra: list[str] = field(default_factory=list)
    keys: list[str] | None = None
    servers: list[subprocess.Popen] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)


def variants(args: argparse.Namespace, folder: Path) -> list[Variant]:
    """This checkout's server with ``--serve-args`` and ``--keys``; first, with ``--baseline-src``, the other."""
    extra = shlex.split(args.serve_args)
    keys = None
    if args.keys:
        keys = [f"bench-{i:04d}-{os.urandom(8).hex()}" for i in range(max(args.clients))]
        (folder / "keys.txt").write_text("".join(f"{key} 1000000\n" for key in keys))
        extra += ["--api-keys", str(folder / "keys.txt")]
    after = Variant("after" if args.baseline_src else "server", None, extra, keys)
    return [Variant("before", args.baseline_src), after] if args.baseline_src else [after]


def start_server(args: argparse.Namespace, port: int, variant: Variant, log: Path) -> subprocess.Popen:
    """A server of ``variant`` on ``port``, its stderr to ``log``, once it answers ``GET /health``."""
    cmd = [sys.executable, "-m", "transformer_mt", "serve", "-c", str(args.checkpoint), "--port", str(port),
           "--max-wait-ms", str(args.max_wait_ms), "--queue", "1024", *variant.extra]  # fmt: skip
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    if args.max_batch_tokens:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ)
    if variant.src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(variant.src.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stderr=out, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            health(port, timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"tmt serve ({variant.name}) did not start: {log.read_text()}")


Item = tuple[str | None, str | None, str]  # a request's source and target (None: the model's one pair) and line


def workloads(args: argparse.Namespace) -> dict[str, list[Item]]:
    """What the clients send: ``--text``'s lines (""), or with ``--directions`` the first direction alone and
    the mixed workload, on the same line numbers of ``--text``.{src} (see the module's docstring)."""
    if not args.directions:
        return {"": [(None, None, line) for line in args.text.read_text(encoding="utf-8").splitlines() if line.strip()]}
    ways = [Direction.parse(d) for d in args.directions]
    text = {w.src: Path(f"{args.text}.{w.src}").read_text(encoding="utf-8").splitlines() for w in ways}
    rows = [i for i in range(min(map(len, text.values()))) if all(lines[i].strip() for lines in text.values())]
    item = lambda w, i: (w.src, w.tgt, text[w.src][i])  # noqa: E731
    return {ways[0].name: [item(ways[0], i) for i in rows], "mixed": [item(ways[i % len(ways)], i) for i in rows]}


def offline(args: argparse.Namespace, work: dict[str, list[Item]]) -> tuple[dict[Item, str], dict[str, float], float]:
    """Each workload's offline translations (per item) and sentences/s, a direction at a time, and the median
    latency of a line of the first workload alone."""
    overrides = decode_flags(quantize=args.quantize, batch_tokens=args.max_batch_tokens)
    translator = Translator.from_checkpoints([args.checkpoint], device="cpu", overrides=overrides)
    translator.show_progress = False
    first = next(iter(work.values()))
    toward = translator.toward  # (None, None): a model of one pair's own direction
    toward(*first[0][:2]).translate_lines([line for *_, line in first[:8]])  # warm-up
    expected, rates = {}, {}
    for name, items in work.items():
        start = time.perf_counter()
        for src, tgt in dict.fromkeys((src, tgt) for src, tgt, _ in items):
            chosen = [item for item in items if item[:2] == (src, tgt)]
            expected.update(zip(chosen, toward(src, tgt).translate_lines([line for *_, line in chosen]), strict=True))
        rates[name] = len(items) / (time.perf_counter() - start)
    times = []
    for src, tgt, line in first[: args.alone]:
        start = time.perf_counter()
        toward(src, tgt).translate_lines([line])
        times.append(time.perf_counter() - start)
    return expected, rates, statistics.median(times)


def totals(ports: list[int]) -> dict[str, int]:
    """The counters of `GET /health`, summed over the servers on ``ports``."""
    answers = [health(port) for port in ports]
    return {key: sum(a[key] for a in answers) for key in ("batches", "steps", "lines", "sentence_steps")}


def run_clients(
    ports: list[int], items: list[Item], clients: int, expected: dict[Item, str], deadline: float,
    keys: list[str] | None = None,
) -> dict:  # fmt: skip
    """``clients`` threads share ``items``, one request per line (its source and target named, if any), client i
    sending to ``ports[i % len(ports)]`` (replicas behind a round-robin balancer), with ``keys[i]`` as its
    ``api_key`` when keys are given;
    latencies, wrong and lost answers, and the mean lines per round of the servers' workers (from `GET /health`
    before and after)."""
    before = totals(ports)
    latencies: list[float] = []
    wrong = lost = 0
    lock = threading.Lock()
    todo = iter(range(len(items)))

    def client(port: int, key: str | None) -> None:
        nonlocal wrong, lost
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < deadline:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            src, tgt, line = items[i]
            languages = {"source": src or "auto", **({"target": tgt} if tgt else {})}
            body = json.dumps({"q": line, **languages, **({"api_key": key} if key else {})})
            start = time.perf_counter()
            try:
                conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                answer = json.loads(response.read())
            except (OSError, http.client.HTTPException, ValueError):
                with lock:
                    lost += 1
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                continue
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if response.status != 200 or answer.get("translatedText") != expected[items[i]]:
                    wrong += 1

    threads = [
        threading.Thread(target=client, args=(ports[i % len(ports)], keys[i] if keys else None)) for i in range(clients)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = totals(ports)
    answered = len(latencies)
    rounds = max(1, after["batches"] - before["batches"])
    steps = max(1, after["steps"] - before["steps"])
    return {
        "lines_per_round": (after["lines"] - before["lines"]) / rounds,
        "sentences_per_step": (after["sentence_steps"] - before["sentence_steps"]) / steps,
        "clients": clients, "sent": answered + lost, "answered": answered, "wrong": wrong, "lost": lost,
        "sentences_per_s": answered / wall, "p50_ms": 1000 * _quantile(latencies, 0.5),
        "p99_ms": 1000 * _quantile(latencies, 0.99),
    }  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True, help="raw source lines, e.g. Multi30k test2016")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--alone", type=int, default=200, help="lines translated alone for the latency peer")
    parser.add_argument("--quantize", choices=["int8"], default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--replicas", type=int, default=1, help="servers, each on its own port; clients spread")
    parser.add_argument("--threads", type=int, default=0, help="tmt serve --threads of each (0: its own choice)")
    parser.add_argument("--serve-args", default="", help="more tmt serve arguments, one string (shell words)")
    parser.add_argument("--keys", action="store_true", help="--api-keys with one key per client, each sent")
    parser.add_argument("--baseline-src", type=Path, default=None, help="also measure the server of this checkout")
    parser.add_argument("--rounds", type=int, default=1, help="times each server is measured, in turn")
    parser.add_argument("--directions", nargs="+", default=[], help="a model of several: --text is a prefix")
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline
    work = workloads(args)
    expected, offline_rates, alone_s = offline(args, work)
    torch.set_num_threads(1)  # the clients' process: leave the cores to the server
    with tempfile.TemporaryDirectory() as folder:
        kinds = variants(args, Path(folder))
        rows, rss = measure(args, kinds, work, expected, deadline, Path(folder))
    exits = {kind.name: [s.returncode for s in kind.servers] for kind in kinds}
    rates = ", ".join(f"{name or 'the text'} {rate:.1f}" for name, rate in offline_rates.items())
    print(f"offline sentences/s: {rates}, over {len(next(iter(work.values())))} lines; one line alone: p50 "
          f"{1000 * alone_s:.1f} ms; {args.replicas} server(s) each, exit {exits}, peak RSS "
          f"{', '.join(f'{name} {mib:.0f}' for name, mib in rss.items())} MiB in all")  # fmt: skip
    print(
        "| server | workload | clients | sentences/s | vs offline | p50 ms | p99 ms | p50 vs alone | sentences/step "
        "| answered | wrong | lost |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['server']} | {r['workload'] or 'the text'} | {r['clients']} | {r['sentences_per_s']:.1f} | "
              f"{r['sentences_per_s'] / offline_rates[r['workload']]:.2f}x | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
              f"{r['p50_ms'] / 1000 / alone_s:.2f}x | {r['sentences_per_step']:.1f} | {r['answered']} | "
              f"{r['wrong']} | {r['lost']} |")  # fmt: skip
    compare(args, rows, list(work))
    if args.json:
        args.json.write_text(json.dumps({"offline_sentences_per_s": offline_rates, "alone_p50_s": alone_s,
                                         "server_peak_rss_mib": rss, "rows": rows}, indent=1))  # fmt: skip


def compare(args: argparse.Namespace, rows: list[dict], names: list[str]) -> None:
    """The ratios asked for: after / before (``--baseline-src``) and mixed / one direction (``--directions``),
    each the mean over the rounds."""

    def mean(server: str, workload: str, n: int) -> float:
        found = [
            r["sentences_per_s"] for r in rows if (r["server"], r["workload"], r["clients"]) == (server, workload, n)
        ]
        return statistics.mean(found)

    for n in args.clients:
        if args.baseline_src:
            after, before = (mean(kind, names[0], n) for kind in ("after", "before"))
            print(f"{n} clients: after / before = {after / before:.3f} "
                  f"(mean of {args.rounds} rounds: {after:.1f} / {before:.1f} sentences/s)")  # fmt: skip
        if args.directions:
            server = "after" if args.baseline_src else "server"
            one, mixed = (mean(server, name, n) for name in names)
            print(f"{n} clients: mixed / {names[0]} = {mixed / one:.3f} "
                  f"(mean of {args.rounds} rounds: {mixed:.1f} / {one:.1f} sentences/s)")  # fmt: skip


def measure(
    args: argparse.Namespace, kinds: list[Variant], work: dict[str, list[Item]], expected: dict[Item, str],
    deadline: float, folder: Path,
) -> tuple[list[dict], dict[str, float]]:  # fmt: skip
    """Every server of ``kinds`` started (the idle ones wait without using the cores), then each workload and
    client count measured on each kind in turn, ``--rounds`` times; the rows, and each kind's peak memory; all stopped."""
    try:
        for kind in kinds:
            kind.ports = [free_port() for _ in range(args.replicas)]
            kind.servers = [start_server(args, port, kind, folder / f"{kind.name}-{port}.log") for port in kind.ports]
        rows = [
            {"server": kind.name, "workload": name, **run_clients(kind.ports, items, n, expected, deadline, kind.keys)}
            for _ in range(args.rounds)
            for name, items in work.items()
            for n in args.clients
            for kind in kinds
        ]
        return rows, {kind.name: sum(peak_rss_mib(s.pid) for s in kind.servers) for kind in kinds}
    finally:
        for server in (s for kind in kinds for s in kind.servers):
            server.send_signal(signal.SIGTERM)
        for server in (s for kind in kinds for s in kind.servers):
            server.wait(60)


if __name__ == "__main__":
    main()
