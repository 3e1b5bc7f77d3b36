"""Who wrote each record: the user, and the team (GPUWISE_TEAM), so that `gpuwise fleet` can group a team's
record by them. Nullable: the records written before say nothing, and stay as they were."""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("records") as batch:
        batch.add_column(sa.Column("user", sa.Text, nullable=True))
        batch.add_column(sa.Column("team", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("records") as batch:
        batch.drop_column("team")
        batch.drop_column("user")
