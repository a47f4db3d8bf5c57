"""A one-worker stand-in for what ``--adapt``'s link probe asks of a transport (``strategies/parts/link_probe.py``):
a meter whose bytes and seconds a test sets, a topology, and an agreement that returns this worker's value."""

from __future__ import annotations

from quietsync.topology import Topology


class FakeMeter:
    """The transport meter's snapshot of the ``world`` group: ``sent`` bytes over ``seconds``, set by the test."""

    def __init__(self) -> None:
        self.sent, self.seconds = 0.0, 0.0

    def snapshot(self) -> dict:
        return {"world": {"sent": self.sent, "recv": self.sent, "seconds": self.seconds}}


class FakeTransport:
    """What the controller asks of a transport: the meter, the topology, and agreement (one worker here)."""

    def __init__(self) -> None:
        self.meter, self.topology = FakeMeter(), Topology(0, 2, 2)

    def agree(self, value: float, op: str = "max") -> float:
        return float(value)
