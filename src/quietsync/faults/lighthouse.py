"""The Lighthouse: torchft's quorum server, one per job. Replica groups send it their heartbeats and, at every
round boundary, their quorum requests; it answers each with the replicas present.

The local launcher starts one in its own process (:func:`start_lighthouse`); on a cluster, run ``quietsync
lighthouse`` (or torchft's ``torchft_lighthouse``) on a machine every replica group reaches and give its address
to each as ``--lighthouse HOST:PORT``. Its knobs (torchft's own, defaults chosen for quick recovery):

* ``--heartbeat-timeout-ms`` -- a replica silent this long is dead: the survivors' next quorum forms without it
  after about this long (torchft's default is 5000; 2000 here);
* ``--join-timeout-ms`` -- how long a quorum that lost a member waits for a replica that heartbeats but has not
  asked to join yet (a replica group still starting up);
* ``--min-replicas`` -- the fewest replicas a quorum may have (1: one survivor trains on alone).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

HEARTBEAT_TIMEOUT_MS = 2000
"""A replica group silent this long is dead (a lost replica costs the survivors about this long)."""
JOIN_TIMEOUT_MS = 10000
"""A quorum that lost a member waits this long for replicas that heartbeat but have not asked to join."""


@dataclass(frozen=True)
class LighthouseConfig:
    """A Lighthouse's knobs."""

    bind: str = "[::]:29510"
    """Address to listen on (port 0: any free port)."""
    min_replicas: int = 1
    """The fewest replicas a quorum may have."""
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS
    """A replica silent this long is dead."""
    join_timeout_ms: int = JOIN_TIMEOUT_MS
    """How long a quorum waits for a heartbeating replica that has not asked to join."""
    quorum_tick_ms: int = 100
    """How often the Lighthouse re-checks a quorum that is waiting."""


def start_lighthouse(config: LighthouseConfig):  # noqa: ANN201 - torchft's LighthouseServer
    """A running Lighthouse in this process (``.address()``, ``.shutdown()``)."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=config.bind, min_replicas=config.min_replicas,
                            join_timeout_ms=config.join_timeout_ms, quorum_tick_ms=config.quorum_tick_ms,
                            heartbeat_timeout_ms=config.heartbeat_timeout_ms)


def http_address(address: str) -> str:
    """``http://host:port`` of an address given as ``host:port`` or ``http://host:port``."""
    return address if "://" in address else f"http://{address}"


def reachable(address: str, timeout_s: float) -> str | None:
    """None if a Lighthouse answers at ``address`` (its status page, no side effect), else why not."""
    try:
        with urllib.request.urlopen(http_address(address).rstrip("/") + "/status", timeout=timeout_s) as reply:
            if reply.status == 200:
                return None
            return f"HTTP {reply.status}"
    except urllib.error.URLError as e:
        return str(e.reason)
    except (OSError, ValueError) as e:
        return str(e)


def _status_page(address: str, timeout_s: float) -> str | None:
    """The Lighthouse's status page (torchft 0.2.0's HTML), or None when it does not answer."""
    try:
        with urllib.request.urlopen(http_address(address).rstrip("/") + "/status", timeout=timeout_s) as reply:
            return reply.read().decode(errors="replace")
    except (OSError, ValueError):  # URLError is an OSError
        return None


def latest_members(address: str, timeout_s: float) -> list[str] | None:
    """The replica ids (torchft's, ``<replica group's id>:<incarnation>``) of the last quorum the Lighthouse at
    ``address`` formed, read from its status page; None when it formed none yet or does not answer."""
    page = _status_page(address, timeout_s)
    if page is None or "Previous quorum id:" not in page:
        return None
    # each member of the previous quorum is a <div class="member ..."> opening with its id in bold
    return re.findall(r'<div class="member[^"]*"\s*>\s*<b>([^<]*)</b>', page)


def stale_heartbeats(address: str, timeout_s: float) -> list[str] | None:
    """The replica ids whose last heartbeat the Lighthouse at ``address`` counts as too old (past its
    ``--heartbeat-timeout-ms``: dead, or frozen), read from its status page; None when it does not answer."""
    page = _status_page(address, timeout_s)
    if page is None:
        return None
    # <li class="heartbeat [old]">ID: seen T ago</li>; an id holds a ':' of its own (group:incarnation)
    return [rid.strip() for cls, rid in re.findall(r'<li class="heartbeat([^"]*)">\s*(.*?): seen ', page, re.S)
            if "old" in cls.split()]


def pending_requests(address: str, timeout_s: float) -> int | None:
    """How many replica groups' quorum requests the Lighthouse at ``address`` holds now (those of live replica groups:
    its status page's ``[N/M participants healthy]``), or None when it does not answer."""
    page = _status_page(address, timeout_s)
    if page is None:
        return None
    found = re.search(r"\[(\d+)/\d+ participants healthy\]", page)
    return int(found.group(1)) if found else 0


def lighthouse_main(argv: list[str]) -> int:
    """``quietsync lighthouse``: run a Lighthouse until interrupted (SIGINT/SIGTERM); prints its address."""
    from ..cli.flags import OneLineParser

    parser = OneLineParser(prog="quietsync lighthouse",
                           description="Run the quorum server of a --fault-tolerance torchft job (docs/faults.md).")
    defaults = LighthouseConfig()
    parser.add_argument("--bind", default=defaults.bind, help=f"address to listen on (default: {defaults.bind})")
    for name, help_text in (("min_replicas", "the fewest replicas a quorum may have"),
                            ("heartbeat_timeout_ms", "a replica silent this long is dead"),
                            ("join_timeout_ms", "how long a quorum waits for a heartbeating replica that has not "
                                                "asked to join"),
                            ("quorum_tick_ms", "how often a waiting quorum is re-checked")):
        default = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help=f"{help_text} (default: {default})")
    args = parser.parse_args(argv)
    for name in ("min_replicas", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(args, name)}")
    try:
        server = start_lighthouse(LighthouseConfig(args.bind, args.min_replicas, args.heartbeat_timeout_ms,
                                                   args.join_timeout_ms, args.quorum_tick_ms))
    except ModuleNotFoundError:
        parser.error("needs the torchft package: pip install 'quietsync[ft]'")
    except Exception as e:  # noqa: BLE001 - torchft raises RuntimeError for a port in use, a bad address
        parser.error(f"--bind {args.bind}: {' '.join(str(e).split())}")
    print(f"quietsync lighthouse: listening on {server.address()} (heartbeat timeout {args.heartbeat_timeout_ms} ms); "
          "stop with Ctrl-C", flush=True)
    done = threading.Event()
    # both only end the wait, so the server is shut down below (SIGTERM would otherwise kill it outright)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    print("quietsync lighthouse: stopped", file=sys.stderr, flush=True)
    return 0


__all__ = ["HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS", "LighthouseConfig", "http_address", "latest_members",
           "lighthouse_main", "pending_requests", "reachable", "stale_heartbeats", "start_lighthouse"]
