"""Sqlite storage for the embedded Dagster instance, tuned for one run per RL iteration.

Dagster's sqlite storages build a new engine and open a new connection for every statement
group (about 130 per `rl` run: run creation, planned/started/materialized/check events, ...) and
commit with sqlite's default `synchronous=FULL`, so every event waits for an fsync, and closing
the process's last connection checkpoints the write-ahead log. An fsync costs ~1 ms on an idle
disk and 5-20 ms while other processes write; that wait was most of the Dagster overhead of an
iteration. These subclasses keep one pooled engine per database and process and set
`synchronous=NORMAL` on each connection — sqlite's recommended setting in WAL mode (the
storages' journal mode): a committed event survives a crash of any process; only a power loss
or OS crash may drop the last commits, and the database is never corrupted. Schema, queries and
multi-process behaviour (daemon, webserver, run workers on one instance) are Dagster's.

`tinker_pipelines.tracking.home` writes them into a fresh embedded `dagster.yaml`; production uses
Postgres (docs/dagster.production.yaml). This module imports only dagster and sqlalchemy, so the
daemon and webserver load it without the ML stack.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import sqlalchemy as sa
from dagster._core.storage.event_log import ConsolidatedSqliteEventLogStorage
from dagster._core.storage.runs import SqliteRunStorage
from dagster._core.storage.schedules import SqliteScheduleStorage
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS

SYNCHRONOUS = "NORMAL"
"""`PRAGMA synchronous` of every connection these storages open."""


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
    cursor.close()


class _PooledEngine:
    """One engine (SQLAlchemy's default queue pool for a sqlite file) per database per process;
    a forked child builds its own instead of sharing the parent's open connections."""

    def __init__(self, conn_string: str):
        self._conn_string = conn_string
        self._engine: sa.Engine | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def get(self) -> sa.Engine:
        with self._lock:
            if self._engine is None or self._pid != os.getpid():
                engine = sa.create_engine(self._conn_string, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS})
                sa.event.listen(engine, "connect", _on_connect)
                self._engine, self._pid = engine, os.getpid()
            return self._engine

    def dispose(self) -> None:
        with self._lock:
            if self._engine is not None and self._pid == os.getpid():
                self._engine.dispose()
            self._engine = None

    @contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """What the Dagster storages' `connect()` yields: a connection inside a transaction."""
        with self.get().connect() as conn:
            with conn.begin():
                yield conn


class _Pooled:
    """Mixin: the storage's connections come from one `_PooledEngine` over its `_conn_string`."""

    _conn_string: str

    @property
    def _pool(self) -> _PooledEngine:
        if "_tinker_pool" not in self.__dict__:  # built lazily: Dagster's __init__ may connect already
            self.__dict__["_tinker_pool"] = _PooledEngine(self._conn_string)
        return self.__dict__["_tinker_pool"]

    def dispose(self) -> None:
        super().dispose()  # type: ignore[misc]
        self._pool.dispose()


class _PooledLocal(_Pooled):
    """Mixin for the storages whose connections come from `connect()` and that are configured
    by `from_local` (runs, schedules)."""

    @classmethod
    def from_config_value(cls, inst_data, config_value):  # the parents hard-code their own class
        return cls.from_local(inst_data=inst_data, **config_value)

    @contextmanager
    def connect(self) -> Iterator[sa.Connection]:
        with self._pool.transaction() as conn:
            yield conn


class TinkerSqliteRunStorage(_PooledLocal, SqliteRunStorage):
    """Runs, tags, daemon heartbeats: `<base_dir>/runs.db`."""


class TinkerSqliteEventLogStorage(_Pooled, ConsolidatedSqliteEventLogStorage):
    """All runs' events in one database: `<base_dir>/event_log.db`."""

    @contextmanager
    def _connect(self) -> Iterator[sa.Connection]:
        with self._pool.transaction() as conn:
            yield conn

    def has_table(self, table_name: str) -> bool:
        engine = self._pool.get()
        with engine.connect() as conn:
            return bool(engine.dialect.has_table(conn, table_name))


class TinkerSqliteScheduleStorage(_PooledLocal, SqliteScheduleStorage):
    """Sensor and schedule ticks: `<base_dir>/schedules.db`."""
