"""The sweep's run store: one SQLite file beside the cells' run directories.

Every state change is one short transaction (``BEGIN IMMEDIATE`` takes the write lock first), so any
number of processes, or machines sharing a filesystem with working locks, can work on one sweep: a cell
is claimed by exactly one owner at a time, and a finished cell is written once. A claim is retaken
when its owner stops heartbeating (``heartbeat_timeout``), or at once when the owner was a process on
this host that no longer exists (e.g. killed with SIGKILL). Staleness is judged on the observer's own
monotonic clock, from when it last saw the heartbeat change: another machine's clock may be a day off. Every claim and finish is logged in
``events``, which is how the tests check that no cell runs twice.

The store only indexes what the run directories hold: each settled cell also has its ``result.json``.
So a lost or damaged ``sweep.db`` loses nothing: set it aside (``moga sweep CONFIG --rebuild``) and
the sweep's cells are read back from their run directories, the unfinished ones resuming from their
checkpoints.

The store is data, never config: a store may come from anyone (a shared disk, an archive), so its rows are
checked when read (a cell's id is the hash of its params, and names its run directory only in that form) and
a worker runs only the cells that the sweep's own config makes (:meth:`SweepStore.check`). Anything else is
"store damaged", one line that names the row and ``--rebuild``. A store that cannot be written (a finished
sweep on a read-only mount) is opened immutable, so it can still be read.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

from moga.files import UnsafeFile, read_only, refuse_symlinks
from moga.status import DONE, Status
from moga.sweep.compat import incompatible
from moga.sweep.owners import owner_is_dead
from moga.sweep.spec import CELL_ID, Sweep, SweepError, SweepSpec, canonical, cell_id

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


class StoreDamaged(SweepError):
    """sweep.db cannot be read: truncated, overwritten, or not a SQLite file."""


def _damaged(error: sqlite3.DatabaseError) -> bool:
    name = getattr(error, "sqlite_errorname", "")
    text = str(error)
    return (name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or "malformed" in text or "not a database" in text
            or text.startswith("no such table"))  # an empty or foreign file where the store should be


def _no_space(error: sqlite3.DatabaseError) -> bool:
    """A write that failed: SQLite says SQLITE_FULL for a full disk, an I/O error for a file size limit (or a
    full disk while it grows its side files)."""
    name = getattr(error, "sqlite_errorname", "")
    return name == "SQLITE_FULL" or name.startswith("SQLITE_IOERR") or "disk is full" in str(error) \
        or "disk I/O error" in str(error)


def set_aside_all(directory: str | Path) -> list[Path]:
    """``--rebuild`` where one command keeps its stores under one directory (moga reproduce, moga demo): every
    sweep.db there set aside, so each is rebuilt from its config and its cells' run directories."""
    return [aside for db in sorted(Path(directory).rglob(DB_NAME)) if (aside := SweepStore(db.parent).set_aside())]


class SweepStore:
    def __init__(self, sweep_dir: str | Path, *, wall=time.time, clock=time.monotonic):
        self.dir = Path(sweep_dir)
        self.path = self.dir / DB_NAME
        self._wall = wall  # this machine's time, written into the store (another machine's may differ)
        self._clock = clock  # the observer's own time, for judging heartbeats
        self._beats: dict[str, tuple[tuple, float]] = {}  # cell -> (the claim's last heartbeat, seen since)

    # --- connection ------------------------------------------------------------------------------------

    @contextmanager
    def _connect(self, create: bool = False):
        refuse_symlinks(self.path, *(self.path.with_name(DB_NAME + s) for s in ("-wal", "-shm", "-journal")))
        if self.path.exists() and not self.path.is_file():  # SQLite would say only "unable to open"
            raise self.damaged(f"it is {'a directory' if self.path.is_dir() else 'not a regular file'}, not the "
                               "store's database file")
        if not create and not self.path.is_file():  # never leave an empty sweep.db behind a read
            raise SweepError(f"{self.dir} holds no sweep (no {DB_NAME}); start one there with "
                             f"moga sweep CONFIG --out {self.dir}")
        writable = create or not (read_only(self.dir) or read_only(self.path))
        try:
            if writable:
                con = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            else:  # read-only: WAL mode would need to create sweep.db-shm; immutable reads the file as it is
                con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", uri=True,
                                      isolation_level=None)
        except sqlite3.Error as e:
            raise SweepError(f"the sweep store {self.path} could not be opened ({e})") from None
        try:
            con.execute("PRAGMA busy_timeout = 60000")
            yield con
        except sqlite3.DatabaseError as e:
            if _damaged(e):
                raise StoreDamaged(self.damaged_message(e)) from None
            if _no_space(e):
                raise SweepError(f"the sweep store {self.path} could not be written ({e}: is its disk full?): "
                                 "free some space and run the same command again; no finished cell is lost (each "
                                 f"keeps its result.json in {self.dir / 'cells'}), unfinished ones resume from their "
                                 "checkpoints") from None
            if not writable or "readonly" in str(e):
                raise SweepError(f"the sweep store {self.path} is read-only ({e}): it can be read (moga sweep "
                                 "status, moga report --out DIR) but not run; copy it somewhere writable to run "
                                 "it") from None
            raise SweepError(f"the sweep store {self.path} failed ({e})") from None
        finally:
            con.close()

    def damaged_message(self, error: Exception) -> str:
        return self.damaged(f"{error}").args[0]

    def damaged(self, what: str) -> StoreDamaged:
        """The one line for a store that cannot be trusted: what is wrong, and ``--rebuild``."""
        return StoreDamaged(
            f"store damaged: {self.path}: {what}. Nothing was run from it; the cells are safe in "
            f"{self.dir / 'cells'}: run the sweep again with --rebuild (moga sweep CONFIG --out {self.dir} "
            "--rebuild, or the same moga reproduce / moga demo command with --rebuild), which sets the store "
            "aside and rebuilds it from the config and each cell's result.json (unfinished cells resume from "
            "their checkpoints)")

    def _json(self, text, what: str):
        try:
            return json.loads(text)
        except (TypeError, ValueError, RecursionError) as e:
            raise self.damaged(f"{what} is not JSON ({type(e).__name__}: {str(e)[:80]})") from None

    def _row(self, cid, params: str, where: str = "") -> dict:
        """A cell row's params, checked: the id is the hash's form and the hash of the params."""
        if not isinstance(cid, str) or not CELL_ID.fullmatch(cid):
            raise self.damaged(f"a cell id {str(cid)[:40]!r} is not a cell id (12 hex digits)")
        params = self._json(params, f"cell {cid}'s params")
        if not isinstance(params, dict) or cell_id(params) != cid:
            raise self.damaged(f"cell {cid}'s params {str(params)[:120]} are not what its id names")
        return params

    def check(self, sweep: Sweep) -> None:
        """Every row is well formed, and every cell that may still run (pending, running, failed) is one that
        ``sweep``, the user's own config, makes: a store never decides what runs."""
        allowed = {canonical(c) for c in sweep.cells}
        with self._connect() as con:
            rows = con.execute("SELECT id, params, status, result FROM cells").fetchall()
        for cid, params, status, result in rows:
            params = self._row(cid, params)
            if status not in STATUSES:
                raise self.damaged(f"cell {cid} has no status {str(status)[:40]!r}")
            if status not in DONE and canonical(params) not in allowed:
                raise self.damaged(f"cell {cid} ({str(params)[:160]}) is not a cell of this sweep's config")
            if result is not None and not isinstance(self._json(result, f"cell {cid}'s result"), dict):
                raise self.damaged(f"cell {cid}'s result is not a mapping")

    def set_aside(self) -> Path | None:
        """Move sweep.db (and its WAL files) to sweep.db.damaged[-N], so the next run rebuilds the store."""
        if not self.path.exists():
            return None
        n, target = 0, self.path.with_name(DB_NAME + ".damaged")
        while target.exists():
            n += 1
            target = self.path.with_name(f"{DB_NAME}.damaged-{n}")
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(DB_NAME + suffix)
            if side.exists():
                os.replace(side, target.with_name(target.name + suffix))
        os.replace(self.path, target)
        return target

    @contextmanager
    def _write(self, create: bool = False):
        with self._connect(create) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:  # a full disk makes SQLite roll back itself: a second ROLLBACK's error
                    con.execute("ROLLBACK")  # ("no transaction is active") would hide the real one
                raise

    def exists(self) -> bool:
        return self.path.is_file()

    # --- creation ------------------------------------------------------------------------------------

    def create_or_check(self, sweep: Sweep) -> dict:
        """Write the grid on first use; afterwards insist that it is the same sweep, or an extension of it.

        An extension changes only the grid: more lr values or scales, other values or exclusions. Every cell
        already in the store is kept (finished cells are never run again); the new cells are added and
        pending cells that left the grid are dropped. A different base config, lr key or set of axes is a
        different sweep and is refused. Returns {"added": n, "dropped": n}. Then every row is checked
        against ``sweep`` (:meth:`check`): a store that would run anything else is refused as damaged.
        """
        counts = self._create_or_extend(sweep)
        self.check(sweep)
        return counts

    def _create_or_extend(self, sweep: Sweep) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        refuse_symlinks(self.dir / "cells")  # said once, here, not as every cell's failure (cell_dir)
        definition = json.dumps(sweep.to_dict(), sort_keys=True)
        grid = [cell_id(c) for c in sweep.cells]
        with self._connect(create=True) as con:
            con.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
            con.executescript(SCHEMA)
        with self._write(create=True) as con:
            row = con.execute("SELECT value FROM meta WHERE key = 'sweep'").fetchone()
            if row is not None and row[0] == definition:
                return {"added": 0, "dropped": self._drop_outside(con, set(grid), waiting=False)}
            if row is None:
                con.execute("INSERT INTO meta VALUES ('sweep', ?)", (definition,))
                con.execute("INSERT INTO meta VALUES ('created', ?)", (str(time.time()),))
                con.execute("INSERT INTO meta VALUES ('grid', ?)", (json.dumps(grid),))
                con.executemany(
                    "INSERT INTO cells (id, idx, params, updated) VALUES (?, ?, ?, ?)",
                    [(cid, i, json.dumps(c), time.time()) for i, (cid, c) in enumerate(zip(grid, sweep.cells))],
                )
                return {"added": len(grid), "dropped": 0}
            self.refuse_another(self._definition(row[0]), sweep)
            return self._extend(con, sweep, grid, definition)

    def refuse_another(self, stored: dict, sweep: Sweep) -> None:
        """Refuse ``sweep`` where ``stored``, this store's definition, is another sweep's (not only another grid)."""
        why = incompatible(stored, sweep)
        if why:
            raise SweepError(
                f"{self.dir} holds a different sweep ({why}); give a new output directory, or restore the "
                "original config to resume it. Only the grid may change: lr values, scales, exclusions")

    def _extend(self, con, sweep: Sweep, grid: list[str], definition: str) -> dict:
        now = time.time()
        have = {cid for (cid,) in con.execute("SELECT id FROM cells")}
        start = con.execute("SELECT COALESCE(MAX(idx), -1) + 1 FROM cells").fetchone()[0]
        new = [(cid, c) for cid, c in zip(grid, sweep.cells) if cid not in have]
        con.executemany("INSERT INTO cells (id, idx, params, updated) VALUES (?, ?, ?, ?)",
                        [(cid, start + i, json.dumps(c), now) for i, (cid, c) in enumerate(new)])
        dropped = self._drop_outside(con, set(grid))
        con.execute("INSERT OR REPLACE INTO meta VALUES ('sweep', ?)", (definition,))
        con.execute("INSERT OR REPLACE INTO meta VALUES ('grid', ?)", (json.dumps(grid),))
        con.execute("INSERT INTO events (cell, event, owner, time) VALUES ('*', ?, NULL, ?)",
                    (f"extend +{len(new)} -{dropped}", now))
        return {"added": len(new), "dropped": dropped}

    @staticmethod
    def _drop_outside(con, keep: set[str], waiting: bool = True) -> int:
        """Drop the waiting cells (``waiting``) and a killed run's claims that are not in the grid ``keep``: a
        staged sweep resumes at a narrower grid than the one it was killed in. Their run directories stay, and
        resume when the grid takes them back."""
        gone = [cid for (cid, status, owner) in
                con.execute("SELECT id, status, owner FROM cells WHERE status IN ('pending', 'failed', 'running')")
                if cid not in keep and (owner_is_dead(owner) if status == Status.RUNNING else waiting)]
        con.executemany("DELETE FROM cells WHERE id = ?", [(cid,) for cid in gone])
        return len(gone)

    def grid(self) -> set[str] | None:
        """The ids of the current grid's cells (None for a store from before grids were recorded). Finished
        cells that an extension left out of the grid stay in the store but not in the grid."""
        with self._connect() as con:
            row = con.execute("SELECT value FROM meta WHERE key = 'grid'").fetchone()
        if row is None:
            return None
        grid = self._json(row[0], "its grid")
        if not isinstance(grid, list) or not all(isinstance(c, str) for c in grid):
            raise self.damaged("its grid is not a list of cell ids")
        return set(grid)

    def definition(self) -> dict:
        with self._connect() as con:
            row = con.execute("SELECT value FROM meta WHERE key = 'sweep'").fetchone()
        if row is None:
            raise SweepError(f"{self.dir} is not a sweep directory (no {DB_NAME})")
        return self._definition(row[0])

    def _definition(self, text) -> dict:
        """The stored sweep definition, checked to be one (its spec valid, its base a mapping)."""
        d = self._json(text, "its sweep definition")
        try:
            if not isinstance(d, dict) or not isinstance(d.get("base"), dict):
                raise ValueError("no base config")
            SweepSpec.model_validate(d["spec"])
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise self.damaged(f"its sweep definition is not one ({type(e).__name__}: {str(e)[:80]})") from None
        return d

    # --- claims --------------------------------------------------------------------------------------

    def claim(self, owner: str, timeout: float, waits=None) -> dict | None:
        """Atomically take the next pending cell, or a stale running one. None when nothing is claimable.

        ``waits(cell id, {id: status})``: whether a pending cell must wait for another (a cooldown for the run it
        branches from, :mod:`moga.sweep.branch`); such a cell is passed over until it need not.
        """
        now = self._wall()
        with self._write() as con:
            pending = con.execute("SELECT id, params FROM cells WHERE status = 'pending' ORDER BY idx")
            if waits is None:
                row = pending.fetchone()
            else:
                status = dict(con.execute("SELECT id, status FROM cells").fetchall())
                row = next((r for r in pending.fetchall() if not waits(r[0], status)), None)
            event = "claim"
            if row is None:
                seen_at = self._clock()
                for cid, params, prev, beat, claims in con.execute(
                        "SELECT id, params, owner, heartbeat, claims FROM cells WHERE status = 'running' ORDER BY idx"):
                    if self._silent_for(cid, (prev, beat, claims), seen_at) >= timeout or owner_is_dead(prev):
                        row, event = (cid, params), "retake"
                        break
            if row is None:
                return None
            con.execute(
                "UPDATE cells SET status = 'running', owner = ?, heartbeat = ?, claims = claims + 1, updated = ? "
                "WHERE id = ?", (owner, now, now, row[0]))
            con.execute("INSERT INTO events (cell, event, owner, time) VALUES (?, ?, ?, ?)", (row[0], event, owner, now))
        return {"id": row[0], "params": self._row(row[0], row[1])}

    def _silent_for(self, cell: str, beat: tuple, now: float) -> float:
        """How long, on this observer's clock, the claim's heartbeat has not changed (0 when it just did).

        The stored heartbeat is the owner's wall-clock time: only whether it changes is trusted, never its value.
        """
        last = self._beats.get(cell)
        if last is None or last[0] != beat:
            self._beats[cell] = (beat, now)
            return 0.0
        return now - last[1]

    def heartbeat(self, cell: str, owner: str) -> bool:
        """Refresh the claim; False when it was lost (retaken by someone else)."""
        with self._write() as con:
            # always a new value, even from a clock that stands still or steps back: observers see it change
            cur = con.execute("UPDATE cells SET heartbeat = MAX(?, COALESCE(heartbeat, 0) + 0.001) "
                              "WHERE id = ? AND owner = ? AND status = 'running'", (self._wall(), cell, owner))
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
        cells = [
            {"id": r[0], "idx": r[1], "params": self._row(r[0], r[2]), "status": r[3], "owner": r[4],
             "heartbeat": r[5], "claims": r[6], "result": self._json(r[7], f"cell {r[0]}'s result") if r[7] else None,
             "error": r[8]}
            for r in rows
        ]
        grid = self.grid()
        for c in cells:
            if c["status"] not in STATUSES or not isinstance(c["result"], (dict, type(None))):
                raise self.damaged(f"cell {c['id']} has status {str(c['status'])[:40]!r} and result "
                                   f"{str(c['result'])[:80]}")
            # an extension drops the waiting cells that left the grid: one still waiting outside it was put there
            if grid is not None and c["status"] in (Status.PENDING, Status.FAILED) and c["id"] not in grid:
                raise self.damaged(f"cell {c['id']} ({str(c['params'])[:160]}) waits to run but is not in its grid")
        return cells

    def counts(self) -> dict[str, int]:
        with self._connect() as con:
            rows = con.execute("SELECT status, COUNT(*) FROM cells GROUP BY status").fetchall()
        unknown = [s for s, _ in rows if s not in STATUSES]
        if unknown:
            raise self.damaged(f"a cell has no status {str(unknown[0])[:40]!r}")
        return {s: 0 for s in STATUSES} | dict(rows)

    def events(self) -> list[dict]:
        with self._connect() as con:
            rows = con.execute("SELECT seq, cell, event, owner, time FROM events ORDER BY seq").fetchall()
        return [{"seq": r[0], "cell": r[1], "event": r[2], "owner": r[3], "time": r[4]} for r in rows]

    def cell_dir(self, cell: str) -> Path:
        """The run directory of ``cell``: only ever named by a cell id (12 hex digits), never a path."""
        if not isinstance(cell, str) or not CELL_ID.fullmatch(cell):
            raise self.damaged(f"a cell id {str(cell)[:40]!r} is not a cell id (12 hex digits)")
        path = self.dir / "cells" / cell
        for link in (path.parent, path):  # a run directory, or all of them, pointing out of the sweep
            if link.is_symlink():
                raise UnsafeFile(link)
        return path
