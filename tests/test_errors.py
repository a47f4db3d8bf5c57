"""``quietsync.errors.cause_chain``: an exception, then what it was raised from or while handling, each once."""

from __future__ import annotations

from quietsync.errors import cause_chain


def test_the_chain_follows_causes_then_contexts_and_stops_where_it_loops():
    a, b, c = ValueError("a"), KeyError("b"), OSError("c")
    a.__cause__, b.__context__ = b, c
    assert list(cause_chain(a)) == [a, b, c]
    c.__context__ = a  # a chain that loops back on itself
    assert list(cause_chain(a)) == [a, b, c]
    assert list(cause_chain(None)) == []


def test_an_explicit_cause_wins_over_the_context():
    try:
        try:
            raise KeyError("handled")
        except KeyError:
            raise RuntimeError("outer") from OSError("cause")
    except RuntimeError as e:
        assert [type(x) for x in cause_chain(e)] == [RuntimeError, OSError]
