"""Two real gloo processes (tests/scripts/rank_output_ddp.py): only rank 0 draws, and
what rank 1 prints (a line, a line written in pieces, a warning) appears once, whole,
above rank 0's live bar, whose final frame is intact. Rank 0's raw terminal stream is
replayed on a small terminal model (carriage return, cursor up, erase line), so the
assertions read the screen a person would see."""
import re
import subprocess
import sys

import pytest

from helpers import run_ranks

pytestmark = pytest.mark.multiproc

_CSI = re.compile(r"\x1b\[(\??)(\d*)([A-Za-z])")


def screen(stream: str) -> list[str]:
    """The lines left on a terminal (scrollback included) after ``stream`` was written."""
    lines, row, col, i = [""], 0, 0, 0
    while i < len(stream):
        m = _CSI.match(stream, i)
        if m:
            private, n, op = m.group(1), int(m.group(2) or 1), m.group(3)
            if not private and op == "A":
                row = max(row - n, 0)
            elif not private and op == "K":
                lines[row] = ""
            i = m.end()
            continue
        ch = stream[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        else:
            ln = lines[row].ljust(col)
            lines[row] = ln[:col] + ch + ln[col + 1:]
            col += 1
        i += 1
    return [ln.rstrip() for ln in lines]


@pytest.mark.timeout(150)
def test_other_ranks_print_above_rank0_live_bar(tmp_path):
    p = run_ranks("rank_output_ddp.py", tmp_path, timeout=140)
    # both ranks got their own stdout back at the end
    assert "rank 1 done; stdout restored: True" in p.stdout and "rank 0 done; stdout restored: True" in p.stdout
    # rank 1 wrote nothing of it to its own streams, and no rank drew a bar there
    for text in (p.stdout, p.stderr):
        assert "hello from rank 1" not in text and "rank one warns" not in text and "Epoch" not in text

    lines = screen((tmp_path / "console_0.txt").read_bytes().decode("utf-8"))   # keep the "\r"s
    long = "[rank 1] hello from rank 1: " + " ".join(f"word{i}" for i in range(30))
    assert lines.count(long) == 1
    assert lines.count("[rank 1] partial line") == 1
    warn = [i for i, ln in enumerate(lines) if ln.endswith("UserWarning: rank one warns")]
    assert len(warn) == 1 and lines[warn[0]].startswith("[rank 1] ")
    assert lines[warn[0] + 1] == '[rank 1]   warnings.warn("rank one warns")'
    # above the bar: the printed lines come first, then one bar (its final frame), then the summary
    bars = [i for i, ln in enumerate(lines) if ln.startswith("Epoch")]
    assert len(bars) == 1 and bars[0] > warn[0] + 1 > lines.index(long)
    assert re.fullmatch(r"Epoch 1/1 +━+ +8/8 +\d:\d\d:\d\d < \d:\d\d:\d\d +[\d.]+ it/s", lines[bars[0]]), \
        lines[bars[0]]
    assert re.fullmatch(r"step 16 loss=[\d.e+-]+", lines[bars[0] + 1]), lines[bars[0] + 1]
    assert lines[bars[0] + 2] == "Fit stopped: reached max_epochs=2"
    assert all(not ln or ln.startswith(("[rank 1]", "Epoch", "step", "Fit stopped", "  ")) for ln in lines), lines


def test_forwarded_stdout_still_acts_as_the_real_stream(tmp_path):
    """While lines are forwarded, ``sys.stdout`` still has the real stream's descriptor and
    attributes: ``subprocess.run(stdout=sys.stdout)`` and ``sys.stdout.buffer`` work on every
    rank as on rank 0."""
    import socket

    from ember.callbacks.rank_output import LineForwarder
    a, b = socket.socketpair()
    with open(tmp_path / "out.txt", "w") as real:
        fwd = LineForwarder(a, "[rank 1] ", real)
        assert fwd.fileno() == real.fileno() and fwd.buffer is real.buffer
        subprocess.run([sys.executable, "-c", "print('from a child')"], stdout=fwd, check=True)
        fwd.write("forwarded\n")
        b.settimeout(5)
        assert b.recv(4096) == b"[rank 1] forwarded\n"
        b.sendall(b"1\n")         # rank 0's acknowledgement: shown, so the rank does not print it itself
        fwd.close_forwarding()
    b.close()
    assert (tmp_path / "out.txt").read_text() == "from a child\n"


def test_ranks_forward_only_to_a_rank0_on_the_same_machine():
    # the same host name on another machine (containers on two hosts) is not the same machine
    import socket
    import sys as _sys
    from ember.callbacks import rank_output
    lines = []
    recv = rank_output.LineReceiver(lines.append)
    try:
        same_name_other_boot = (f"{socket.gethostname()}/another-boot-id", *recv.address[1:])
        before = _sys.stdout
        assert rank_output.connect(same_name_other_boot, 1) is None and _sys.stdout is before
        fwd = rank_output.connect(recv.address, 1)
        assert fwd is not None and _sys.stdout is fwd
        try:
            print("hello from rank 1")
        finally:
            rank_output.disconnect(fwd)
        assert _sys.stdout is before
    finally:
        recv.close(wait=5)
    assert lines == ["[rank 1] hello from rank 1"], lines
