"""Other ranks' prints above rank 0's live progress bar.

Under several processes only global rank 0 draws a progress bar. A ``print`` (any
write to ``sys.stdout``) or a Python warning on another rank of the same host would
otherwise land in the middle of rank 0's live display and tear it. While rank 0's bar
is live, the other local ranks send their complete lines to rank 0 over a loopback
TCP socket; rank 0 prints them, prefixed ``[rank N]``, through the bar's console, so
they appear above the bar, whole and once.

- One collective, at setup: rank 0 broadcasts the socket's address (``None`` when
  its bar is not live: then nothing changes). Nothing runs per training step; a line
  costs one ``sendall`` when it is printed.
- ``sys.stderr`` is left alone (a failing rank's traceback goes where it always
  went); only warnings, which Python writes to stderr, are forwarded.
- Nothing is lost: rank 0 acknowledges every line it has shown (a count sent back after
  each read), and a rank keeps its lines until then. When the connection ends (rank 0
  closed its receiver or went away: found before each send, and at the rank's own
  teardown, which waits up to :data:`DRAIN_S` for the last acknowledgements) every line
  not acknowledged goes to the rank's own stdout, in order, and so does every later one.
  The first ``sendall`` to a socket whose peer closed succeeds, so a send alone cannot
  tell; a line shown by rank 0 is always acknowledged before its receiver closes.

The socket listens on loopback, where any local process can reach it, so rank 0 trusts
nothing it did not authenticate:

- a per-run secret, made by rank 0 and broadcast with the address at setup, must be
  the first line of a connection (within :data:`HANDSHAKE_S` seconds), else it is
  closed and nothing it sent is shown;
- forwarded text is shown with its control characters neutralised (an escape
  sequence, a carriage return, a bidi override is printed as ``\\x1b``, ``\\x0d``, ...,
  so it cannot move the cursor, erase or forge lines, set the title or the clipboard);
- a line longer than :data:`MAX_LINE` bytes is cut (what is held per connection never
  exceeds that), and at most ``peers`` authenticated plus :data:`MAX_PENDING`
  connections waiting for their handshake are open at once (others are closed at once);
- teardown waits, for all of them together, at most ``wait`` seconds, and only while
  authenticated ranks are still sending: never on an idle or unauthenticated peer.
"""
from __future__ import annotations

import collections
import hmac
import io
import secrets
import socket
import sys
import threading
import time
import warnings
from typing import Callable, TextIO

#: the longest line shown whole, in bytes; longer lines are cut (and the rest dropped)
MAX_LINE = 64 * 1024
#: seconds a new connection has to send the run's secret
HANDSHAKE_S = 2.0
#: connections that may wait for their handshake at once
MAX_PENDING = 8
#: at teardown, a rank silent for this long is not waited for (its later lines go to its own stdout)
IDLE_S = 0.25
#: at a rank's teardown, seconds it waits for rank 0 to acknowledge its last lines
DRAIN_S = 2.0
#: bytes a rank keeps sent but not yet acknowledged before it waits for rank 0
MAX_UNACKED = 4 * 2**20
_HELLO = "ember-rank-output"
_BIDI = {0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069}


def neutralise(text: str) -> str:
    """``text`` with every control character (C0 but tab, DEL, C1) and bidi control
    written as a visible escape (``\\x1b``), so a terminal shows it instead of acting on it."""
    out = []
    for ch in text:
        o = ord(ch)
        if (o < 0x20 and ch != "\t") or 0x7F <= o <= 0x9F or o in _BIDI:
            out.append(f"\\x{o:02x}" if o <= 0xFF else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


def machine() -> str:
    """This machine, as the ranks compare it: the host name and, on Linux, the kernel's
    boot id (two machines given the same host name, e.g. containers on different
    hosts, still differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class LineForwarder(io.TextIOBase):
    """A ``sys.stdout`` replacement that sends each complete line to rank 0, prefixed
    with ``prefix``; writes go to ``fallback`` once the socket failed or closed."""

    def __init__(self, sock: socket.socket, prefix: str, fallback: TextIO) -> None:
        super().__init__()
        self._sock: socket.socket | None = sock
        self._prefix, self._fallback = prefix, fallback
        self._buf = ""
        self._lock = threading.Lock()
        self._unacked: collections.deque[str] = collections.deque()   # sent, not yet shown by rank 0
        self._unacked_bytes = 0
        self._acked = 0          # lines rank 0 acknowledged, counted since the connection opened
        self._ackbuf = b""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._fallback, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        """The real stream's descriptor (``subprocess.run(stdout=sys.stdout)``, faulthandler):
        what goes straight to the descriptor bypasses the forwarding, as before it."""
        return self._fallback.fileno()

    def __getattr__(self, name: str):
        # everything else a text stream may be asked for (``buffer``, ``reconfigure``, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._fallback, name)

    def write(self, s: str) -> int:
        with self._lock:
            if self._sock is None:
                return self._fallback.write(s)
            self._buf += s
            if "\n" in self._buf:
                done, self._buf = self._buf.rsplit("\n", 1)
                self._send(done.split("\n"))
            while len(self._buf) >= MAX_LINE // 4:   # a long partial line goes in pieces (rank 0 cuts at MAX_LINE)
                piece, self._buf = self._buf[:MAX_LINE // 4], self._buf[MAX_LINE // 4:]
                self._send([piece])
                if self._sock is None:
                    break
        return len(s)

    def send_lines(self, lines: list[str]) -> None:
        """Send whole lines now (a warning's text)."""
        with self._lock:
            if self._sock is None:
                self._fallback.write("".join(ln + "\n" for ln in lines))
                self._fallback.flush()
            else:
                self._send(lines)

    def _read_acks(self, timeout: float) -> bool:
        """Take in rank 0's acknowledgements (waiting up to ``timeout`` seconds for one);
        False when the connection ended (rank 0 closed its end, or went away)."""
        sock = self._sock
        if sock is None:
            return False
        saved = sock.gettimeout()
        try:
            while True:
                sock.settimeout(timeout if timeout > 0 else 0.0)   # 0: only what is there already
                try:
                    chunk = sock.recv(4096)
                except (BlockingIOError, socket.timeout):
                    return True
                except OSError:
                    return False
                if not chunk:
                    return False
                self._ackbuf += chunk
                if b"\n" in self._ackbuf:
                    done, self._ackbuf = self._ackbuf.rsplit(b"\n", 1)
                    try:
                        count = int(done.rsplit(b"\n", 1)[-1])
                    except ValueError:
                        return False
                    while self._acked < count and self._unacked:
                        self._unacked_bytes -= len(self._unacked.popleft())
                        self._acked += 1
                timeout = 0.0      # more only if it is there already
        finally:
            try:
                sock.settimeout(saved)
            except OSError:
                pass

    def _fail_over(self, lines: list[str]) -> None:
        """The connection ended: every line rank 0 did not acknowledge, then ``lines``, go to
        the rank's own stdout; so does every later write. Acknowledgements already received
        are taken in first: a send that failed because rank 0 closed may leave, unread, the
        acknowledgement of lines it showed just before (they would be printed twice)."""
        self._read_acks(0.0)
        self._close_socket()
        lost = list(self._unacked) + list(lines)
        self._unacked.clear()
        self._unacked_bytes = 0
        if lost:
            self._fallback.write("".join(ln + "\n" for ln in lost))
            self._fallback.flush()

    def _send(self, lines: list[str]) -> None:
        if not self._read_acks(0.0):      # rank 0 closed its receiver: a send would be lost
            return self._fail_over(lines)
        data = "".join(f"{self._prefix}{ln}\n" for ln in lines)
        try:
            self._sock.sendall(data.encode("utf-8", "replace"))   # type: ignore[union-attr]
        except OSError:
            return self._fail_over(lines)
        self._unacked.extend(lines)
        self._unacked_bytes += sum(len(ln) for ln in lines)
        while self._unacked_bytes > MAX_UNACKED:     # rank 0 far behind: wait for it, bounded
            before = len(self._unacked)
            if not self._read_acks(5.0) or len(self._unacked) == before:
                return self._fail_over([])

    def flush(self) -> None:
        """Lines are sent as they complete; a partial line waits for its newline (or close)."""
        if self._sock is None:
            self._fallback.flush()

    def close_forwarding(self, drain: float = DRAIN_S) -> None:
        """Send a pending partial line, wait up to ``drain`` seconds for rank 0 to acknowledge
        every line sent, write those it did not to ``fallback``, and close the socket; later
        writes go to ``fallback``."""
        with self._lock:
            if self._sock is not None and self._buf:
                self._send([self._buf])
            elif self._buf:
                self._fallback.write(self._buf)
            self._buf = ""
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_WR)    # rank 0 reads to the end, acknowledges, closes
                except OSError:
                    pass
                deadline = time.monotonic() + max(0.0, drain)
                while self._unacked and self._read_acks(max(0.0, deadline - time.monotonic())) \
                        and time.monotonic() < deadline:
                    pass
            self._fail_over([])

    def _close_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class LineReceiver:
    """Rank 0's end: a loopback listening socket and a daemon thread per connection
    that calls ``emit(line)`` for each line received, once the connection sent the
    run's secret; ``peers``: how many ranks may connect (the connections are bounded)."""

    def __init__(self, emit: Callable[[str], None], peers: int = 64) -> None:
        self._emit = emit
        self._secret = secrets.token_hex(16)
        self._peers = max(1, int(peers))
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self._srv.settimeout(0.2)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: set = set()        # connections waiting for their handshake
        self._authed: dict = {}           # connection -> when it last sent data (monotonic)
        self._showing: dict = {}          # connection -> lock held while its lines are shown and acknowledged
        self._closing = False
        self._accept = threading.Thread(target=self._accept_loop, name="ember-rank-output", daemon=True)
        self._accept.start()

    @property
    def address(self) -> tuple[str, int, str]:
        """``(machine, port, secret)``: the other ranks connect when they run on the same
        :func:`machine` (host name and boot id) and open with the secret."""
        return machine(), self._srv.getsockname()[1], self._secret

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                full = len(self._pending) >= MAX_PENDING or len(self._authed) >= self._peers
                if not full:
                    self._pending.add(conn)
            if full:             # bounded: anything more is closed at once
                _close(conn)
                continue
            th = threading.Thread(target=self._read, args=(conn,), name="ember-rank-output-reader", daemon=True)
            th.start()

    def _handshake(self, conn: socket.socket) -> bytes | None:
        """The bytes after a correct first line, or None (wrong, late, or too long)."""
        conn.settimeout(HANDSHAKE_S)
        deadline = time.monotonic() + HANDSHAKE_S
        buf = b""
        want = f"{_HELLO} {self._secret}\n".encode()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(buf) > len(want):
                return None
            conn.settimeout(left)
            chunk = conn.recv(len(want) + 1)
            if not chunk:
                return None
            buf += chunk
        first, rest = buf.split(b"\n", 1)
        return rest if hmac.compare_digest(first + b"\n", want) else None

    def _read(self, conn: socket.socket) -> None:
        rest = None
        try:
            rest = self._handshake(conn)
        except OSError:
            pass
        with self._lock:
            self._pending.discard(conn)
            if rest is not None and len(self._authed) < self._peers and not self._closing:
                self._authed[conn] = time.monotonic()
                self._showing[conn] = threading.Lock()
            else:
                rest = None
        if rest is None:
            _close(conn)
            return
        try:
            conn.settimeout(None)
            self._lines(conn, rest)
        except OSError:
            pass
        finally:
            with self._lock:
                self._authed.pop(conn, None)
                self._showing.pop(conn, None)
            _close(conn)

    def _lines(self, conn: socket.socket, buf: bytes) -> None:
        """Emit each line; never hold more than :data:`MAX_LINE` bytes of one. After each
        read, the count of lines taken so far goes back to the rank (its acknowledgement),
        under the connection's lock: :meth:`close` never closes between a line shown and its
        acknowledgement, and what arrives once it closes is neither shown nor acknowledged."""
        skipping = False
        count = acked = 0
        showing = self._showing[conn]
        while True:
            with showing:
                if self._closing:
                    return
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line, buf = buf[:nl], buf[nl + 1:]
                    count += 1
                    if skipping:
                        skipping = False
                    else:
                        self._show(line)
                if len(buf) > MAX_LINE:
                    if not skipping:
                        self._show(buf[:MAX_LINE], cut=True)
                    skipping, buf = True, b""
                if count != acked:
                    try:
                        conn.sendall(f"{count}\n".encode())
                    except OSError:
                        pass
                    acked = count
            chunk = conn.recv(65536)
            if not chunk:
                if buf and not skipping:
                    with showing:
                        if not self._closing:
                            self._show(buf)
                return
            buf += chunk
            self._authed[conn] = time.monotonic()     # still sending: teardown waits for its last lines

    def _show(self, line: bytes, cut: bool = False) -> None:
        text = neutralise(line.decode("utf-8", "replace"))
        if cut:
            text += f" ... [line cut at {MAX_LINE} bytes]"
        try:
            self._emit(text)
        except Exception:   # noqa: BLE001 - a display error must not stop the reading
            pass

    def close(self, wait: float) -> None:
        """Stop accepting; wait, at most ``wait`` seconds in all, while authenticated ranks
        are still sending (so their last lines are shown; one silent for :data:`IDLE_S`
        is not waited for), then close every socket. Idle connections that never
        authenticated are closed at once."""
        import select
        deadline = time.monotonic() + max(0.0, wait)
        self._stop.set()
        self._accept.join(timeout=1)
        with self._lock:
            pending = list(self._pending)
        for c in pending:     # idle, never authenticated: closed now (one that sent data finishes its handshake)
            try:
                ready = select.select([c], [], [], 0)[0]
            except (OSError, ValueError):
                ready = []
            if not ready:
                _close(c)
        while True:
            now = time.monotonic()
            with self._lock:      # still sending (or finishing its handshake): worth its last lines
                busy = bool(self._pending) or any(now - t < IDLE_S for t in self._authed.values())
            if not busy or now >= deadline:
                break
            time.sleep(0.02)
        with self._lock:
            self._closing = True
            conns = list(self._authed) + list(self._pending)
            showing = [self._showing.get(c) for c in conns]
        for c, lock in zip(conns, showing):
            # never between a line shown and its acknowledgement (a reader stuck in a send
            # to a rank that stopped reading is not waited for long)
            held = lock.acquire(timeout=1.0) if lock is not None else False
            try:
                _close(c)
            finally:
                if held:
                    lock.release()
        _close(self._srv)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def connect(address: tuple[str, int], rank: int) -> LineForwarder | None:
    """On a non-zero rank: replace ``sys.stdout`` and Python's warning printer with a
    :class:`LineForwarder` to rank 0's ``address``. None (nothing changed) when rank 0 is
    on another host or the connection fails."""
    host, port, secret = address
    if host != machine():
        return None
    try:
        sock = socket.create_connection(("127.0.0.1", int(port)), timeout=5)
        sock.settimeout(5)   # a stuck rank 0 never blocks a print for longer
        sock.sendall(f"{_HELLO} {secret}\n".encode())
    except OSError:
        return None
    fwd = LineForwarder(sock, f"[rank {rank}] ", sys.stdout)
    fwd._saved = (sys.stdout, warnings.showwarning)   # type: ignore[attr-defined]
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if file is not None:   # an explicit file: as asked
            return show(message, category, filename, lineno, file, line)
        text = warnings.formatwarning(message, category, filename, lineno, line)
        fwd.send_lines(text.rstrip("\n").split("\n"))

    fwd._showwarning = showwarning   # type: ignore[attr-defined]
    sys.stdout = fwd
    warnings.showwarning = showwarning
    return fwd


def disconnect(fwd: LineForwarder) -> None:
    """Undo :func:`connect` (the pending partial line is sent first)."""
    fwd.close_forwarding()
    saved_out, saved_show = fwd._saved   # type: ignore[attr-defined]
    if sys.stdout is fwd:
        sys.stdout = saved_out
    if warnings.showwarning is fwd._showwarning:   # type: ignore[attr-defined]
        warnings.showwarning = saved_show
