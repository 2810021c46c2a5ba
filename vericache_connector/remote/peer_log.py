"""What a peer can put in the verifier's log: the text it sends, escaped (`esc`), and refusals of it, at a
bounded rate (`LogLimiter`). auth.py, gate.py and verifier_server.py log through these, so a peer without a
key can neither forge a log line nor flood the log."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("vericache.verifier")


def esc(text, limit: int = 200) -> str:
    """A peer-supplied string as a log line shows it: printable ASCII as is, anything else escaped (a
    newline cannot forge a line, a terminal escape does nothing), at most `limit` characters."""
    text = str(text)
    shown = text if text.isascii() and text.isprintable() else text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= limit else shown[:limit] + "..."


class LogLimiter:
    """At most `burst` warnings of one kind per `window_s`; the rest are counted and summed up in one line
    when the window has passed (flush(), or the next warning of that kind). Thread-safe."""

    def __init__(self, log: logging.Logger = logger, window_s: float = 10.0, burst: int = 3):
        self.log, self.window_s, self.burst = log, window_s, burst
        self._kinds: dict[str, list] = {}  # kind -> [window start, logged, suppressed]
        self._lock = threading.Lock()

    def __call__(self, kind: str, msg: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            w = self._kinds.get(kind)
            if w is None or now - w[0] >= self.window_s:
                self._summary(kind, w, now)
                w = self._kinds[kind] = [now, 0, 0]
            if w[1] < self.burst:
                w[1] += 1
                self.log.warning(msg, *args)
            else:
                w[2] += 1

    def flush(self) -> None:
        with self._lock:
            now = time.monotonic()
            for kind, w in list(self._kinds.items()):
                if now - w[0] >= self.window_s:
                    self._summary(kind, w, now)
                    del self._kinds[kind]

    def _summary(self, kind: str, w: list | None, now: float) -> None:
        if w is not None and w[2]:
            self.log.warning("%d more %s in %.0fs (logged %d of them)", w[2], kind, now - w[0], w[1])
