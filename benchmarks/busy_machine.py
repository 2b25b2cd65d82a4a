"""tmt on a busy machine: decoding and training beside other work and in a 1-CPU cgroup, against CTranslate2.

Whole processes, as a user runs them: `tmt translate --quantize int8` (beam 4) of the first ``--lines`` lines
of ``--text`` and CTranslate2 int8 (2 threads, the same model exported) on
- an idle machine,
- two CPU-bound competitors (``python -c "while True: pass"``, one per core of a 2-core machine),
- two `tmt train` runs of ``--train-config`` beside it (what the user of a shared server meets), and
- a cgroup limited to 1 CPU (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``; skipped where none can be made).

With ``--before DIR`` (a checkout of an earlier tmt, e.g. `git worktree add DIR <commit>`) the tmt rows are run
with that tree too, its trainings included, in the same run: before and after on the same machine. Then
training: updates per minute of ``--train-config`` idle and beside the two competitors (the fair share is half
the idle rate). Prints markdown tables; ratios are what to compare, the machine is shared.

    python benchmarks/busy_machine.py -c runs/multi30k_hour/average.pt --text ../shared/data/multi30k/test.en \\
        --before /tmp/tmt_before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from translate_memory import CT2_SCRIPT, SETTINGS  # noqa: E402

SPIN = [sys.executable, "-c", "while True: pass"]
THREAD_SETTINGS = ("OMP_", "GOMP_", "TMT_NUM_THREADS", "KMP_")  # none inherited: each tree chooses its own


# `python -m transformer_mt` from another checkout: ahead of an editable install's finder, which would win over
# PYTHONPATH
FROM_TREE = (
    "import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
    "sys.path.insert(0, sys.argv.pop(1)); runpy.run_module('transformer_mt', run_name='__main__', alter_sys=True)"
)


def tmt(tree: Path | None) -> list[str]:
    """The command that runs `tmt`: this checkout's, or ``tree``'s."""
    return [sys.executable, "-m", "transformer_mt"] if tree is None else [sys.executable, "-c", FROM_TREE, str(tree)]


def environment() -> dict[str, str]:
    """This process's environment without thread settings: each tmt chooses its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith(THREAD_SETTINGS)}


def run(cmd: list[str], env: dict[str, str], cgroup: Path | None = None) -> tuple[float, float]:
    """(wall s, CPU s) of ``cmd``, started inside ``cgroup`` when given (it joins before exec)."""
    if cgroup is not None:
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode(errors='replace')[-2000:]}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def one_cpu_cgroup() -> Path | None:
    """A cgroup limited to 1 CPU (quota 100 ms per 100 ms), or None where this process cannot make one."""
    for parent, version in ((Path("/sys/fs/cgroup/cpu"), 1), (Path("/sys/fs/cgroup"), 2)):
        group = parent / "tmt_busy_machine"
        try:
            group.mkdir(exist_ok=True)
            if version == 1:
                (group / "cpu.cfs_period_us").write_text("100000")
                (group / "cpu.cfs_quota_us").write_text("100000")
            else:
                (group / "cpu.max").write_text("100000 100000")
            return group
        except OSError:
            continue
    return None


@contextmanager
def competitors(kind: str, tree: Path | None, config: Path, work: Path) -> Iterator[None]:
    """Run ``kind`` beside the measured command: nothing, two spinning processes, or two tmt trainings."""
    procs = []
    if kind == "spin":
        procs = [subprocess.Popen(SPIN) for _ in range(2)]
        time.sleep(1)
    elif kind == "train":
        keys = ["train.max_minutes=600", "train.save_every_minutes=0", "train.keep_last=1"]
        for i in range(2):
            sets = [arg for key in [f"train.save_dir={work / f'c{i}'}", *keys] for arg in ("--set", key)]
            cmd = [*tmt(tree), "train", str(config), *sets]
            procs.append(subprocess.Popen(cmd, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(20)  # past data loading: the trainings are taking steps
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def updates_per_minute(tree: Path | None, config: Path, work: Path, minutes: float, name: str) -> float:
    """Training speed of ``config`` over ``minutes`` of training, from its metrics records (the first, at update
    10, to the last: no start-up, no validation)."""
    save = work / name
    keys = [f"train.save_dir={save}", f"train.max_minutes={minutes}", "train.validate_every=1000000",
            "train.validate_every_fraction=0", "train.save_every_minutes=0", "train.log_every=10"]  # fmt: skip
    run([*tmt(tree), "train", str(config), *[arg for key in keys for arg in ("--set", key)]], environment())
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    return (rows[-1]["update"] - rows[0]["update"]) / (rows[-1]["minutes"] - rows[0]["minutes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--lenpen", type=float, default=1.5, help="the model's (fairseq form, as CTranslate2's)")
    parser.add_argument("--ct2", type=Path, default=None, help="a `tmt export ctranslate2` directory of -c")
    parser.add_argument("--before", type=Path, default=None, help="an earlier checkout of tmt, run beside this one")
    parser.add_argument("--train-config", type=Path, default=Path("configs/multi30k_hour.yaml"))
    parser.add_argument("--train-minutes", type=float, default=1.5, help="length of each training measurement")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each decoding row; the median is reported")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    text = work / "text"
    text.write_text("".join(args.text.read_text(encoding="utf-8").splitlines(True)[: args.lines]), encoding="utf-8")
    ct2 = args.ct2 or work / "ct2"
    if args.ct2 is None:
        subprocess.run([*tmt(None), "export", "ctranslate2", "-c", str(args.checkpoint), "-o", str(ct2)], check=True,
                       env=environment(), stdout=subprocess.DEVNULL)  # fmt: skip
    translate = ["translate", "-c", str(args.checkpoint), *SETTINGS, "--lenpen", str(args.lenpen), "-i", str(text),
                 "-o", str(work / "out")]  # fmt: skip
    ct2_cmd = [sys.executable, "-c", CT2_SCRIPT, str(ct2), str(text), str(work / "ct2.out"), str(args.lenpen)]
    trees = {"tmt": None, **({"tmt before": args.before} if args.before else {})}
    # name: (the tree of the trainings beside it, the command)
    rows = {name: (tree, tmt(tree) + translate) for name, tree in trees.items()}
    rows["tmt --threads 1"] = (None, tmt(None) + translate + ["--threads", "1"])
    rows["CTranslate2"] = (None, ct2_cmd)
    if args.before:  # the trainings of the earlier tree are other neighbours: CTranslate2 beside them too
        rows["CTranslate2 beside tmt before"] = (args.before, ct2_cmd)
    cgroup = one_cpu_cgroup()
    conditions = ["idle", "two CPU-bound competitors", "two tmt trainings"] + (["a 1-CPU cgroup"] if cgroup else [])
    print(f"{args.lines} lines of {args.text}, int8, beam 4; wall s (CPU s), medians of {args.rounds} rounds\n")
    print("| | " + " | ".join(conditions) + " |\n|" + " --- |" * (len(conditions) + 1))
    found: dict[tuple[str, str], tuple[float, float]] = {}
    for condition in conditions:
        kind = {"two CPU-bound competitors": "spin", "two tmt trainings": "train"}.get(condition, "")
        for name, (neighbours, cmd) in rows.items():
            if name == "CTranslate2 beside tmt before" and kind != "train":
                continue
            with competitors(kind, neighbours, args.train_config, work):
                runs = sorted(run(cmd, environment(), cgroup if "cgroup" in condition else None)
                              for _ in range(args.rounds))  # fmt: skip
            found[name, condition] = runs[len(runs) // 2]
    for name in rows:
        cells = [
            f"{found[name, c][0]:.2f} ({found[name, c][1]:.2f})" if (name, c) in found else "-" for c in conditions
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nwall time / CTranslate2's beside the same neighbours, and that over the idle ratio (goal <= 1.2):\n")
    print("| | " + " | ".join(conditions) + " |\n|" + " --- |" * (len(conditions) + 1))
    for name in [*trees, "tmt --threads 1"]:
        peer = {c: "CTranslate2" for c in conditions}
        if name == "tmt before":
            peer["two tmt trainings"] = "CTranslate2 beside tmt before"
        ratio = {c: found[name, c][0] / found[peer[c], c][0] for c in conditions}
        print(
            f"| {name} | " + " | ".join(f"{ratio[c]:.2f}x ({ratio[c] / ratio['idle']:.2f})" for c in conditions) + " |"
        )
    print(
        f"\ntraining {args.train_config}, updates per minute (fair share beside two competitors: half the idle rate)\n"
    )
    print("| | idle | two CPU-bound competitors | / fair share |\n| --- | --- | --- | --- |")
    for name, tree in trees.items():
        idle = updates_per_minute(tree, args.train_config, work, args.train_minutes, f"{name}_idle".replace(" ", "_"))
        with competitors("spin", None, args.train_config, work):
            busy = updates_per_minute(
                tree, args.train_config, work, args.train_minutes, f"{name}_busy".replace(" ", "_")
            )
        print(f"| {name} | {idle:.1f} | {busy:.1f} | {busy / (idle / 2):.2f} |")


if __name__ == "__main__":
    main()
