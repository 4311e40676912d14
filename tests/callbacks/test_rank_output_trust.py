"""Rank 0's output-forwarding socket trusts nothing it did not authenticate: a local
process without the run's secret shows nothing, forwarded text cannot act on the
terminal, a line without a newline cannot grow rank 0's memory, connections are
bounded, and teardown never waits on idle peers. Real sockets on loopback."""
from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

from ember.callbacks import rank_output
from ember.callbacks.rank_output import MAX_LINE, LineReceiver


class Lines:
    def __init__(self):
        self.lines, self.event = [], threading.Event()

    def __call__(self, line):
        self.lines.append(line)
        self.event.set()


@pytest.fixture
def receiver():
    got = Lines()
    recv = LineReceiver(got, peers=2)
    yield recv, got
    recv.close(wait=0)


def _raw(recv, hello: bool):
    s = socket.create_connection(("127.0.0.1", recv.address[1]), timeout=10)
    if hello:
        s.sendall(f"ember-rank-output {recv.address[2]}\n".encode())
    return s


def _closed_by_peer(s, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_local_process_without_the_secret_shows_nothing(receiver):
    recv, got = receiver
    for first in (b"\x1b[1A\x1b[2Kember: fit finished, all good\n", b"ember-rank-output 0000\nforged\n"):
        s = _raw(recv, hello=False)
        s.sendall(first)
        assert _closed_by_peer(s, 5)           # refused: closed by rank 0
        s.close()
    time.sleep(0.3)
    assert got.lines == []


def test_forwarded_control_sequences_are_shown_not_acted_on(receiver):
    recv, got = receiver
    before = sys.stdout
    fwd = rank_output.connect(recv.address, 1)
    assert fwd is not None
    try:
        print("\x1b[1A\x1b[2Kforged line")                      # cursor up, erase line
        print("\x1b]0;owned title\x07 and \x1b]52;c;ZXZpbA==\x07")   # OSC title, OSC 52 clipboard
        print("over\rwrite \u202edesrever")                      # carriage return, bidi override
    finally:
        rank_output.disconnect(fwd)
    assert sys.stdout is before
    deadline = time.time() + 5
    while len(got.lines) < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert got.lines == ["[rank 1] \\x1b[1A\\x1b[2Kforged line",
                         "[rank 1] \\x1b]0;owned title\\x07 and \\x1b]52;c;ZXZpbA==\\x07",
                         "[rank 1] over\\x0dwrite \\u202edesrever"], got.lines
    assert not any(c in "".join(got.lines) for c in "\x1b\x07\r\u202e")


def test_a_line_without_newline_is_cut_and_never_held_whole(receiver):
    recv, got = receiver
    s = _raw(recv, hello=True)
    chunk = b"x" * (1 << 20)
    for _ in range(40):                         # 40 MB, no newline
        s.sendall(chunk)
    s.sendall(b"\nnext line\n")
    s.close()
    deadline = time.time() + 20
    while len(got.lines) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(got.lines) == 2, [len(x) for x in got.lines]
    assert got.lines[0] == "x" * MAX_LINE + f" ... [line cut at {MAX_LINE} bytes]"
    assert got.lines[1] == "next line"


def test_connections_are_bounded_and_teardown_never_waits_on_idle_peers():
    got = Lines()
    recv = LineReceiver(got, peers=1)
    idle = [_raw(recv, hello=False) for _ in range(30)]      # connected, silent
    ranked = _raw(recv, hello=True)                          # the one real rank, idle too
    time.sleep(0.5)
    # beyond the handshake slots (and the one authenticated peer) connections are closed at once
    closed = sum(_closed_by_peer(s, 0.5) for s in idle)
    assert closed >= 30 - 8, closed
    t0 = time.monotonic()
    recv.close(wait=5.0)
    took = time.monotonic() - t0
    assert took < 1.5, took                     # was about 5 s per idle connection
    assert _closed_by_peer(ranked, 2)
    for s in idle + [ranked]:
        s.close()
    assert got.lines == []


def _forward_to(recv, rank=1):
    """A forwarding rank in this process: its own stdout is a StringIO (what it falls back to)."""
    import io
    own = io.StringIO()
    saved, sys.stdout = sys.stdout, own
    try:
        fwd = rank_output.connect(recv.address, rank)
    finally:
        sys.stdout = saved
    assert fwd is not None
    return fwd, own


def test_a_line_printed_after_rank0_closed_its_receiver_goes_to_the_ranks_own_stdout():
    """The first sendall to a socket whose peer closed succeeds: the line must not vanish."""
    got = Lines()
    recv = LineReceiver(got, peers=1)
    fwd, own = _forward_to(recv)
    fwd.write("shown by rank 0\n")
    assert got.event.wait(5)
    recv.close(wait=0)
    fwd.write("first after close\n")
    fwd.write("second after close\n")
    rank_output.disconnect(fwd)
    assert got.lines == ["[rank 1] shown by rank 0"]
    assert own.getvalue() == "first after close\nsecond after close\n"


def test_lines_in_flight_when_rank0_closes_are_shown_once_or_printed_by_the_rank():
    got = Lines()
    recv = LineReceiver(got, peers=1)
    fwd, own = _forward_to(recv)
    closed, sent = threading.Event(), []

    def talk():
        i, after = 0, 0
        while after < 200 and i < 10**6:
            fwd.write(f"line {i}\n")
            i += 1
            after += closed.is_set()
        sent.append(i)
    t = threading.Thread(target=talk)
    t.start()
    while len(got.lines) < 50:
        time.sleep(0.001)
    recv.close(wait=0)                        # while the rank is still sending
    closed.set()
    t.join(60)
    rank_output.disconnect(fwd)
    shown = [ln.removeprefix("[rank 1] ") for ln in got.lines]
    printed = own.getvalue().splitlines()
    assert len(printed) >= 150, (len(shown), len(printed))   # those sent after the close at least
    assert shown + printed == [f"line {i}" for i in range(sent[0])]     # each once, in order


def test_an_acknowledgement_left_unread_when_a_send_fails_still_counts():
    """Rank 0 showed a line, acknowledged it and closed; the rank's next send failed before
    it read that acknowledgement: the shown line is not printed by the rank again (the race
    behind a rare duplicate in the test above)."""
    import io
    a, b = socket.socketpair()
    own = io.StringIO()
    fwd = rank_output.LineForwarder(a, "[rank 1] ", own)
    fwd._send(["shown"])
    assert b.recv(100) == b"[rank 1] shown\n"
    b.sendall(b"1\n")        # the acknowledgement, still unread on the rank's side
    b.close()
    time.sleep(0.05)
    fwd._fail_over(["after"])   # what a failed sendall does
    assert own.getvalue() == "after\n"


def test_a_rank_waits_at_its_teardown_for_rank0_to_show_its_last_lines():
    got = Lines()
    recv = LineReceiver(got, peers=1)
    fwd, own = _forward_to(recv)
    for i in range(200):
        fwd.write(f"last {i}\n")
    rank_output.disconnect(fwd)               # sent and acknowledged, or printed here: never both
    recv.close(wait=0)
    assert [ln.removeprefix("[rank 1] ") for ln in got.lines] + own.getvalue().splitlines() == \
        [f"last {i}" for i in range(200)]
