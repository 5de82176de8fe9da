"""What keeps a shared demo safe to share: the open-host rule, who a request's person is, login throttling per user
and per address, session ownership, JSON parsed with a depth limit, CSV cell escaping and the lifetime of exported
files. Knows nothing about Gradio or HTTP (a request is read by its attributes); the UI wires these in.

See docs/security.md for what is protected, how, and what is left to the operator.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .config import LOOPBACK_HOSTS, ServerSettings
from .errors import AuthError, InputError, SettingsError

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
    """Failed logins (and failed /v1 API keys) counted per user name and per client address: past `max_failures`
    within `window_s` for either, the next attempt waits until that count's oldest failure leaves the window, even
    with the right password. Per name, so a guesser cannot reset the count by changing address; per address, so one
    client cannot walk through every name. Only names in `users` (the AUTH logins) get their own count, so invented
    names cannot push a real user's count out of memory. A success clears that user's count, not the address's."""

    def __init__(self, max_failures: int, window_s: float, *, users: Iterable[str] = (),
                 max_addresses: int = 10_000, clock: Clock = time.monotonic) -> None:
        self.max_failures, self.window_s, self.max_addresses = int(max_failures), float(window_s), max_addresses
        self.users = frozenset(users)
        self._clock = clock
        self._by_user: dict[str, deque[float]] = {}  # failure times; bounded by the AUTH logins
        self._by_address: OrderedDict[str, deque[float]] = OrderedDict()  # bounded by max_addresses (LRU)
        self._lock = threading.Lock()

    def _counts(self, user: str | None, address: str | None) -> list[tuple[dict[str, deque[float]], str]]:
        counts: list[tuple[dict[str, deque[float]], str]] = []
        if user is not None and user in self.users:
            counts.append((self._by_user, user))
        if address is not None:
            counts.append((self._by_address, address))
        return counts

    def retry_after_s(self, address: str | None, user: str | None = None) -> float:
        """0 when this user from this address may try now, else the seconds to wait (the longer of the two)."""
        now = self._clock()
        wait_s = 0.0
        with self._lock:
            for table, key in self._counts(user, address):
                times = table.get(key)
                if times is None:
                    continue
                while times and now - times[0] >= self.window_s:
                    times.popleft()
                if not times:
                    del table[key]
                elif len(times) >= self.max_failures:
                    wait_s = max(wait_s, self.window_s - (now - times[0]))
        return wait_s

    def failed(self, address: str | None, user: str | None = None) -> None:
        with self._lock:
            for table, key in self._counts(user, address):
                table.setdefault(key, deque(maxlen=self.max_failures)).append(self._clock())
            if address is not None:
                self._by_address.move_to_end(address)
                while len(self._by_address) > self.max_addresses:
                    self._by_address.popitem(last=False)

    def succeeded(self, address: str | None, user: str | None = None) -> None:
        """A right password: that user's count starts again (the address's stays: it may have tried other names)."""
        with self._lock:
            if user is not None:
                self._by_user.pop(user, None)
            elif address is not None:
                self._by_address.pop(address, None)


def person_of(request: Any, server: ServerSettings) -> str:
    """Who is asking: the one key for fair share, per-person limits and session owners. With AUTH, "user:NAME": the
    Gradio login (`gr.Request.username`) or the user whose key a /v1 request carried (`request.state.login`, set
    where the key is checked); without AUTH, "address:HOST", the client address (uvicorn takes it from
    X-Forwarded-For only when the connection comes from FORWARDED_ALLOW_IPS). Takes a gr.Request or a starlette
    Request / HTTPConnection; the session hash and OpenAI's `user` field never count. Raises AuthError when AUTH
    is set and the request carries no login."""
    if server.auth is not None:
        name = getattr(request, "username", None) or getattr(getattr(request, "state", None), "login", None)
        if not name:
            raise AuthError("Not logged in: log in (or send your API key) first.")
        return f"user:{name}"
    client = getattr(request, "client", None)
    return f"address:{getattr(client, 'host', None) or 'unknown'}"


class SessionOwners:
    """Which person owns an id: a session hash (Gradio's), or an event id (a queued job's, claimed from the answer
    that handed it out). The first person that uses an unowned session hash owns it; an event id is owned once an
    answer handed it to its owner. Routes that act on a session or event by its id are allowed only to its owner.
    Bounded twice: one person's ids past `max_per_owner` push out that person's own oldest (so a flood of new ids
    forgets only the flooder's), and past `max_ids` in all the least recently used go (reached only by more than
    max_ids / max_per_owner persons)."""

    def __init__(self, max_ids: int = 50_000, max_per_owner: int = 5_000) -> None:
        self.max_ids, self.max_per_owner = max_ids, max_per_owner
        self._owners: OrderedDict[str, str] = OrderedDict()  # id -> owner, least recently used first
        self._by_owner: dict[str, OrderedDict[str, None]] = {}  # each owner's ids, least recently used first
        self._lock = threading.Lock()

    def claim(self, item_id: str, owner: str, *, new: bool = True) -> bool:
        """True if `owner` owns `item_id`, claiming it if nobody does yet; with new=False an id nobody owns is
        nobody's to use (an event id: the server hands each out, so one not handed out names no event)."""
        with self._lock:
            current = self._owners.get(item_id)
            if current is not None:
                self._owners.move_to_end(item_id)
                self._by_owner[current].move_to_end(item_id)
                return current == owner
            if not new:
                return False
            self._owners[item_id] = owner
            mine = self._by_owner.setdefault(owner, OrderedDict())
            mine[item_id] = None
            if len(mine) > self.max_per_owner:
                self._drop(next(iter(mine)))
            while len(self._owners) > self.max_ids:
                self._drop(next(iter(self._owners)))
            return True

    def forget(self, item_id: str) -> None:
        with self._lock:
            if item_id in self._owners:
                self._drop(item_id)

    def _drop(self, item_id: str) -> None:
        owner = self._owners.pop(item_id)
        ids = self._by_owner[owner]
        del ids[item_id]
        if not ids:
            del self._by_owner[owner]


MAX_JSON_DEPTH = 64  # nesting of arrays/objects a request body may have; OpenAI's bodies need under 10
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # one JSON string literal (the unrolled loop: linear time)


def parse_json(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A request body as JSON, its nesting checked before it is parsed (json's recursive parser would overflow on
    100,000 nested brackets). Raises InputError for a body nested deeper than `max_depth` or not JSON at all."""
    import numpy as np

    steps = np.zeros(256, dtype=np.int8)  # +1 opens a level, -1 closes one
    steps[[ord("["), ord("{")]], steps[[ord("]"), ord("}")]] = 1, -1
    depth = np.cumsum(steps[np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)], dtype=np.int64)
    if depth.size and int(depth.max()) > max_depth:
        raise InputError(f"The request body nests arrays/objects deeper than {max_depth} levels.")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InputError("The request body is not valid JSON.") from None


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
