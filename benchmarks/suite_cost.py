"""What a pytest run costs: CPU seconds of every process it started, and how many Python interpreters started.

Wall-clock time of the test suite on a machine shared with other work is noise; CPU seconds and the number of
fresh interpreters (each one importing torch costs ~2-4 CPU-s, transformers as much again) are not. This runs
``python -m pytest ARGS`` as a child of a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``), so every
descendant — pytest-xdist workers, forkservers, spawned training workers, ``quietsync train`` subprocesses,
even ones orphaned by a killed parent — is reaped here and its CPU time counted (``RUSAGE_CHILDREN``). A
``sitecustomize`` put first on ``PYTHONPATH`` logs each interpreter start and its first import of torch and of
transformers (forked children are not new interpreters and are not counted; their CPU time is).

Usage::

    python benchmarks/suite_cost.py --label before --json benchmarks/results/suite_cost.json -- -q -n 2 tests/train

Prints wall-clock seconds, CPU seconds (user + system), interpreters started (total, importing torch, importing
transformers), a breakdown by kind of interpreter, the ``--top`` tests with the most CPU seconds (a plugin
counts each test's own process, its reaped subprocesses and its forkserver's reaped workers; CPU of a process
orphaned by the test, or reaped after the test ended, goes uncounted there but not in the total), and
processes still alive when pytest exited (leaks). ``--json`` appends the record to a JSON list. Tests that replace
``PYTHONPATH`` in the environment they give a
subprocess hide that subprocess's interpreters from the count (prepend to it instead).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HOOK = r'''
import os, sys
_log = os.environ.get("SUITE_COST_LOG")
if _log:
    def _write(line):
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    _write("start %d %d %s" % (os.getpid(), os.getppid(), " ".join(sys.orig_argv[1:]).replace("\n", " ")[:300]))

    class _Watch:
        seen = set()

        def find_spec(self, name, path=None, target=None):
            if name in ("torch", "transformers") and name not in self.seen:
                self.seen.add(name)
                _write("import %d %s" % (os.getpid(), name))
            return None

    sys.meta_path.insert(0, _Watch())
'''


PLUGIN = r'''
"""pytest plugin of suite_cost: CPU seconds of each test (setup, call, teardown): this test process's own, its
reaped children's (subprocesses and what they reaped) and its forkserver's (the forked workers it reaped)."""
import json, os, resource, time
from pathlib import Path

import pytest

_OUT = os.environ.get("SUITE_COST_TESTS")


def _forkserver_s():
    try:
        from multiprocessing import forkserver
        pid = forkserver._forkserver._forkserver_pid
        if not pid:
            return 0.0
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    except Exception:  # noqa: BLE001 - gone, or not started
        return 0.0


def _cpu_s():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + _forkserver_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_s(), time.perf_counter()
    yield
    if _OUT:
        line = json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_s() - cpu, 2),
                           "wall_s": round(time.perf_counter() - wall, 2)})
        fd = os.open(_OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
'''


def _kind(argv: str) -> str:
    """A coarse name for an interpreter from its arguments."""
    if "multiprocessing.resource_tracker" in argv:
        return "resource tracker"
    if "from multiprocessing.forkserver import main" in argv:
        return "forkserver"
    if "from multiprocessing.spawn import spawn_main" in argv or "--multiprocessing-fork" in argv:
        return "spawned worker"
    if "import sys;exec(eval(sys.stdin" in argv:
        return "xdist worker"
    if "-m quietsync " in argv or "bin/quietsync " in argv:
        return "quietsync cli"
    if "bin/torchrun" in argv or "bin/accelerate" in argv:
        return "torchrun/accelerate"
    if argv.startswith("-m pytest"):
        return "pytest"
    return "other"


def measure(pytest_args: list[str], env_extra: dict[str, str] | None = None, top: int = 25) -> dict:
    """Run pytest with ``pytest_args`` under a subreaper; return the cost record."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # 36 = PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    with tempfile.TemporaryDirectory(prefix="suite-cost-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(HOOK)
        Path(tmp, "suite_cost_plugin.py").write_text(PLUGIN)
        log, per_test = Path(tmp, "log"), Path(tmp, "tests")
        env = dict(os.environ, **(env_extra or {}))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, env.get("PYTHONPATH", "")) if p)
        env["SUITE_COST_LOG"] = str(log)
        env["SUITE_COST_TESTS"] = str(per_test)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "suite_cost_plugin", *pytest_args], env=env)
        rc = proc.wait()
        wall = time.perf_counter() - t0
        leftovers = []
        while True:  # orphans reparented to us: count their CPU, report them as leaks
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                leftovers.append(_alive_children())
                time.sleep(0.5)
                if len(leftovers) > 120:
                    break
                continue
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        lines = log.read_text().splitlines() if log.exists() else []
        tests = [json.loads(x) for x in per_test.read_text().splitlines()] if per_test.exists() else []
    starts = {}
    imports: dict[str, set[int]] = {"torch": set(), "transformers": set()}
    for line in lines:
        parts = line.split(" ", 3)
        if parts[0] == "start":
            starts[int(parts[1])] = parts[3] if len(parts) > 3 else ""
        elif parts[0] == "import":
            imports[parts[2]].add(int(parts[1]))
    kinds = Counter(_kind(a) for a in starts.values())
    kinds_torch = Counter(_kind(starts[p]) for p in imports["torch"] if p in starts)
    return {
        "args": pytest_args, "exit_code": rc, "wall_s": round(wall, 1),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
        "cpu_user_s": round(after.ru_utime - before.ru_utime, 1),
        "interpreters": len(starts), "with_torch": len(imports["torch"]),
        "with_transformers": len(imports["transformers"]),
        "by_kind": dict(kinds), "by_kind_with_torch": dict(kinds_torch),
        "other_argv": sorted({a[:100] for a in starts.values() if _kind(a) == "other"})[:12],
        "tests": len(tests), "tests_cpu_s": round(sum(t["cpu_s"] for t in tests), 1),
        "costliest_tests": sorted(tests, key=lambda t: -t["cpu_s"])[:top],
        "alive_after_pytest": max((len(x) for x in leftovers), default=0),
        "load_avg_1m_at_end": os.getloadavg()[0],
    }


def _alive_children() -> list[int]:
    me = str(os.getpid())
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            out.append(int(stat.parent.name))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="", help="a name for this measurement in the JSON record")
    parser.add_argument("--json", type=Path, help="append the record to this JSON list")
    parser.add_argument("--top", type=int, default=25, help="list this many tests with the most CPU seconds")
    parser.add_argument("--per-test", type=Path, help="write every test's CPU and wall seconds here (JSON)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest arguments")
    args = parser.parse_args()
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    record = {"label": args.label, **measure(pytest_args, top=max(args.top, 10**6 if args.per_test else 0))}
    if args.per_test:
        args.per_test.write_text(json.dumps(record["costliest_tests"], indent=0) + "\n")
    record["costliest_tests"] = record["costliest_tests"][:args.top]
    print(json.dumps(record, indent=1))
    if args.json:
        data = json.loads(args.json.read_text()) if args.json.exists() else []
        data.append(record)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return record["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
