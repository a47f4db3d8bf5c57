"""A command ends without the interpreter's teardown (about 2 CPU-seconds once torch is loaded) but after what a
normal exit does first: non-daemon threads finish, ``atexit`` handlers run, output is flushed, the exit code is the
command's. The local workers' forkserver ends the same way."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

TEARDOWN = """
class Teardown:  # collected in the interpreter's teardown only
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=100)


def test_a_command_ends_after_threads_handlers_and_output_but_without_the_teardown():
    proc = _python(TEARDOWN + """
import atexit, sys, threading, time
from quietsync.commands.main import run
atexit.register(lambda: print("handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
sys.stdout.write("buffered line\\n")  # not flushed by the command
sys.argv = ["quietsync", "--version"]
run()
""")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "buffered line" and lines[1].startswith("quietsync "), lines
    assert "thread finished" in proc.stdout and "handler ran" in proc.stdout
    assert "teardown ran" not in proc.stdout


@pytest.mark.parametrize("argv,code,says", [
    (["bogus"], 2, "unknown command 'bogus'"),
    (["train", "--strategy", "nosuch"], 2, "--strategy"),
    (["train", "--help"], 0, "usage:"),
])
def test_the_exit_code_and_message_are_the_commands(argv, code, says):
    proc = subprocess.run([sys.executable, "-m", "quietsync", *argv], capture_output=True, text=True, timeout=100)
    assert proc.returncode == code, proc.stderr
    assert says in proc.stdout + proc.stderr


def test_the_forkserver_runs_the_handlers_registered_after_its_start_and_skips_the_teardown():
    proc = _python(TEARDOWN + """
import atexit
import quietsync.cli.forkserver_exit
atexit.register(lambda: print("later handler ran", flush=True))
""")
    assert proc.returncode == 0, proc.stderr
    assert "later handler ran" in proc.stdout and "teardown ran" not in proc.stdout
