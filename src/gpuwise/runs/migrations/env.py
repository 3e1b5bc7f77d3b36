"""Alembic's environment for the record: gpuwise hands it an open connection (runs/db.py: migrate), so
the same migrations run on SQLite and PostgreSQL, inside gpuwise's own transaction."""

from alembic import context

from gpuwise.runs.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
