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

With ``--replicas N`` every client count is spread over N servers on their own ports, as a round-robin balancer
would (their counters summed, their peaks added).

Bounded: each request times out after 60 s and the whole run after
``--deadline`` seconds; the server is stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

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


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "transformer_mt", "serve", "-c", str(args.checkpoint), "--port", str(port),
           "--max-wait-ms", str(args.max_wait_ms), "--queue", "1024"]  # fmt: skip
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    if args.max_batch_tokens:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            health(port, timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"tmt serve did not start: {proc.stderr.read() if proc.stderr else ''}")


def offline(args: argparse.Namespace, lines: list[str]) -> tuple[dict[str, str], float, float]:
    """The offline translation of each line, offline sentences/s, and the median latency of a line alone."""
    overrides = decode_flags(quantize=args.quantize, batch_tokens=args.max_batch_tokens)
    translator = Translator.from_checkpoints([args.checkpoint], device="cpu", overrides=overrides)
    translator.show_progress = False
    translator.translate_lines(lines[:8])  # warm-up
    start = time.perf_counter()
    outputs = translator.translate_lines(lines)
    rate = len(lines) / (time.perf_counter() - start)
    times = []
    for line in lines[: args.alone]:
        start = time.perf_counter()
        translator.translate_lines([line])
        times.append(time.perf_counter() - start)
    return dict(zip(lines, outputs, strict=True)), rate, statistics.median(times)


def totals(ports: list[int]) -> dict[str, int]:
    """The counters of `GET /health`, summed over the servers on ``ports``."""
    answers = [health(port) for port in ports]
    return {key: sum(a[key] for a in answers) for key in ("batches", "steps", "lines", "sentence_steps")}


def run_clients(ports: list[int], lines: list[str], clients: int, expected: dict[str, str], deadline: float) -> dict:
    """``clients`` threads share ``lines``, one request per line, client i sending to ``ports[i % len(ports)]``
    (replicas behind a round-robin balancer); latencies, wrong and lost answers, and the mean lines per round of
    the servers' workers (from `GET /health` before and after)."""
    before = totals(ports)
    latencies: list[float] = []
    wrong = lost = 0
    lock = threading.Lock()
    todo = iter(range(len(lines)))

    def client(port: int) -> None:
        nonlocal wrong, lost
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < deadline:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            body = json.dumps({"q": lines[i], "source": "auto"})
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
                if response.status != 200 or answer.get("translatedText") != expected[lines[i]]:
                    wrong += 1

    threads = [threading.Thread(target=client, args=(ports[i % len(ports)],)) for i in range(clients)]
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
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline
    lines = [line for line in args.text.read_text(encoding="utf-8").splitlines() if line.strip()]
    expected, offline_rate, alone_s = offline(args, lines)
    torch.set_num_threads(1)  # the clients' process: leave the cores to the server
    ports = [free_port() for _ in range(args.replicas)]
    servers = [start_server(args, port) for port in ports]
    try:
        rows = [run_clients(ports, lines, n, expected, deadline) for n in args.clients]
        rss = sum(peak_rss_mib(server.pid) for server in servers)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    print(f"offline: {offline_rate:.1f} sentences/s over {len(lines)} lines; one line alone: p50 "
          f"{1000 * alone_s:.1f} ms; {args.replicas} server(s), exit {[s.returncode for s in servers]}, "
          f"peak RSS {rss:.0f} MiB in all")  # fmt: skip
    print(
        "| clients | sentences/s | vs offline | p50 ms | p99 ms | p50 vs alone | sentences/step | answered | wrong | lost |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['clients']} | {r['sentences_per_s']:.1f} | {r['sentences_per_s'] / offline_rate:.2f}x | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['p50_ms'] / 1000 / alone_s:.2f}x | {r['sentences_per_step']:.1f} | {r['answered']} | "
              f"{r['wrong']} | {r['lost']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"offline_sentences_per_s": offline_rate, "alone_p50_s": alone_s,
                                         "server_peak_rss_mib": rss, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
