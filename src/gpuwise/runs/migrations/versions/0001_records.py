"""The record as gpuwise kept it in SQLite before migrations: records and calibration.

`if_not_exists`: a record written by an older gpuwise already has both tables, with its rows; this
revision then only stamps it, and its ids stay as they are.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "records",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("created", sa.Text, nullable=False),
        sa.Column("device", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("run_dir", sa.Text),
        sa.Column("data", sa.Text, nullable=False),
        sqlite_autoincrement=True,
        if_not_exists=True,
    )
    op.create_table(
        "calibration",
        sa.Column("device", sa.Text, primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("fraction", sa.Float, nullable=False),
        sa.Column("record_id", sa.Integer, sa.ForeignKey("records.id"), nullable=False),
        sa.Column("updated", sa.Text, nullable=False),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_table("calibration")
    op.drop_table("records")
