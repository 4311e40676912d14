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
- If the socket fails (rank 0 gone, connection refused) the rank writes to its own
  stdout again: no line is lost or held back.
"""
from __future__ import annotations

import io
import socket
import sys
import threading
import warnings
from typing import Callable, TextIO


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
        return len(s)

    def send_lines(self, lines: list[str]) -> None:
        """Send whole lines now (a warning's text)."""
        with self._lock:
            if self._sock is None:
                self._fallback.write("".join(ln + "\n" for ln in lines))
                self._fallback.flush()
            else:
                self._send(lines)

    def _send(self, lines: list[str]) -> None:
        data = "".join(f"{self._prefix}{ln}\n" for ln in lines)
        try:
            self._sock.sendall(data.encode("utf-8", "replace"))   # type: ignore[union-attr]
        except OSError:
            self._close_socket()
            self._fallback.write("".join(ln + "\n" for ln in lines))
            self._fallback.flush()

    def flush(self) -> None:
        """Lines are sent as they complete; a partial line waits for its newline (or close)."""
        if self._sock is None:
            self._fallback.flush()

    def close_forwarding(self) -> None:
        """Send a pending partial line and close the socket; later writes go to ``fallback``."""
        with self._lock:
            if self._sock is not None and self._buf:
                self._send([self._buf])
            elif self._buf:
                self._fallback.write(self._buf)
            self._buf = ""
            self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class LineReceiver:
    """Rank 0's end: a loopback listening socket and a daemon thread per connection
    that calls ``emit(line)`` for each line received."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self._srv.settimeout(0.2)
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._accept = threading.Thread(target=self._accept_loop, name="ember-rank-output", daemon=True)
        self._accept.start()

    @property
    def address(self) -> tuple[str, int]:
        """``(machine, port)``: the other ranks connect when they run on the same
        :func:`machine` (host name and boot id)."""
        return machine(), self._srv.getsockname()[1]

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._conns.append(conn)
            th = threading.Thread(target=self._read, args=(conn,), name="ember-rank-output-reader", daemon=True)
            th.start()
            self._readers.append(th)

    def _read(self, conn: socket.socket) -> None:
        try:
            with conn.makefile("r", encoding="utf-8", errors="replace", newline="\n") as f:
                for line in f:
                    try:
                        self._emit(line.rstrip("\n"))
                    except Exception:   # noqa: BLE001 - a display error must not stop the reading
                        pass
        except (OSError, ValueError):
            pass

    def close(self, wait: float) -> None:
        """Stop accepting; wait up to ``wait`` seconds for the other ranks to close their
        end (so their last lines are shown), then close every socket."""
        self._stop.set()
        self._accept.join(timeout=1)
        for th in list(self._readers):
            th.join(timeout=wait)
        for c in self._conns + [self._srv]:
            try:
                c.close()
            except OSError:
                pass


def connect(address: tuple[str, int], rank: int) -> LineForwarder | None:
    """On a non-zero rank: replace ``sys.stdout`` and Python's warning printer with a
    :class:`LineForwarder` to rank 0's ``address``. None (nothing changed) when rank 0 is
    on another host or the connection fails."""
    host, port = address
    if host != machine():
        return None
    try:
        sock = socket.create_connection(("127.0.0.1", int(port)), timeout=5)
        sock.settimeout(5)   # a stuck rank 0 never blocks a print for longer
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
