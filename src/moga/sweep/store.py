"""The sweep's run store: one SQLite file beside the cells' run directories.

Every state change is one short transaction (``BEGIN IMMEDIATE`` takes the write lock first), so any
number of processes, or machines sharing a filesystem with working locks, can work on one sweep: a cell
is claimed by exactly one owner at a time, and a finished cell is written once. A claim is retaken
when its owner stops heartbeating (``heartbeat_timeout``), or at once when the owner was a process on
this host that no longer exists (e.g. killed with SIGKILL). Every claim and finish is logged in
``events``, which is how the tests check that no cell runs twice.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from moga.sweep.spec import Sweep, SweepError, cell_id
from moga.status import DONE, Status

DB_NAME = "sweep.db"
STATUSES = tuple(Status)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cells (
    id TEXT PRIMARY KEY, idx INTEGER NOT NULL, params TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending', owner TEXT, heartbeat REAL,
    claims INTEGER NOT NULL DEFAULT 0, result TEXT, error TEXT, updated REAL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, cell TEXT NOT NULL, event TEXT NOT NULL,
    owner TEXT, time REAL NOT NULL
);
"""


def new_owner() -> str:
    """host:pid:nonce, so a dead process's claims can be recognised on the same host."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _owner_is_dead(owner: str | None) -> bool:
    if not owner:
        return True
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine: only the heartbeat can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(int(pid))


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


class SweepStore:
    def __init__(self, sweep_dir: str | Path):
        self.dir = Path(sweep_dir)
        self.path = self.dir / DB_NAME

    # --- connection ------------------------------------------------------------------------------------

    @contextmanager
    def _connect(self):
        con = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        try:
            con.execute("PRAGMA busy_timeout = 60000")
            yield con
        finally:
            con.close()

    @contextmanager
    def _write(self):
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise

    def exists(self) -> bool:
        return self.path.is_file()

    # --- creation ------------------------------------------------------------------------------------

    def create_or_check(self, sweep: Sweep) -> None:
        """Write the grid on first use; afterwards insist that the sweep is the same one."""
        self.dir.mkdir(parents=True, exist_ok=True)
        definition = json.dumps(sweep.to_dict(), sort_keys=True)
        with self._connect() as con:
            con.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
            con.executescript(SCHEMA)
        with self._write() as con:
            row = con.execute("SELECT value FROM meta WHERE key = 'sweep'").fetchone()
            if row is None:
                con.execute("INSERT INTO meta VALUES ('sweep', ?)", (definition,))
                con.execute("INSERT INTO meta VALUES ('created', ?)", (str(time.time()),))
                con.executemany(
                    "INSERT INTO cells (id, idx, params, updated) VALUES (?, ?, ?, ?)",
                    [(cell_id(c), i, json.dumps(c), time.time()) for i, c in enumerate(sweep.cells)],
                )
            elif row[0] != definition:
                raise SweepError(
                    f"{self.dir} holds a different sweep (its config changed since it was created); "
                    "give a new output directory, or restore the original config to resume it")

    def definition(self) -> dict:
        with self._connect() as con:
            row = con.execute("SELECT value FROM meta WHERE key = 'sweep'").fetchone()
        if row is None:
            raise SweepError(f"{self.dir} is not a sweep directory (no {DB_NAME})")
        return json.loads(row[0])

    # --- claims --------------------------------------------------------------------------------------

    def claim(self, owner: str, timeout: float) -> dict | None:
        """Atomically take the next pending cell, or a stale running one. None when nothing is claimable."""
        now = time.time()
        with self._write() as con:
            row = con.execute("SELECT id, params FROM cells WHERE status = 'pending' ORDER BY idx LIMIT 1").fetchone()
            event = "claim"
            if row is None:
                for cid, params, prev, beat in con.execute(
                        "SELECT id, params, owner, heartbeat FROM cells WHERE status = 'running' ORDER BY idx"):
                    if beat is None or beat < now - timeout or _owner_is_dead(prev):
                        row, event = (cid, params), "retake"
                        break
            if row is None:
                return None
            con.execute(
                "UPDATE cells SET status = 'running', owner = ?, heartbeat = ?, claims = claims + 1, updated = ? "
                "WHERE id = ?", (owner, now, now, row[0]))
            con.execute("INSERT INTO events (cell, event, owner, time) VALUES (?, ?, ?, ?)", (row[0], event, owner, now))
        return {"id": row[0], "params": json.loads(row[1])}

    def heartbeat(self, cell: str, owner: str) -> bool:
        """Refresh the claim; False when it was lost (retaken by someone else)."""
        with self._write() as con:
            cur = con.execute("UPDATE cells SET heartbeat = ? WHERE id = ? AND owner = ? AND status = 'running'",
                              (time.time(), cell, owner))
            return cur.rowcount == 1

    def finish(self, cell: str, owner: str, status: str, result: dict | None = None, error: str | None = None) -> bool:
        """Record the outcome once; a stale owner (whose claim was retaken) records nothing."""
        if status not in STATUSES or status in (Status.PENDING, Status.RUNNING):
            raise ValueError(f"cannot finish a cell with status {status!r}")
        now = time.time()
        with self._write() as con:
            cur = con.execute(
                "UPDATE cells SET status = ?, result = ?, error = ?, updated = ?, heartbeat = NULL "
                "WHERE id = ? AND owner = ? AND status = 'running'",
                (status, json.dumps(result) if result is not None else None, error, now, cell, owner))
            if cur.rowcount == 1:
                con.execute("INSERT INTO events (cell, event, owner, time) VALUES (?, ?, ?, ?)", (cell, status, owner, now))
            return cur.rowcount == 1

    def release(self, cell: str, owner: str) -> bool:
        """Hand an unfinished cell back (its run stopped early, e.g. on SIGTERM); it resumes later."""
        with self._write() as con:
            cur = con.execute("UPDATE cells SET status = 'pending', owner = NULL, heartbeat = NULL "
                              "WHERE id = ? AND owner = ? AND status = 'running'", (cell, owner))
            if cur.rowcount == 1:
                con.execute("INSERT INTO events (cell, event, owner, time) VALUES (?, 'release', ?, ?)",
                            (cell, owner, time.time()))
            return cur.rowcount == 1

    def requeue(self, statuses=(Status.FAILED,)) -> int:
        with self._write() as con:
            marks = ",".join("?" * len(statuses))
            cur = con.execute(f"UPDATE cells SET status = 'pending', owner = NULL WHERE status IN ({marks})", statuses)
            return cur.rowcount

    # --- reading -------------------------------------------------------------------------------------

    def cells(self) -> list[dict]:
        with self._connect() as con:
            rows = con.execute(
                "SELECT id, idx, params, status, owner, heartbeat, claims, result, error FROM cells ORDER BY idx").fetchall()
        return [
            {"id": r[0], "idx": r[1], "params": json.loads(r[2]), "status": r[3], "owner": r[4], "heartbeat": r[5],
             "claims": r[6], "result": json.loads(r[7]) if r[7] else None, "error": r[8]}
            for r in rows
        ]

    def counts(self) -> dict[str, int]:
        with self._connect() as con:
            rows = con.execute("SELECT status, COUNT(*) FROM cells GROUP BY status").fetchall()
        return {s: 0 for s in STATUSES} | dict(rows)

    def events(self) -> list[dict]:
        with self._connect() as con:
            rows = con.execute("SELECT seq, cell, event, owner, time FROM events ORDER BY seq").fetchall()
        return [{"seq": r[0], "cell": r[1], "event": r[2], "owner": r[3], "time": r[4]} for r in rows]

    def cell_dir(self, cell: str) -> Path:
        return self.dir / "cells" / cell
