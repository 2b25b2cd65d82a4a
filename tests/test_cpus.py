"""The CPUs a process may use (transformer_mt/cpus.py): affinity masks and cgroup v1/v2 quotas, faked on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer_mt.config import ConfigError, load_config
from transformer_mt.cpus import (
    WAIT_SETTINGS,
    available_memory,
    cgroup_quota,
    choose_threads,
    prepare_openmp,
    usable_cpus,
)

V2_MOUNTS = "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 25 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "32 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
)


def machine(tmp_path: Path, cgroup: str, mounts: str, files: dict[str, str]) -> Path:
    """A fake root: /proc/self/cgroup, /proc/self/mountinfo and the cgroup files, each relative to it."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mounts)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_v2_quota_of_the_process_cgroup(tmp_path):
    root = machine(tmp_path, "0::/pod/app\n", V2_MOUNTS, {"sys/fs/cgroup/pod/app/cpu.max": "150000 100000\n"})
    assert cgroup_quota(root) == (1.5, "a CPU quota of 1.5 CPUs (/sys/fs/cgroup/pod/app/cpu.max)")


def test_v2_no_quota_anywhere(tmp_path):
    root = machine(
        tmp_path, "0::/pod/app\n", V2_MOUNTS,
        {"sys/fs/cgroup/pod/app/cpu.max": "max 100000\n", "sys/fs/cgroup/pod/cpu.max": "max 100000\n"},
    )  # fmt: skip
    assert cgroup_quota(root) is None
    assert usable_cpus(root, affinity={0, 1, 2, 3}, host=4) == (4.0, "4 cores on the host")


def test_v2_a_parent_quota_limits_its_children(tmp_path):
    root = machine(
        tmp_path, "0::/pod/app\n", V2_MOUNTS,
        {"sys/fs/cgroup/pod/app/cpu.max": "400000 100000\n", "sys/fs/cgroup/pod/cpu.max": "100000 100000\n"},
    )  # fmt: skip
    assert cgroup_quota(root) == (1.0, "a CPU quota of 1 CPUs (/sys/fs/cgroup/pod/cpu.max)")


def test_v1_quota_of_the_cpu_controller(tmp_path):
    root = machine(
        tmp_path, "4:memory:/job\n2:cpu,cpuacct:/job\n", V1_MOUNTS,
        {"sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n",
         "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
         "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
         "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )  # fmt: skip
    cpus, why = usable_cpus(root, affinity={0, 1}, host=2)
    assert cpus == 0.5 and "cpu,cpuacct/job/cpu.cfs_quota_us" in why
    assert choose_threads(environ={}, root=root, affinity={0, 1}, host=2).count == 1  # never below one thread


MEMINFO = {"proc/meminfo": "MemTotal:       32000000 kB\nMemAvailable:    8000000 kB\n"}  # 8.192 GB available


def test_available_memory_is_the_hosts_or_less_where_a_cgroup_limit_leaves_less(tmp_path):
    host = machine(tmp_path / "host", "0::/\n", V2_MOUNTS, {**MEMINFO, "sys/fs/cgroup/memory.max": "max\n"})
    assert available_memory(host) == (8_192_000_000, "MemAvailable in /proc/meminfo")
    v2 = machine(
        tmp_path / "v2", "0::/pod/app\n", V2_MOUNTS,
        {**MEMINFO, "sys/fs/cgroup/pod/app/memory.max": "max\n", "sys/fs/cgroup/pod/memory.max": "3000000000\n",
         "sys/fs/cgroup/pod/memory.current": "1000000000\n"},
    )  # fmt: skip
    assert available_memory(v2) == (2_000_000_000, "the memory cgroup limit of /sys/fs/cgroup/pod")
    v1 = machine(
        tmp_path / "v1", "4:memory:/job\n2:cpu,cpuacct:/job\n", V1_MOUNTS,
        {**MEMINFO, "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "1500000000\n",
         "sys/fs/cgroup/memory/job/memory.usage_in_bytes": "500000000\n",
         "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"},  # v1's "no limit"
    )  # fmt: skip
    assert available_memory(v1) == (1_000_000_000, "the memory cgroup limit of /sys/fs/cgroup/memory/job")
    assert available_memory(tmp_path / "none") is None


def test_v1_no_quota(tmp_path):
    root = machine(
        tmp_path, "2:cpu,cpuacct:/\n", V1_MOUNTS,
        {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )  # fmt: skip
    assert cgroup_quota(root) is None


def test_a_cgroup_namespace_shows_the_mount_root(tmp_path):
    """Inside a container the process's cgroup is the root of the mount it sees: its quota is the mount's own."""
    mounts = "30 25 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = machine(tmp_path, "0::/docker/abc\n", mounts, {"sys/fs/cgroup/cpu.max": "200000 100000\n"})
    assert cgroup_quota(root)[0] == 2.0


def test_fractional_quota_rounds_to_the_nearest_thread(tmp_path):
    for quota, threads in (("150000", 2), ("140000", 1), ("250000", 3), ("30000", 1)):
        root = machine(tmp_path / quota, "0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": f"{quota} 100000\n"})
        assert choose_threads(environ={}, root=root, affinity=set(range(8)), host=8).count == threads, quota


def test_a_quota_above_the_cores_leaves_the_cores(tmp_path):
    root = machine(tmp_path, "0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "800000 100000\n"})
    threads = choose_threads(environ={}, root=root, affinity={0, 1}, host=2)
    assert (
        threads.count == 2 and threads.why == "2: 2 cores on the host; a CPU quota of 8 CPUs (/sys/fs/cgroup/cpu.max)"
    )


def test_the_affinity_mask_limits(tmp_path):
    root = machine(tmp_path, "0::/\n", V2_MOUNTS, {})
    assert usable_cpus(root, affinity={3}, host=16) == (1.0, "16 cores on the host; 1 CPUs in the affinity mask")
    assert choose_threads(environ={}, root=root, affinity={1, 2, 5, 7}, host=16).count == 4


def test_unreadable_proc_means_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None  # no /proc/self: not Linux, or a sandbox that hides it
    malformed = machine(tmp_path / "m", "garbage\n::\n", "short line\n", {})
    assert cgroup_quota(malformed) is None


def test_overrides_in_order(tmp_path):
    root = machine(tmp_path, "0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "100000 100000\n"})
    fake = {"root": root, "affinity": {0, 1, 2, 3}, "host": 4}
    both = {"TMT_NUM_THREADS": "3", "OMP_NUM_THREADS": "2"}
    assert choose_threads(5, environ=both, **fake).count == 5
    assert choose_threads(environ=both, **fake) == choose_threads(environ={"TMT_NUM_THREADS": "3"}, **fake)
    assert choose_threads(environ={"OMP_NUM_THREADS": "2"}, **fake).why == "2 from OMP_NUM_THREADS"
    assert choose_threads(environ={"OMP_NUM_THREADS": "x"}, **fake).count == 1  # not a count: the quota's 1
    assert choose_threads(environ={}, ranks=2, affinity={0, 1, 2, 3}, host=4, root=tmp_path / "none").count == 2


def test_prepare_openmp_keeps_what_the_user_set():
    environ: dict[str, str] = {}
    prepare_openmp(environ)
    assert environ == WAIT_SETTINGS
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    prepare_openmp(mine)
    assert mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_this_machine(tmp_path):
    """The real files of the machine the tests run on parse, whatever they hold."""
    cpus, why = usable_cpus()
    assert 0 < cpus <= (os.cpu_count() or 1) and why


def _without_thread_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "TMT_NUM"))}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's environment is Linux's")
def test_every_command_sets_the_wait_policy_before_torch_loads():
    """`tmt` sets the wait policy in its own environment before a command can import torch; a user's own wins."""
    script = (
        "import os, sys; from transformer_mt.cli import app; sys.argv = ['tmt', 'score', '--help']\n"
        "try: app()\nexcept SystemExit: pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    )
    for extra, expected in (({}, ["PASSIVE", "None"]), ({"GOMP_SPINCOUNT": "5"}, ["None", "5"])):
        env = {**_without_thread_settings(), **extra}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        assert out.stdout.split()[-2:] == expected, out.stderr


@pytest.mark.slow
def test_translate_uses_and_reports_the_threads_it_chose(toy_ckpt, tmp_path):
    """--threads wins over TMT_NUM_THREADS, which wins over the machine's CPUs; --verbose says which and why, and
    the translations do not depend on where the count came from."""
    (tmp_path / "in.en").write_text("the dog sees a cat .\n", encoding="utf-8")
    env = {**_without_thread_settings(), "TMT_NUM_THREADS": "1"}
    outputs = []
    for flags, said in (([], "threads: 1 from TMT_NUM_THREADS"), (["--threads", "1"], "threads: 1 as asked")):
        out = tmp_path / f"out{len(outputs)}.de"
        done = subprocess.run(
            [sys.executable, "-m", "transformer_mt", "translate", "-c", str(toy_ckpt), "-i", str(tmp_path / "in.en"),
             "-o", str(out), "--verbose", *flags],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0 and said in done.stderr, done.stderr
        outputs.append(out.read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 1


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ConfigError, match="train.num_threads must be 0"):
        load_config("tmt:toy.yaml", ["train.num_threads=-3"])


def test_torchrun_ranks_share_the_cpus():
    """`tmt train --nproc-per-node N` gives each rank its share of the usable CPUs, or what the user set."""
    from transformer_mt.train.distributed import rank_environment

    cpus, _ = usable_cpus()
    assert rank_environment(2, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": str(max(1, round(cpus / 2)))}
    assert rank_environment(2, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    assert rank_environment(4, {"TMT_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"


@pytest.mark.slow
def test_how_threads_wait_changes_no_bit(prepared_toy, toy_ckpt, tmp_path):
    """Sleeping or spinning while a thread waits is scheduling, not arithmetic: at the same thread count, a training
    run's weights and a translation are identical under tmt's wait policy and under libgomp's spinning default."""
    from transformer_mt.checkpoint import read_checkpoint

    config = tmp_path / "toy.yaml"
    config.write_text(prepared_toy.to_yaml(), encoding="utf-8")
    (tmp_path / "in.en").write_text("".join(f"the {w} sees a dog .\n" for w in ("cat", "man", "child")), "utf-8")
    weights, translations = [], []
    for policy in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}):  # libgomp's default spin count
        env, run = {**_without_thread_settings(), **policy}, tmp_path / f"run{len(weights)}"
        train = ["train", str(config), "--threads", "2", "--set", f"train.save_dir={run}", "--set",
                 "train.max_updates=3", "--set", "train.validate_every=100", "--set", "train.save_every_updates=3"]  # fmt: skip
        subprocess.run([sys.executable, "-m", "transformer_mt", *train], env=env, check=True, capture_output=True)
        weights.append(read_checkpoint(run / "checkpoint_u0000003.pt").model)
        out = tmp_path / f"out{len(translations)}.de"
        translate = ["translate", "-c", str(toy_ckpt), "-i", str(tmp_path / "in.en"), "-o", str(out), "--threads", "2"]
        subprocess.run([sys.executable, "-m", "transformer_mt", *translate], env=env, check=True, capture_output=True)
        translations.append(out.read_bytes())
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert translations[0] == translations[1] and translations[0].count(b"\n") == 3
