"""A really new node: torch.compile with every JIT cache from node A, against a tarball and Mega-Cache.

Node A is a warm machine: its Inductor cache in a plain directory, its
precompiled headers where torch keeps them (``$TMPDIR/torchinductor_$USER``).
Every other arm is a new node, made afresh for each run: an empty
``TMPDIR``, an empty ``HOME`` and (for mithrilfs) an empty store at A's
mount path, with nothing but what the arm brings:

- **mithrilfs + prefetch**: ``mount --remote --prefetch`` (the startup set a
  seeding node recorded), then the compile with ``mithrilfs env``'s
  environment (every cache variable and the headers' link) evaluated by a shell;
- **mithrilfs lazy**: the same without ``--prefetch``;
- **tarball**: node A's ``TORCHINDUCTOR_CACHE_DIR`` as a .tar, extracted first
  (what a fleet does without a shared cache; the headers are not in it:
  they live outside the cache directory);
- **Mega-Cache**: ``torch.compiler.load_cache_artifacts`` of what node A's
  ``save_cache_artifacts`` wrote, into an empty cache directory;
- **cold**: nothing at all.

Each run is a fresh process (``scripts/workloads/compile_workload.py``), timed end to
end with its set-up (mount and prefetch, extraction; not the unmount after it); the arms rotate
order every repetition.  Every arm must hit Inductor's FX graph cache (but
cold) and reproduce node A's output, or the script stops; the compiler is
a wrapper that counts the calls that built something.  Prints each arm's
median and its ratio to node A.

    .venv/bin/python scripts/bench/bench_jit_newnode.py --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, WORKLOADS, median, redis_server

WORKLOAD = [sys.executable, str(WORKLOADS / "compile_workload.py")]
ARMS = ["A local", "mithrilfs+prefetch", "mithrilfs lazy", "tarball", "Mega-Cache", "cold"]


class Bench:
    def __init__(self, base: Path, redis_url: str) -> None:
        self.base, self.remote = base, ["--remote", redis_url, "--min-age", "0"]
        self.mp = base / "mnt"
        self.mp.mkdir()
        self.cxx = base / "bin" / "g++"
        self.cxx.parent.mkdir()
        self.cxx.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$CXX_LOG"\nexec g++ "$@"\n'.replace(
            "exec g++", f"exec {shutil.which('g++')}"))
        self.cxx.chmod(0o755)
        self.n = 0

    def node(self, name: str) -> tuple[Path, dict[str, str]]:
        """A new machine's directory, home and TMPDIR (empty) and its environment."""
        self.n += 1
        root = self.base / f"{name.replace(' ', '_')}-{self.n}"
        for d in ("home", "tmp"):
            (root / d).mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
        env.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), CXX=str(self.cxx),
                   CXX_LOG=str(root / "cxx.log"))
        return root, env

    def mithrilfs(self, *args: str) -> str:
        res = subprocess.run([*CLI, *args], capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"mithrilfs {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stderr

    def compile(self, env: dict[str, str], through_env: bool = False) -> dict:
        """One compile in a fresh process; with *through_env*, under what ``mithrilfs env`` prints,
        evaluated by a shell as an app container would (no mithrilfs in that process)."""
        cmd = WORKLOAD
        if through_env:
            snippet = shlex.quote(str(self.mp / ".mithrilfs" / "env"))
            cmd = ["sh", "-c", f'eval "$(cat {snippet})" && exec "$@"', "sh", *WORKLOAD]
        log = Path(env["CXX_LOG"])
        log.unlink(missing_ok=True)  # this run's calls only
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            sys.exit(f"compile failed:\n{res.stderr[-3000:]}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        calls = log.read_text().splitlines() if log.exists() else []
        out["builds"] = sum(1 for c in calls if not all(a.startswith("-") for a in c.split()) and " -E " not in f" {c} ")
        return out

    def seed(self) -> tuple[Path, Path]:
        """Node A: a cold compile into a plain directory (its Mega-Cache saved, its cache tarred), and a
        seeding node that publishes the same work through the tier and records its startup set."""
        root, env = self.node("A")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
        env["MITHRILFS_WORKLOAD_MEGACACHE_SAVE"] = str(self.base / "megacache.bin")
        cold = self.compile(env)
        del env["MITHRILFS_WORKLOAD_MEGACACHE_SAVE"]
        tar = self.base / "inductor.tar"
        with tarfile.open(tar, "w") as t:
            t.add(root / "inductor", arcname="inductor")
        self.mithrilfs("mount", str(self.mp), "--store", str(self.base / "seed-store"), *self.remote)
        _, senv = self.node("seed")
        seeded = self.compile(senv, through_env=True)
        # what capturing the headers costs a cold compile: the same work with every cache on the mount
        print(f"cold compile: {cold['seconds']:.2f} s in a plain directory and /tmp, {seeded['seconds']:.2f} s with"
              " every cache (the precompiled headers too) on the mount", flush=True)
        self.mithrilfs("umount", str(self.mp))
        self.mithrilfs("mount", str(self.mp), "--store", str(self.base / "seed-store"), *self.remote)
        self.compile(senv, through_env=True)  # the warm load records the startup set
        while json.loads((self.mp / ".mithrilfs" / "stats.json").read_text())["upload_queue"]:
            time.sleep(0.1)
        self.mithrilfs("umount", str(self.mp))
        self.a_env, self.a_sha = env, cold["output_sha"]
        return tar, self.base / "megacache.bin"

    def run(self, arm: str, tar: Path, mega: Path) -> tuple[float, dict]:
        """One new node's run, timed with its set-up."""
        root, env = self.node(arm)
        store = root / "store"
        t = time.monotonic()
        if arm.startswith("mithrilfs"):
            self.mithrilfs("mount", str(self.mp), "--store", str(store), *self.remote,
                           *(["--prefetch"] if arm.endswith("prefetch") else []))
            try:
                out = self.compile(env, through_env=True)
                seconds = time.monotonic() - t  # the node is up and compiled: its unmount is no part of that
            finally:
                self.mithrilfs("umount", str(self.mp))
            return seconds, out
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
        if arm == "tarball":
            with tarfile.open(tar) as f:
                f.extractall(root, filter="data")
        elif arm == "Mega-Cache":
            env["MITHRILFS_WORKLOAD_MEGACACHE_LOAD"] = str(mega)
        out = self.compile(env)
        return time.monotonic() - t, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="leave out the cold arm (its runs are the longest)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    arms = [a for a in ARMS if not (args.no_cold and a == "cold")]
    times: dict[str, list[float]] = {a: [] for a in arms}
    builds: dict[str, list[int]] = {a: [] for a in arms}
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mithrilfs-bench-jit-")))
        bench = Bench(base, stack.enter_context(redis_server()))
        tar, mega = bench.seed()
        print(f"node A and the seeding node done; tarball {tar.stat().st_size / 1e6:.1f} MB, "
              f"Mega-Cache {mega.stat().st_size / 1e6:.1f} MB", flush=True)
        for rep in range(args.reps):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                if arm == "A local":
                    t = time.monotonic()
                    out = bench.compile(bench.a_env)
                    seconds = time.monotonic() - t
                else:
                    seconds, out = bench.run(arm, tar, mega)
                if out["output_sha"] != bench.a_sha:
                    sys.exit(f"{arm}: the output differs from node A's")
                if arm != "cold" and (out["fxgraph_cache_hit"] == 0 or out["fxgraph_cache_miss"]):
                    sys.exit(f"{arm}: Inductor's FX graph cache did not hit: {out}")
                times[arm].append(seconds)
                builds[arm].append(out["builds"])
                print(f"rep {rep} {arm:20s} {seconds:7.2f} s  (compile {out['seconds']:.2f} s, "
                      f"{out['builds']} compiler builds, fx hit {out['fxgraph_cache_hit']}, "
                      f"aot hit {out['autograd_cache_hit']})", flush=True)
    a = median(times["A local"])
    result = {arm: {"median_s": round(median(v), 2), "ratio": round(median(v) / a, 2),
                    "runs": [round(x, 2) for x in v], "builds": builds[arm]} for arm, v in times.items()}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\nend to end (set-up + a fresh process's torch.compile), median of {args.reps}; new nodes have an empty"
          " store, TMPDIR and home")
    for arm, r in result.items():
        print(f"{arm:20s} {r['median_s']:7.2f} s  {r['ratio']:5.2f}x node A   runs {r['runs']}  builds {r['builds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
