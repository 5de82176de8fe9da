"""What keeps a shared demo safe to share: the open-host rule, login throttling per client address, session ownership,
CSV cell escaping and the lifetime of exported files. Knows nothing about Gradio or HTTP; the UI wires these in.

See docs/security.md for what is protected, how, and what is left to the operator.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import LOOPBACK_HOSTS, ServerSettings
from .errors import SettingsError

Clock = Callable[[], float]


def check_exposure(server: ServerSettings) -> str | None:
    """Refuse to serve the model beyond this machine with no login in front, unless the operator opted in
    (ALLOW_OPEN_HOST=true). Returns the warning to log when they did, else None."""
    if not server.is_open:
        return None
    where = "a public SHARE link" if server.share else f"HOST={server.host} (beyond this machine)"
    if not server.allow_open_host:
        raise SettingsError(
            f"Refusing to serve on {where} without a login: anyone who can reach it could use the model. Set "
            f"AUTH=user:password, or bind HOST to one of {', '.join(LOOPBACK_HOSTS)}, or, if that is really "
            "meant, set ALLOW_OPEN_HOST=true.")
    return f"Serving on {where} with no login (ALLOW_OPEN_HOST=true): anyone who can reach it can use the model."


class LoginThrottle:
    """At most `max_failures` failed logins per client address within `window_s`; then that address waits until
    its oldest failure leaves the window. A success clears the address. Memory is bounded (`max_addresses`)."""

    def __init__(self, max_failures: int, window_s: float, *, max_addresses: int = 10_000,
                 clock: Clock = time.monotonic) -> None:
        self.max_failures, self.window_s, self.max_addresses = int(max_failures), float(window_s), max_addresses
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after_s(self, address: str) -> float:
        """0 when `address` may try to log in now, else the seconds it must wait."""
        now = self._clock()
        with self._lock:
            times = self._failures.get(address)
            if times is None:
                return 0.0
            while times and now - times[0] >= self.window_s:
                times.popleft()
            if not times:
                del self._failures[address]
                return 0.0
            return max(0.0, self.window_s - (now - times[0])) if len(times) >= self.max_failures else 0.0

    def failed(self, address: str) -> None:
        with self._lock:
            times = self._failures.setdefault(address, deque(maxlen=self.max_failures))
            times.append(self._clock())
            self._failures.move_to_end(address)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)


class SessionOwners:
    """Which client owns a session id (Gradio's session hash): the first one that used it. Routes that act on a
    session by its id (cancel, heartbeat, the event stream) are allowed only to its owner. Bounded (LRU)."""

    def __init__(self, max_sessions: int = 50_000) -> None:
        self.max_sessions = max_sessions
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, session_id: str, owner: str) -> bool:
        """True if `owner` owns `session_id` (claiming it if nobody does yet)."""
        with self._lock:
            current = self._owners.get(session_id)
            if current is None:
                self._owners[session_id] = owner
                while len(self._owners) > self.max_sessions:
                    self._owners.popitem(last=False)
                return True
            self._owners.move_to_end(session_id)
            return current == owner

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._owners.pop(session_id, None)


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def escape_csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (starting with = + - @, tab or carriage return) gets a
    leading apostrophe (OWASP's CSV-injection advice); numbers and other values are kept as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


class ExportFiles:
    """Folders for exported stats files, one per export, each owned by a session. Deleted when their session ends
    (`release`) or once older than `ttl_s` (`sweep`, run at every new export)."""

    def __init__(self, ttl_s: float, root: Path | None = None, *, clock: Clock = time.monotonic) -> None:
        self.ttl_s = float(ttl_s)
        self.root = root
        self._clock = clock
        self._folders: list[tuple[float, str, Path]] = []  # (created, session, folder)
        self._lock = threading.Lock()

    def new_folder(self, session_id: str) -> Path:
        self.sweep()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="llm-demo-stats-", dir=self.root))
        with self._lock:
            self._folders.append((self._clock(), session_id, folder))
        return folder

    def sweep(self) -> int:
        """Delete folders older than ttl_s; returns how many."""
        now = self._clock()
        return self._remove(lambda created, _session: now - created >= self.ttl_s)

    def release(self, session_id: str) -> int:
        """Delete every folder of `session_id` (its session ended); returns how many."""
        return self._remove(lambda _created, session: session == session_id)

    def folders(self) -> list[Path]:
        with self._lock:
            return [folder for _, _, folder in self._folders]

    def _remove(self, doomed: Callable[[float, str], bool]) -> int:
        with self._lock:
            gone = [entry for entry in self._folders if doomed(entry[0], entry[1])]
            self._folders = [entry for entry in self._folders if entry not in gone]
        for _, _, folder in gone:
            shutil.rmtree(folder, ignore_errors=True)
        return len(gone)
