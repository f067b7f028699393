"""The README checked against the code: a README that drifts from what the commands, scripts and deploy files do fails here.

What can run in the suite runs (the object-storage quick start, every
command's ``--help``, every benchmark's ``--help``); the set-up is left to
``.ci/run``, which runs it on a fresh machine.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Mount, _cluster_port, is_mounted, pid_alive, run_cli, wait_for, wait_uploaded

from mithrilfs.testing.weed import remove_sockets

README = (REPO / "README.md").read_text()
VENV_BIN = Path(sys.executable).parent
#: SeaweedFS's default ports, which the quick start names (gRPC ports are these + 10000)
WEED_PORTS = (9333, 8080, 8888, 8333)


def section(title: str) -> str:
    """The README's text from the heading *title* to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", README, re.M)
    assert m, f"the README has no section {title!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(README, m.end())
    return README[m.end():end.start() if end else len(README)]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)


def command_lines(block: str) -> list[str]:
    """The block's commands, a line continued with ``\\`` joined to the next, comments left out."""
    return [line.split(" # ")[0].strip() for line in re.sub(r"\\\n", " ", block).splitlines()]


def table_rows(text: str) -> list[list[str]]:
    """Each row of the markdown tables in *text* (header and rule left out), as cells (``\\|`` kept in a cell)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows[1:] if rows else rows


def help_of(*command: str) -> str:
    res = run_cli(*command, "--help", timeout=60)
    assert res.returncode == 0, f"mithrilfs {' '.join(command)} --help: {res.stderr}"
    return res.stdout


@functools.cache
def subcommands() -> frozenset[str]:
    """The commands ``mithrilfs --help`` lists (aliases left out)."""
    return frozenset(re.findall(r"^    ([a-z]+)(?: \(\w+\))?(?:\s|$)", help_of(), re.M))


#: ``mithrilfs COMMAND --help`` for each COMMAND of argv, through the console script's own entry point, in one
#: process (a Python start per command took 20 s on the loaded 2-core machine); its exit status and text as JSON
HELPS = """
import contextlib, io, json, re, sys
from mithrilfs.cli.main import main

def help_of(*words):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            code = main([*words, "--help"])
        except SystemExit as e:
            code = e.code
    return code, text.getvalue()

out = {}
for name in sys.argv[1:]:
    code, text = help_of(name)
    # a command of subcommands (fleet gc) lists them indented under its positional arguments: theirs too
    for sub in re.findall(r"^    ([a-z][a-z-]*)(?:  |$)", text.split("options:")[0], re.M):
        sub_code, sub_text = help_of(name, sub)
        code, text = code or sub_code, text + sub_text
    out[name] = [code, text]
print(json.dumps(out))
"""


@functools.cache
def helps() -> dict[str, str]:
    res = subprocess.run([sys.executable, "-c", HELPS, *sorted(subcommands())], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = {}
    for name, (code, text) in json.loads(res.stdout).items():
        assert code in (0, None), f"mithrilfs {name} --help exited {code}"
        out[name] = text
    return out


def options(command_line: str) -> list[str]:
    """The long options a README command line uses (its comment left out)."""
    return re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", command_line.split(" # ")[0])


def test_readme_fits_on_a_few_screens():
    assert len(README.splitlines()) <= 300
    for doc in ("docs/design.md", "docs/benchmarks.md"):
        assert f"]({doc})" in README and (REPO / doc).exists()


def test_every_command_is_in_the_table_and_parses():
    rows = [r for r in table_rows(section("Use")) if r[0].startswith("`mithrilfs ")]
    table = {}
    for cell, _ in rows:
        line = cell.strip("`")
        table[line.split()[1]] = line
    listed = subcommands()
    assert listed <= table.keys(), f"commands missing from the README's table: {sorted(listed - table.keys())}"
    assert table.keys() <= listed, f"the README's table has commands mithrilfs lacks: {sorted(table.keys() - listed)}"
    for name, line in table.items():
        text = helps()[name]
        unknown = [o for o in options(line) if o not in text]
        assert not unknown, f"`{line}`: {name} --help has no {unknown}"


def test_every_command_line_in_the_readme_parses():
    """Every ``mithrilfs ...`` line of a code block names a real command and only its options."""
    aliases = {"unmount": "umount", "reload": "restart"}
    lines = [line for block in code_blocks(README) for line in command_lines(block) if line.startswith("mithrilfs ")]
    assert len(lines) >= 8
    for line in lines:
        words = line.split()
        name = aliases.get(words[1], words[1])
        assert name in subcommands(), f"`{line}`: no command {words[1]!r}"
        text = helps()[name]
        unknown = [o for o in options(line) if o not in text]
        assert not unknown, f"`{line}`: {words[1]} --help has no {unknown}"


def test_performance_table_commands_exist():
    rows = table_rows(section("Performance"))
    assert len(rows) >= 10 and all(len(r) == 5 for r in rows), rows
    commands = {r[4].strip("`") for r in rows}
    procs = {}
    for command in commands:
        words = command.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # the environment a row runs with
            words.pop(0)
        script = words[0]
        assert script.startswith("scripts/") and (REPO / script).exists(), f"{command}: no {script}"
        procs[command] = subprocess.Popen([sys.executable, str(REPO / script), "--help"], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=REPO)
    for command, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{command} --help: {err[-1000:]}"
        unknown = [a for a in command.split() if a.startswith("--") and a not in out]
        assert not unknown, f"{command}: the script has no {unknown}"


def test_setup_main_job_and_tests_are_what_ci_runs():
    setup = code_blocks(section("Set up (Debian/Ubuntu, Python 3.11+, as root or with sudo)"))[0]
    ci = (REPO / ".ci" / "run").read_text()
    scripts = re.findall(r"bash (scripts/[\w/-]+\.sh)", setup)
    assert len(scripts) == 2, setup  # the system's packages, the virtualenv
    for script in scripts:
        assert f"bash {script}" in ci and (REPO / script).exists()
    assert "scripts/setup/link-cli.sh" in (REPO / "scripts" / "setup" / "setup-venv.sh").read_text()  # `mithrilfs` on PATH
    [tests] = code_blocks(section("Run the tests"))
    assert f"exec {tests.strip()}" in ci
    demo = code_blocks(section("The main job: a torch.compile cache, cold then warm"))[0].split("\n")[0]
    assert demo == ".venv/bin/python scripts/demo.py" and (REPO / "scripts" / "demo.py").exists()


def test_deploy_files_carry_what_the_readme_promises():
    containers = section("Containers")
    run = code_blocks(containers)[0]
    said = " ".join(containers.split())  # the prose, line breaks aside
    # the image is built before it is run, and run with no more than the container test gives it
    assert run.index("docker build -t mithrilfs .") < run.index("docker run -d --name mithrilfs")
    sidecar = run[run.index("docker run -d"):].split("\ndocker run")[0]
    assert "--device /dev/fuse --cap-add SYS_ADMIN" in sidecar and "--privileged" not in sidecar
    assert "not `--privileged`" in said

    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yaml").read_text())["services"]["mithrilfs"]
    assert "privileged" not in compose and "(no `privileged`)" in said
    assert compose["devices"] == ["/dev/fuse"] and compose["cap_add"] == ["SYS_ADMIN"]
    assert compose["security_opt"] == ["apparmor=unconfined"] and "apparmor=unconfined" in sidecar
    assert compose["environment"]["MITHRILFS_MAX_SIZE"] == "50G" and "`MITHRILFS_MAX_SIZE: 50G`" in said

    pod = yaml.safe_load((REPO / "deploy" / "kubernetes.yaml").read_text())
    [side] = [c for c in pod["spec"]["initContainers"] if c["name"] == "mithrilfs"]
    assert side["restartPolicy"] == "Always" and side["securityContext"]["privileged"] is True
    assert "The sidecar is `privileged`" in said
    mounts = {m["name"]: m.get("mountPropagation") for m in side["volumeMounts"]}
    app_mounts = {m["name"]: m.get("mountPropagation") for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["cache"] == "Bidirectional" and app_mounts["cache"] == "HostToContainer"
    assert side["startupProbe"]["exec"]["command"][:3] == ["mithrilfs", "status", "--ready"]
    assert "hostPath" in {k for v in pod["spec"]["volumes"] if v["name"] == "store" for k in v}

    # every variable the README documents is one the entrypoint reads; the image fixes no budget
    entrypoint = (REPO / "deploy" / "entrypoint.sh").read_text()
    for var in set(re.findall(r"MITHRILFS_[A-Z0-9_]+", containers)):
        assert f"${{{var}" in entrypoint, f"the README documents {var}, the entrypoint ignores it"
    env_lines = [line for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("ENV ")]
    assert env_lines and not any("MITHRILFS_MAX_SIZE" in line for line in env_lines)


@pytest.mark.timeout(180)
def test_object_storage_quick_start_runs_as_written(tmp_path: Path):
    """The quick start's block run by bash, with this test's free ports and directories in place of the defaults."""
    [block] = code_blocks(section("Object storage on this machine: a SeaweedFS quick start"))
    stop = re.search(r"To\s+stop: `([^`]+)`", section("Object storage on this machine: a SeaweedFS quick start"))
    assert stop, "the quick start says how to stop"
    stop_line = stop.group(1)
    root, mp = tmp_path / "seaweedfs", tmp_path / "cache"
    ports = {}
    for default in WEED_PORTS:
        assert str(default) in block, f"the quick start no longer names port {default}"
        ports[default] = _cluster_port()  # gRPC at port + 10000, as weed's default
    wanted = ports.values()
    assert len(set(wanted)) == len(ports)

    def ours(text: str) -> str:
        for default, port in ports.items():
            text = re.sub(rf"\b{default}\b", str(port), text)
        return (text.replace("/tmp/seaweedfs", str(root)).replace("/tmp/cache", str(mp))
                .replace(".venv/bin/", f"{VENV_BIN}/"))

    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", XDG_CACHE_HOME=str(tmp_path / "home-cache"))
    mount = Mount(mp, tmp_path / "home-cache" / "mithrilfs")
    pid_file = root / "weed.pid"
    try:
        # a session of its own: every process of the block (weed, a `weed shell` of its loop) is in its group
        block_run = subprocess.Popen(["bash", "-euo", "pipefail", "-c", ours(block)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
        try:
            out, err = block_run.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # the bucket never got made: end the block's processes, say what weed said
            os.killpg(block_run.pid, signal.SIGKILL)
            block_run.communicate()
            log = root / "weed.log"
            pytest.fail(f"the quick start did not finish: {log.read_text()[-2000:] if log.exists() else 'no weed.log'}")
        assert block_run.returncode == 0, out[-2000:] + err[-2000:]
        assert is_mounted(mp)
        mount.pid = int((mp / ".mithrilfs" / "pid").read_text())
        (mp / "hello.txt").write_bytes(b"through the bucket")
        assert (mp / "hello.txt").read_bytes() == b"through the bucket"
        wait_uploaded(mount)  # the file reached the bucket
        status = run_cli("status", str(mp), env=env)
        assert status.returncode == 0 and f"s3://compile-cache/fleet at http://127.0.0.1:{ports[8333]}: reachable" \
            in status.stdout, status.stdout + status.stderr
        res = subprocess.run(["bash", "-euc", ours(stop_line)], env=env, capture_output=True, text=True, timeout=60,
                             cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mp)  # and weed was sent SIGTERM (a wrong pid fails `kill`): it takes ~15 s to
        # stop gracefully, which this test does not wait for
    finally:  # also after a timeout of the block: weed, started in the background, outlives its bash
        mount.force_cleanup()
        weed = int(pid_file.read_text()) if pid_file.exists() else 0
        if weed and pid_alive(weed):
            os.kill(weed, signal.SIGKILL)
            wait_for(lambda: not pid_alive(weed), 10, "weed to die")
        remove_sockets((*wanted, *(p + 10000 for p in wanted)))  # its gRPC ports: weed's default, port + 10000


def test_printed_examples_are_what_the_commands_print():
    """The README's ``why`` sample and its account of the hit rate say what the code prints."""
    from mithrilfs.observe.stats import HIT_RATE_MEANS, recompiles_line

    assert f"\n{recompiles_line(1, 16 << 10, 0)}\n" in README
    assert "hits / (hits + misses)" in HIT_RATE_MEANS and "hits / (hits + misses)" in section("Use")
