"""A validated schedule entry (:class:`EntrySpec`) and its stored form (:class:`Definition`).

The one value every process shares for a schedule: config and runtime schedules are parsed
into it, the store keeps it as a definition row, beat emits runs from it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .policy import Policy
from .timing import Timing


@dataclass(frozen=True, kw_only=True, slots=True)
class EntrySpec:
    """A fully validated schedule entry (what beat needs to emit runs of it)."""

    name: str
    task: str
    policy: Policy
    timing: Timing = field(compare=False)
    schedule_repr: str
    period: float | None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    #: The zone a calendar schedule keeps wall-clock time in (the policy's ``timezone``, else the
    #: zone it was stored with, else the app's); ``None`` for an interval.
    timezone: str | None = None


def config_hash(spec: EntrySpec) -> str:
    """A cheap change marker for a configured entry (reconciled at beat start).

    The grid object is left out: ``schedule_repr`` stands for it, so equal entries hash
    equal across processes.
    """
    parts: list[Any] = [
        spec.task,
        spec.schedule_repr,
        spec.policy.to_json(),
        list(spec.args),
        dict(spec.kwargs),
        dict(spec.options),
    ]
    if spec.timezone is not None:
        parts.append(spec.timezone)  # a calendar grid in another zone is another schedule
    payload = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class Definition:
    """A validated schedule and what its row stores besides: the grid as JSON and the digest.

    ``timing`` is ``None`` only for specs made without a Celery app (tests of the store); a
    beat rebuilds a schedule from its row when it has no spec of its own (``definitions``).
    """

    spec: EntrySpec
    timing: dict[str, Any] | None
    digest: str

    @property
    def name(self) -> str:
        return self.spec.name

    @classmethod
    def of(cls, spec: EntrySpec, timing: dict[str, Any] | None = None) -> Definition:
        return cls(spec=spec, timing=timing, digest=config_hash(spec))
