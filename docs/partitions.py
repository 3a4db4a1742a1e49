"""Draw docs/partitions.svg: which beat ticks which partition as beats join, stop and die.

The picture is not drawn by hand: at every step each live beat plans its renewal with the
package's own :func:`celery_boundedbeat.core.partitions.plan` (the assignment of
:func:`~celery_boundedbeat.core.partitions.assign`) and acts on it as the keeper does: it
gives up what the plan releases, then claims what the plan assigns it if no other beat holds
the claim. A killed beat does nothing more: its claims stay until they expire. Plain SVG text;
no plotting library.

    python docs/partitions.py          # rewrites docs/partitions.svg
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from celery_boundedbeat.core.partitions import plan

PARTITIONS = 16


@dataclass(frozen=True)
class Event:
    title: str
    note: str
    #: The beats whose member rows are live (a killed beat stays one until its row expires).
    members: frozenset[str]
    #: The beats still running (they renew; a killed one does not).
    running: frozenset[str]


def _beats(names: str) -> frozenset[str]:
    return frozenset(names)


EVENTS = (
    Event("beat A starts", "the only beat: it claims all 16", _beats("A"), _beats("A")),
    Event("beat B joins", "announces itself; A gives up B's share at once", _beats("AB"), _beats("AB")),
    Event("beat C joins", "A and B each give up a few", _beats("ABC"), _beats("ABC")),
    Event("beat D joins", "4 beats: 4 partitions each", _beats("ABCD"), _beats("ABCD")),
    Event(
        "B is stopped (SIGTERM)",
        "after its last drain B gives its claims up; A, C, D take them at once",
        _beats("ACD"),
        _beats("ACD"),
    ),
    Event(
        "C is killed (kill -9)",
        "C's claims stay until they expire: its partitions are not ticked",
        _beats("ACD"),
        _beats("AD"),
    ),
    Event(
        "C's claims expire",
        "within lease_ttl + one renewal: A and D take them",
        _beats("AD"),
        _beats("AD"),
    ),
)


@dataclass(frozen=True)
class Step:
    event: Event
    #: Each claimed partition's holder after the step (a killed beat's claims included).
    claims: dict[int, str]
    #: The partitions whose holder changed in this step.
    moved: frozenset[int]
    #: Of them, those moved between beats that stayed (the bounded load evening the shares).
    evened: frozenset[int]


def renewals(claims: dict[int, str], event: Event) -> dict[int, str]:
    """Renew every running beat until nothing changes, as their keepers would, in turn.

    Each beat releases what its plan gives to another beat, then claims what the plan
    assigns it if the claim is free or its own (a claim another beat still holds is not
    taken: it comes free when that beat releases it at its own renewal, or expires).
    """
    claims = dict(claims)
    for _ in range(len(event.members) + 2):
        before = dict(claims)
        for me in sorted(event.running):
            held = {p for p, owner in claims.items() if owner == me}
            todo = plan(me, event.members, held, PARTITIONS)
            for p in todo.release:
                del claims[p]
            for p in todo.claim:
                claims.setdefault(p, me)
        if claims == before:
            return claims
    raise AssertionError(f"renewals did not settle after {event.title!r}")


def steps() -> list[Step]:
    """Every event's claims, from the package's own planning."""
    claims: dict[int, str] = {}
    out: list[Step] = []
    for event in EVENTS:
        # A beat that left, or whose member row expired, holds no claim any more (a stopped
        # beat deletes its claims as it leaves; a killed one's expire with its member row).
        kept = {p: owner for p, owner in claims.items() if owner in event.members}
        after = renewals(kept, event)
        moved = frozenset(p for p, owner in after.items() if claims.get(p) not in (None, owner))
        evened = frozenset(p for p in moved if claims[p] in event.running and after[p] in claims.values())
        out.append(Step(event, after, moved, evened))
        claims = after
    return out


# -- drawing ----------------------------------------------------------------------------

WIDTH = 980
LEFT = 20
CELLS_X0 = 400
CELL_W, CELL_H, GAP = 32, 26, 3
ROW_H = 56
COLOURS = {"A": "#3b7dd8", "B": "#e3a21a", "C": "#2e9e6a", "D": "#9b59b6"}
DEAD = "#c9ced4"
MOVED = "#d33a2c"
FONT = 'font-family="Helvetica, Arial, sans-serif"'


def text(xp: float, yp: float, body: str, size: int = 12, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{xp}" y="{yp}" font-size="{size}" {FONT}{extra}>{escape(body)}</text>'


def cell_x(p: int) -> int:
    return CELLS_X0 + p * (CELL_W + GAP)


def draw_step(step: Step, top: float) -> list[str]:
    event = step.event
    shares = ", ".join(f"{b} {sum(1 for o in step.claims.values() if o == b)}" for b in sorted(event.running))
    evening = f" ({len(step.evened)} between the others, to even the shares)" if step.evened else ""
    out = [
        text(LEFT, top + 17, event.title, 14, font_weight="bold"),
        text(LEFT, top + 33, event.note, 11, fill="#444"),
        text(LEFT, top + 47, f"owns: {shares} | moved: {len(step.moved)}{evening}", 11, fill="#444"),
    ]
    for p in range(PARTITIONS):
        owner = step.claims.get(p)
        xp, yp = cell_x(p), top + 13
        dead = owner is not None and owner not in event.running
        fill = "white" if owner is None else DEAD if dead else COLOURS[owner]
        stroke = f'stroke="{MOVED}" stroke-width="3"' if p in step.moved else 'stroke="none"'
        out.append(
            f'<rect x="{xp}" y="{yp}" width="{CELL_W}" height="{CELL_H}" rx="3" fill="{fill}" {stroke}/>'
        )
        if owner is not None:
            label = owner if not dead else f"{owner}\u2020"
            colour = "#333" if dead else "white"
            middle = xp + CELL_W / 2
            out.append(
                text(middle, yp + 18, label, 13, fill=colour, text_anchor="middle", font_weight="bold")
            )
    return out


def render(drawn: list[Step]) -> str:
    title = (
        f"{PARTITIONS} partitions as beats join and leave "
        "(drawn by docs/partitions.py from core.partitions.plan)"
    )
    body = [text(LEFT, 24, title, 16)]
    lx = LEFT
    for beat, colour in COLOURS.items():
        body.append(f'<rect x="{lx}" y="36" width="12" height="12" rx="3" fill="{colour}"/>')
        body.append(text(lx + 18, 46, f"beat {beat}", 12))
        lx += 70
    body.append(
        f'<rect x="{lx}" y="36" width="12" height="12" rx="3" fill="white" '
        f'stroke="{MOVED}" stroke-width="3"/>'
    )
    body.append(text(lx + 18, 46, "moved in this step", 12))
    lx += 140
    body.append(f'<rect x="{lx}" y="36" width="12" height="12" rx="3" fill="{DEAD}"/>')
    body.append(text(lx + 18, 46, "claim of a killed beat (\u2020): not ticked until it expires", 12))
    header_y = 76
    for p in range(PARTITIONS):
        body.append(text(cell_x(p) + CELL_W / 2, header_y, str(p), 11, fill="#444", text_anchor="middle"))
    body.append(text(LEFT, header_y, "event", 11, fill="#444"))
    body.append(text(CELLS_X0 - 8, header_y, "partition", 11, fill="#444", text_anchor="end"))
    top = header_y + 8.0
    for i, step in enumerate(drawn):
        if i % 2 == 1:
            body.append(f'<rect x="0" y="{top}" width="{WIDTH}" height="{ROW_H}" fill="#f3f5f7"/>')
        body.extend(draw_step(step, top))
        top += ROW_H
    height = int(top + 12)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}">\n'
        f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def main() -> None:
    drawn = steps()
    target = Path(__file__).with_name("partitions.svg")
    target.write_text(render(drawn), encoding="utf-8")
    for step in drawn:
        owned = {b: sorted(p for p, o in step.claims.items() if o == b) for b in sorted(step.event.members)}
        print(f"{step.event.title}: moved {len(step.moved)}; {owned}")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
