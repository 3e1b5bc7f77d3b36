"""The record's tables, in one place: SQLite and PostgreSQL run the same Alembic migrations of them
(runs/migrations/), and every query in runs/db.py is built from these objects, never from SQL text."""

from __future__ import annotations

from sqlalchemy import Column, Float, ForeignKey, Integer, MetaData, Table, Text

HEAD = "0002"  # the newest migration: a record at this revision needs none

metadata = MetaData()

records = Table(
    "records",
    metadata,
    # Ids are the database's: AUTOINCREMENT on SQLite (never reused), an identity sequence on PostgreSQL.
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("kind", Text, nullable=False),  # plan | bench | train | launch | serve | bench-serve
    Column("created", Text, nullable=False),  # ISO time, UTC
    Column("device", Text, nullable=False),  # cpu:<model>, cuda:<catalog slug>, or the planned accelerator
    Column("name", Text, nullable=False),  # the model or workload
    Column("run_dir", Text),
    Column("data", Text, nullable=False),  # the command's whole JSON output
    Column("user", Text),  # who ran the command (the login name), since revision 0002
    Column("team", Text),  # GPUWISE_TEAM where set: what `gpuwise fleet --by team` groups a record's runs by
    sqlite_autoincrement=True,
)

calibration = Table(
    "calibration",
    metadata,
    Column("device", Text, primary_key=True),
    Column("key", Text, primary_key=True),  # matmul.<dtype> or workload.<name>@<precision>
    Column("fraction", Float, nullable=False),  # achieved / dense peak, as gpuwise bench timed it
    Column("record_id", Integer, ForeignKey("records.id"), nullable=False),
    Column("updated", Text, nullable=False),
)
