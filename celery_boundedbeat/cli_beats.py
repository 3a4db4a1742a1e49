"""``celery -A proj boundedbeat beats``: the live beats and the partitions each ticks.

Registered on the ``boundedbeat`` group by :mod:`.cli`; the read is
:func:`~celery_boundedbeat.api.queries.beats`.
"""

from __future__ import annotations

import json

import click

from .api.queries import beats
from .cli_import import ready_app
from .ops.tables import fmt_time, table


@click.command("beats")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON array: id, partitions, leader, joined_at, renewed_at.",
)
@click.pass_context
def beats_cmd(ctx: click.Context, as_json: bool) -> None:
    """The live beats, the lease holder first, with the partitions each ticks."""
    app = ready_app(ctx)
    found = beats(app)
    if as_json:
        click.echo(json.dumps([b.to_json() for b in found], indent=2))
        return
    if not found:
        click.echo("no live beat")
        return
    rows = [
        [
            b.id,
            "yes" if b.leader else "-",
            str(len(b.partitions)),
            ",".join(str(p) for p in b.partitions) or "-",
            fmt_time(b.renewed_at),
        ]
        for b in found
    ]
    click.echo(table(["BEAT", "LEADER", "OWNS", "PARTITIONS", "RENEWED (UTC)"], rows))
