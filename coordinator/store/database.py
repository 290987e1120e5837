"""Durable coordinator state in SQLite (WAL): agents, steps, accepted updates, global state.

An update is acknowledged on the wire only after :meth:`Store.add_update` has committed it.
Aggregation and the step's completion commit in one transaction (:meth:`Store.complete_step`),
so a restarted coordinator resumes the open step with the updates it already has and never
aggregates an update twice. A step whose aggregation failed is closed as ``failed`` and its
updates move to ``quarantine`` (:meth:`Store.fail_step`): kept for inspection, never replayed.

The bytes of an update live in a segment file (:mod:`coordinator.store.segments`), its row here.
Once a step is done (:meth:`Store.retire_done_steps`, as the next one starts) its rows leave
``updates`` and their message ids stay in ``aggregated`` for :data:`AGGREGATED_STEPS` steps (a
resend after a lost ack is acknowledged again), and its segments are deleted: the store holds
about one step of replies, however long the run.

Opening the file (schema, pragmas, WAL checkpoints) and transactions are
:mod:`coordinator.store.connection`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.store.connection import StoreConnection
from coordinator.store.segments import SegmentRef
from protocol.contract.payloads import Payload, pack_payloads, unpack_payloads

__all__ = [
    "Staged",
    "StepRecord",
    "Store",
    "pack_payloads",
    "unpack_payloads",
]


INTAKE = "intake"  # meta key: the step whose replies ingest workers may store (null: none)
_IN_BATCH = 500  # values per "IN (...)" list (older SQLite builds allow 999 variables)
#: done steps whose replies' message ids are kept; an agent that resends an older reply after
#: a lost ack is refused as late instead of acknowledged: it drops the reply either way
AGGREGATED_STEPS = 64
_INSERT_UPDATE = (
    "INSERT OR IGNORE INTO updates (step, device_id, msg_id, task_id, envelope, received, seg, "
    "seg_offset, seg_length) VALUES (?, ?, ?, ?, x'', ?, ?, ?, ?)"
)
_UPDATE_COLUMNS = "device_id, msg_id, envelope, seg, seg_offset, seg_length"
#: a reply whose bytes are in a segment and whose row is still to add:
#: (device_id, msg_id, task_id, where its bytes are)
Staged = tuple[str, str, str, SegmentRef]


@dataclass(frozen=True)
class StepRecord:
    """One step (a training round or a final phase) of the run."""

    idx: int
    round: int
    phase: str
    participants: list[str]
    status: str  # open | done | failed
    attempt: int


class Store(StoreConnection):
    """The coordinator's SQLite database: written by the engine's thread and, with ingest
    workers, by their processes too (WAL: one writer at a time, readers never blocked)."""

    # ----- meta -----------------------------------------------------------------------------
    def get_meta(self, key: str) -> Any:
        """A JSON value stored under ``key`` (``None`` if absent)."""
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON value."""
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    # ----- agents ---------------------------------------------------------------------------
    def upsert_agent(self, device_id: str, register: bytes, online: bool) -> None:
        """Remember an agent's registration (encoded envelope)."""
        self.upsert_agents({device_id: register}, online)

    def upsert_agents(
        self, registers: Mapping[str, bytes], online: bool = True, now: float | None = None
    ) -> None:
        """:meth:`upsert_agent` for many agents at once (``device_id -> register envelope``):
        one statement for a burst of registrations (10,000 agents joining); ``now``: their
        ``last_seen`` (default: the time now)."""
        now, state = time.time() if now is None else now, int(online)
        self.db.executemany(
            "INSERT OR REPLACE INTO agents VALUES (?, ?, ?, ?)",
            [(d, register, state, now) for d, register in registers.items()],
        )

    def touch_agent(self, device_id: str, online: bool | None = None) -> None:
        """Note that a known agent was heard from (and its online state, when it said so)."""
        if online is None:
            self.db.execute(
                "UPDATE agents SET last_seen=? WHERE device_id=?", (time.time(), device_id)
            )
        else:
            self.db.execute(
                "UPDATE agents SET last_seen=?, online=? WHERE device_id=?",
                (time.time(), int(online), device_id),
            )

    def touch_agents(self, heard: Mapping[str, bool | None], now: float | None = None) -> None:
        """:meth:`touch_agent` for many agents at once (``device_id -> online``, ``None``:
        it did not say); ``now``: their ``last_seen`` (default: the time now)."""
        now = time.time() if now is None else now
        self.db.executemany(
            "UPDATE agents SET last_seen=? WHERE device_id=?",
            [(now, d) for d, online in heard.items() if online is None],
        )
        self.db.executemany(
            "UPDATE agents SET last_seen=?, online=? WHERE device_id=?",
            [(now, int(online), d) for d, online in heard.items() if online is not None],
        )

    def agent_rows(self) -> list[tuple[str, bytes, bool, float]]:
        """(device_id, register envelope, online, last_seen) of every known agent."""
        rows = self.db.execute(
            "SELECT device_id, register, online, last_seen FROM agents ORDER BY device_id"
        )
        return [(d, r, bool(o), float(t)) for d, r, o, t in rows]

    def agents(self) -> list[tuple[str, bytes]]:
        """All registrations ever received."""
        return list(self.db.execute("SELECT device_id, register FROM agents ORDER BY device_id"))

    # ----- steps and updates ----------------------------------------------------------------
    def open_step(self, rec: StepRecord) -> None:
        """Record a step's start and its participants (before any task leaves)."""
        self.db.execute(
            "INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
            (
                rec.idx,
                rec.round,
                rec.phase,
                json.dumps(rec.participants),
                rec.status,
                rec.attempt,
                time.time(),
            ),
        )

    def step(self, idx: int) -> StepRecord | None:
        """The record of step ``idx``."""
        row = self.db.execute(
            "SELECT idx, round, phase, participants, status, attempt FROM steps WHERE idx=?", (idx,)
        ).fetchone()
        if row is None:
            return None
        return StepRecord(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5])

    def last_done_step(self) -> int:
        """Index of the last completed step, -1 if none."""
        row = self.db.execute("SELECT MAX(idx) FROM steps WHERE status='done'").fetchone()
        return -1 if row[0] is None else int(row[0])

    def last_closed_step(self) -> int:
        """Index of the last step closed for good, -1 if none: done, or failed in aggregation.

        A step that failed its quorum is not closed for good (a restart retries it); one whose
        aggregation failed is, since replaying its stored replies would fail again.
        """
        row = self.db.execute(
            "SELECT MAX(idx) FROM steps WHERE status='done' OR (status='failed' AND "
            "EXISTS (SELECT 1 FROM quarantine WHERE quarantine.step=steps.idx))"
        ).fetchone()
        return -1 if row[0] is None else int(row[0])

    def add_update(
        self, step: int, device_id: str, msg_id: str, task_id: str, envelope: bytes
    ) -> bool:
        """Store an accepted reply; ``False`` if this device already has one for ``step``."""
        before = self.db.total_changes
        self.add_updates([(step, device_id, msg_id, task_id, envelope)])
        return self.db.total_changes > before

    def updates(
        self, step: int, skip: Container[str] = frozenset()
    ) -> list[tuple[str, str, bytes]]:
        """(device_id, msg_id, envelope) of every stored reply of ``step``, in device order,
        but those of the devices in ``skip``, whose envelopes are not even read (the round
        leader holds the replies it stored itself: a FedAvg-sized step is ~1 MB a device).
        A reply whose bytes cannot be read (a damaged segment, logged) comes as ``b""``."""
        if not skip:
            rows = self.db.execute(
                f"SELECT {_UPDATE_COLUMNS} FROM updates WHERE step=? ORDER BY device_id", (step,)
            )
            return self._with_payloads(rows)
        ids = self.db.execute(
            "SELECT device_id FROM updates WHERE step=? ORDER BY device_id", (step,)
        )
        wanted = [d for (d,) in ids if d not in skip]
        found: list[tuple[str, str, bytes]] = []
        for i in range(0, len(wanted), _IN_BATCH):
            part = wanted[i : i + _IN_BATCH]
            marks = ",".join("?" * len(part))
            rows = self.db.execute(
                f"SELECT {_UPDATE_COLUMNS} FROM updates "  # placeholders only
                f"WHERE step=? AND device_id IN ({marks})",
                (step, *part),
            )
            found.extend(self._with_payloads(rows))
        return sorted(found, key=lambda row: row[0])

    def _with_payloads(self, rows: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Rows ``(*head, envelope, seg, seg_offset, seg_length)`` as ``(*head, envelope)``,
        the envelope read from its segment (``b""``, which no decoder takes, if unreadable:
        the row still says that its device replied)."""
        out = []
        for *head, inline, seg, offset, length in rows:
            envelope = inline if seg is None else self.segments.read((seg, offset, length)) or b""
            out.append((*head, envelope))
        return out

    def add_updates(self, rows: list[tuple[int, str, str, str, bytes]]) -> None:
        """Store a batch's accepted replies ``(step, device_id, msg_id, task_id, envelope)`` in
        one statement a step (:meth:`add_update`'s, a reply already stored for its step
        ignored): :meth:`stage_updates`, then :meth:`add_staged`."""
        by_step: dict[int, list[tuple[str, str, str, bytes]]] = {}
        for step, device_id, msg_id, task_id, envelope in rows:
            by_step.setdefault(step, []).append((device_id, msg_id, task_id, envelope))
        for step, part in by_step.items():
            self.add_staged(step, self.stage_updates(step, part))

    def stage_updates(self, step: int, rows: list[tuple[str, str, str, bytes]]) -> list[Staged]:
        """Write the envelopes of ``rows`` ``(device_id, msg_id, task_id, envelope)`` to this
        process's segment of ``step``, durably, and say where each one is. Needs no write
        lock: an ingest worker stages its batch before its transaction, so that its
        ``fdatasync`` does not hold the other writers up. Bytes whose row is never added stay
        unreferenced until the step's segments go."""
        refs = self.segments.append(step, [row[3] for row in rows])
        return [(*row[:3], ref) for row, ref in zip(rows, refs, strict=True)]

    def add_staged(self, step: int, staged: list[Staged]) -> None:
        """Add the rows of :meth:`stage_updates` (one statement; a device's second ignored)."""
        now = time.time()
        self.db.executemany(
            _INSERT_UPDATE,
            [(step, device, msg, task, now, *ref) for device, msg, task, ref in staged],
        )

    def stored_msgs(self, msg_ids: list[str]) -> set[str]:
        """The ones of ``msg_ids`` already stored (:meth:`has_update_msg`), in one query."""
        if not msg_ids:
            return set()
        marks = ",".join("?" * len(msg_ids))
        rows = self.db.execute(
            f"SELECT msg_id FROM updates WHERE msg_id IN ({marks}) "  # placeholders only
            f"UNION SELECT msg_id FROM quarantine WHERE msg_id IN ({marks}) "
            f"UNION SELECT msg_id FROM aggregated WHERE msg_id IN ({marks})",
            (*msg_ids, *msg_ids, *msg_ids),
        )
        return {row[0] for row in rows}

    def has_update_msg(self, msg_id: str) -> bool:
        """Whether a reply with this message id is already stored (any step, quarantine too)."""
        row = self.db.execute(  # one statement a reply (both tables are indexed by msg_id)
            "SELECT EXISTS (SELECT 1 FROM updates WHERE msg_id=?) "
            "OR EXISTS (SELECT 1 FROM quarantine WHERE msg_id=?) "
            "OR EXISTS (SELECT 1 FROM aggregated WHERE msg_id=?)",
            (msg_id, msg_id, msg_id),
        ).fetchone()
        return bool(row[0])

    def stored_since(self, step: int, after: int) -> list[tuple[int, str, bytes]]:
        """(rowid, device_id, envelope) of the updates of ``step`` stored after rowid
        ``after``, in the order they were stored (an unreadable one as in :meth:`updates`)."""
        rows = self.db.execute(
            "SELECT rowid, device_id, envelope, seg, seg_offset, seg_length FROM updates "
            "WHERE step=? AND rowid>? ORDER BY rowid",
            (step, after),
        )
        return self._with_payloads(rows)

    # ----- the intake of ingest workers -----------------------------------------------------
    def set_intake(self, intake: dict[str, Any] | None) -> None:
        """Open (``{"step", "attempt", "round", "phase", "participation"}``) or close the
        step whose replies workers store. Committed at once: a worker's store is conditional
        on it (:meth:`add_updates_if_open`), so after closing no reply can slip in."""
        self.set_meta(INTAKE, intake)

    def intake(self) -> dict[str, Any] | None:
        """The step open to ingest workers, or ``None``."""
        value = self.get_meta(INTAKE)
        return value if isinstance(value, dict) else None

    def add_updates_if_open(self, intake: dict[str, Any], staged: list[Staged]) -> set[str] | None:
        """Add a batch's replies, staged for ``intake``'s step (:meth:`stage_updates`), if
        that step is still the open one; ``None`` (nothing added) if it is not. Returns the
        message ids added: a device's first reply of the step (as :meth:`add_update`, a device
        that already has one keeps it).

        Call inside :meth:`transaction`: the write lock orders it against the leader's
        :meth:`set_intake`, so a reply is stored either before the step closes or not at all.
        One read of the intake, one lookup and one statement a batch, not three a reply.
        """
        if self.intake() != intake:
            return None
        step = intake["step"]
        have = self._devices_with_update(step, list({row[0]: None for row in staged}))
        new = []
        for row in staged:
            if row[0] not in have:
                have.add(row[0])
                new.append(row)
        self.add_staged(step, new)
        return {row[1] for row in new}

    def _devices_with_update(self, step: int, devices: list[str]) -> set[str]:
        """The ones of ``devices`` that have a reply stored for ``step``."""
        found: set[str] = set()
        for i in range(0, len(devices), _IN_BATCH):
            part = devices[i : i + _IN_BATCH]
            marks = ",".join("?" * len(part))
            found.update(
                d
                for (d,) in self.db.execute(
                    f"SELECT device_id FROM updates "  # placeholders only
                    f"WHERE step=? AND device_id IN ({marks})",
                    (step, *part),
                )
            )
        return found

    def add_refusal(self, step: int, attempt: int, device_id: str, reason: str) -> None:
        """Note that a worker refused ``device_id``'s reply of this attempt as invalid."""
        self.db.execute(
            "INSERT OR IGNORE INTO refusals VALUES (?, ?, ?, ?)", (step, attempt, device_id, reason)
        )

    def add_worker_traffic(self, step: int, counts: dict[str, int]) -> None:
        """Add an ingest worker's bytes of ``step`` (``{"rx.reply": n, "tx.ack": m}``)."""
        self.db.executemany(
            "INSERT INTO worker_traffic VALUES (?, ?, ?) "
            "ON CONFLICT (step, key) DO UPDATE SET bytes = bytes + excluded.bytes",
            [(step, key, n) for key, n in counts.items() if n],
        )

    def worker_traffic(self, step: int) -> dict[str, int]:
        """Every ingest worker's bytes of ``step``, summed per key."""
        rows = self.db.execute("SELECT key, bytes FROM worker_traffic WHERE step=?", (step,))
        return dict(rows)

    def refusals(self, step: int, attempt: int) -> list[tuple[str, str]]:
        """(device_id, reason) of the replies refused as invalid in this attempt."""
        return list(
            self.db.execute(
                "SELECT device_id, reason FROM refusals WHERE step=? AND attempt=?",
                (step, attempt),
            )
        )

    def clear_updates(self, step: int) -> None:
        """Drop a failed attempt's updates before the step is retried (their bytes stay in the
        step's segments, which ingest workers may still be appending to, until it is done)."""
        self.db.execute("DELETE FROM updates WHERE step=?", (step,))

    def complete_step(
        self,
        step: int,
        status: str,
        state: dict[str, Payload],
        metrics_json: str,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Atomically close the step with the new global state and its metrics (one JSON
        object: the engine encodes a step's record once, for here and ``metrics.jsonl``) and
        ``meta`` values (buffered mode's tasks in flight). A done step's replies stay until
        :meth:`retire_done_steps`."""
        with self.transaction() as db:
            for key, value in (meta or {}).items():
                self.set_meta(key, value)
            db.execute(
                "UPDATE steps SET status=?, finished=? WHERE idx=?", (status, time.time(), step)
            )
            if state:
                db.execute(
                    "INSERT OR REPLACE INTO global_state VALUES ('strategy', ?, ?)",
                    (pack_payloads(state), step),
                )
            db.execute("INSERT OR REPLACE INTO metrics VALUES (?, ?)", (step, metrics_json))

    def retire_done_steps(self) -> None:
        """Let the replies of every step up to the last done one go, but their message ids:
        those stay in ``aggregated`` for :data:`AGGREGATED_STEPS` steps (a resend after a lost
        ack is acknowledged again); then their segments go. Steps close in order, so none up
        to the last done one is still open; a step that missed its quorum for good ended the
        run before any later one opened, and keeps its replies for the restart that retries it.
        Rows left by a store from before segments go the same way."""
        last = self.last_done_step()
        pending = self.db.execute("SELECT 1 FROM updates WHERE step<=? LIMIT 1", (last,))
        if pending.fetchone() is not None:
            with self.transaction() as db:
                db.execute(
                    "INSERT OR IGNORE INTO aggregated SELECT msg_id, step, device_id "
                    "FROM updates WHERE step<=?",
                    (last,),
                )
                db.execute("DELETE FROM updates WHERE step<=?", (last,))
                db.execute("DELETE FROM aggregated WHERE step<=?", (last - AGGREGATED_STEPS,))
        if last >= 0:
            self.segments.sweep(last)  # after the commit: no row points into them any more

    def fail_step(self, step: int, metrics_json: str, reason: str) -> None:
        """Atomically close a step whose aggregation failed and quarantine its updates, bytes
        and all (read out of their segments, which then go).

        The global state stays that of the last good step; the moved updates are never
        replayed by a resume (see :meth:`last_closed_step`).
        """
        with self.transaction() as db:
            rows = db.execute(
                "SELECT step, device_id, msg_id, task_id, received, envelope, seg, seg_offset, "
                "seg_length FROM updates WHERE step=?",
                (step,),
            )
            db.executemany(
                "INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(*ids, env, at, reason) for *ids, at, env in self._with_payloads(rows)],
            )
            db.execute("DELETE FROM updates WHERE step=?", (step,))
            db.execute(
                "UPDATE steps SET status='failed', finished=? WHERE idx=?", (time.time(), step)
            )
            db.execute("INSERT OR REPLACE INTO metrics VALUES (?, ?)", (step, metrics_json))
        self.segments.sweep(step)

    def aggregated(self, step: int) -> list[tuple[str, str]]:
        """(device_id, msg_id) of every reply a done ``step`` aggregated, in device order (kept
        for :data:`AGGREGATED_STEPS` steps)."""
        return list(
            self.db.execute(
                "SELECT device_id, msg_id FROM aggregated WHERE step=? ORDER BY device_id", (step,)
            )
        )

    def quarantined(self, step: int) -> list[tuple[str, str, str]]:
        """(device_id, msg_id, reason) of every quarantined reply of ``step``."""
        return list(
            self.db.execute(
                "SELECT device_id, msg_id, reason FROM quarantine WHERE step=? ORDER BY device_id",
                (step,),
            )
        )

    def global_state(self) -> dict[str, Payload]:
        """The strategy state of the last completed step (empty before the first)."""
        row = self.db.execute("SELECT blob FROM global_state WHERE name='strategy'").fetchone()
        return unpack_payloads(row[0]) if row else {}

    def metrics(self) -> list[dict[str, Any]]:
        """Every step's metrics record, in order."""
        return [
            json.loads(r[0]) for r in self.db.execute("SELECT record FROM metrics ORDER BY step")
        ]
