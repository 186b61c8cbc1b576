"""Draw a :class:`~distlock.admin.timeline.Timeline` as one inline SVG string.

Server-side and self-contained (no JavaScript, no fonts or files to fetch), so the same
picture works in the admin and in the demo's standalone HTML report. Colours: text and
lines take the page's own colours through the admin's CSS variables (``--body-fg``,
``--border-color``; ``currentColor`` without them), so the picture reads in the admin's
light and dark themes; bars and marks use mid-tone colours that read on both. Every name,
holder and detail is escaped; details go to ``<title>`` tooltips.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, tzinfo
from html import escape

from distlock.admin.display import detail_text, elide
from distlock.admin.timeline import STALE_WRITE_ACCEPTED, Bar, Lane, Mark, Timeline
from distlock.times import from_us

WIDTH = 960
LABEL_W = 210  # lane labels on the left
RIGHT = 24
TOP = 30  # time labels
LANE_H = 46
BAR_H = 18
LEGEND_ROW = 18  # one row of the legend; it wraps to as many rows as it needs
LEGEND_PAD = 16
#: A text's width in px at the picture's 11 px, estimated on the wide side (DejaVu Sans,
#: the fallback of many Linux machines, is wider than most system fonts), so that a label
#: placed by its estimate never runs past the picture's edge.
CHAR_W, WIDE_CHAR_W = 7.0, 9.0

_STYLE = """
.distlock-timeline{color:var(--body-fg,currentColor);font:11px/1.2 var(--font-family-primary,
 system-ui,sans-serif);width:100%;min-width:760px;max-width:960px;height:auto}
.distlock-timeline text{fill:currentColor}
.distlock-timeline .dl-quiet{fill:var(--body-quiet-color,currentColor);opacity:.8}
.distlock-timeline .dl-grid{stroke:var(--border-color,currentColor);stroke-opacity:.6}
.distlock-timeline .dl-lane{fill:var(--darkened-bg,currentColor);fill-opacity:.35}
.distlock-timeline .dl-now{stroke:currentColor;stroke-dasharray:4 3}
.distlock-timeline .dl-bar rect{stroke:var(--body-bg,#fff);stroke-width:.5}
.distlock-timeline .dl-bar text{fill:#fff;font-weight:600}
.distlock-timeline .dl-bar-released rect{fill:#3b78a8}
.distlock-timeline .dl-bar-held rect{fill:#2e8b46}
.distlock-timeline .dl-bar-expired rect{fill:#c26a00}
.distlock-timeline .dl-bar-broken rect{fill:#c62828}
.distlock-timeline .dl-bar-unknown rect{fill:#7a7a7a}
.distlock-timeline .dl-tail{stroke:#c26a00;stroke-width:3;stroke-dasharray:5 3}
.distlock-timeline .dl-mark{stroke:var(--body-bg,#fff);stroke-width:1}
.distlock-timeline .dl-red{fill:#e03131}
.distlock-timeline .dl-orange{fill:#f08c00}
.distlock-timeline .dl-ink{fill:currentColor}
.distlock-timeline .dl-tick{stroke:currentColor;stroke-width:1.5;stroke-opacity:.75}
.distlock-timeline .dl-x{stroke:#e03131;stroke-width:3}
"""

_ON_TOP = ("stale_write", STALE_WRITE_ACCEPTED)
_STEPS = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
    600, 900, 1800, 3600, 7200, 3 * 3600, 6 * 3600, 12 * 3600, 86400,
]


def _a(value: object) -> str:
    return escape(str(value), quote=True)


def _text_w(text: str) -> float:
    return sum(WIDE_CHAR_W if c.isupper() or c in "mw" else CHAR_W for c in text)


def _clock(at_us: int, tz: tzinfo, precise: bool = True) -> str:
    local = from_us(at_us).astimezone(tz)
    return local.strftime("%H:%M:%S.%f")[:-3] if precise else local.strftime("%H:%M:%S")


def _tip_clock(at_us: int, tz: tzinfo) -> str:
    """A tooltip's time: to the millisecond, with its zone (a tooltip stands alone)."""
    return f"{_clock(at_us, tz)} {_zone(from_us(at_us).astimezone(tz))}"


class _Axis:
    def __init__(self, timeline: Timeline) -> None:
        self.start, self.end = timeline.start_us, max(timeline.end_us, timeline.start_us + 1)
        self.left, self.right = LABEL_W, WIDTH - RIGHT

    def x(self, at_us: int) -> float:
        share = (at_us - self.start) / (self.end - self.start)
        return round(self.left + max(0.0, min(1.0, share)) * (self.right - self.left), 1)

    def ticks(self) -> tuple[float, list[int]]:
        span = (self.end - self.start) / 1e6
        step = next((s for s in _STEPS if span / s <= 7), _STEPS[-1])
        step_us = round(step * 1e6)
        first = -(-self.start // step_us) * step_us
        return step, list(range(first, self.end + 1, step_us))


def render(timeline: Timeline, *, tz: tzinfo = UTC, label: str = "") -> str:
    """The SVG markup of ``timeline``; tick labels and tooltips in time zone ``tz``."""
    axis = _Axis(timeline)
    lanes = timeline.lanes or (Lane("", (), ()),)
    bottom = TOP + LANE_H * len(lanes)
    legend, legend_h = _legend(timeline, bottom)
    height = bottom + legend_h
    title = label or timeline.title or "lock timeline"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="distlock-timeline" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{_a(title)}" data-start-us="{timeline.start_us}" '
        f'data-end-us="{timeline.end_us}">',
        f"<title>{_a(title)}</title><style>{_STYLE}</style>",
    ]
    # The "now" label's place on the axis' row: no tick label may be drawn into it.
    later = None
    taken: tuple[float, float] | None = None
    if timeline.now_us is not None and timeline.now_us > axis.end:
        later = f"now: {_later(timeline.now_us - axis.end)} later →"
        taken = (axis.right - _text_w(later) - 8, axis.right)
    elif timeline.now_us is not None:
        now_x = axis.x(timeline.now_us)
        taken = (now_x - 3 - _text_w("now") - 8, now_x + 4)
    out += _grid(axis, tz, bottom, taken)
    for row, lane in enumerate(lanes):
        out += _lane(axis, lane, TOP + row * LANE_H, tz)
    if timeline.empty:
        out.append(
            f'<text class="dl-quiet" x="{(LABEL_W + WIDTH) // 2}" y="{TOP + LANE_H // 2 + 4}" '
            'text-anchor="middle">no audit events in this window</text>'
        )
    if later is not None:
        out.append(
            f'<text x="{axis.right}" y="{TOP - 10}" text-anchor="end" class="dl-quiet">'
            f"{_a(later)}</text>"
        )
    elif timeline.now_us is not None:
        x = axis.x(timeline.now_us)
        out.append(
            f'<g class="dl-now-line"><line class="dl-now" x1="{x}" x2="{x}" y1="{TOP - 6}" '
            f'y2="{TOP + LANE_H * len(lanes)}"/><text x="{x}" y="{TOP - 8}" '
            f'text-anchor="end" dx="-3" class="dl-quiet">now</text></g>'
        )
    out += legend
    out.append("</svg>")
    return "".join(out)


def _later(us: int) -> str:
    """A duration in words for people: "40 s", "12 min", "3 h", "2 days"."""
    seconds = us / 1e6
    for unit, size, from_ in (("days", 86400, 2 * 86400), ("h", 3600, 3600), ("min", 60, 60)):
        if seconds >= from_:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def _grid(
    axis: _Axis, tz: tzinfo, bottom: int, taken: tuple[float, float] | None
) -> list[str]:
    """The ticks and their labels. A label that would run into ``taken`` (the "now"
    label's span on the same row) is left out, its line kept; so is one that would run
    into the label before it — except the last one, ended at its line at the right edge
    (the window's end), which can reach back over its neighbour: that neighbour goes."""
    step, ticks = axis.ticks()
    lines: list[str] = []
    labels: list[tuple[float, float, str]] = []  # (left, right, markup), left to right
    for at in ticks:
        x = axis.x(at)
        text = _clock(at, tz, precise=step < 1)
        lines.append(f'<line class="dl-grid" x1="{x}" x2="{x}" y1="{TOP - 4}" y2="{bottom}"/>')
        # Centred on its line, or ending at it where the centred label would run past
        # the picture's right edge (a tick at the axis' end).
        width = _text_w(text)
        anchor = "end" if x + width / 2 > WIDTH - 2 else "middle"
        left, right = (x - width, x) if anchor == "end" else (x - width / 2, x + width / 2)
        if taken is not None and not (right < taken[0] or left > taken[1]):
            continue
        markup = f'<text x="{x}" y="{TOP - 10}" text-anchor="{anchor}">{_a(text)}</text>'
        if labels and left <= labels[-1][1] + 6:
            if anchor != "end":
                continue
            labels.pop()
        labels.append((left, right, markup))
    day = from_us(axis.start).astimezone(tz)
    return [
        '<g class="dl-axis">', *lines, *(markup for _, _, markup in labels),
        f'<text x="4" y="{TOP - 10}" class="dl-quiet">{_a(day.strftime("%Y-%m-%d"))} '
        f'{_a(_zone(day))}</text></g>',
    ]


def _zone(moment: datetime) -> str:
    name = moment.tzname() or ""
    offset = moment.utcoffset() or timedelta(0)
    return name if name else f"UTC{offset}"


def _lane(axis: _Axis, lane: Lane, y: int, tz: tzinfo) -> list[str]:
    mid = y + LANE_H // 2 + 4
    out = [
        f'<g class="dl-lane-row" data-lane="{_a(lane.key)}">'
        f'<rect class="dl-lane" x="0" y="{y + 2}" width="{WIDTH}" height="{LANE_H - 4}"/>'
        f'<text x="6" y="{mid - (5 if lane.note else 0)}" font-weight="600">'
        f"<title>{_a(lane.key)}</title>{_a(elide(lane.key, 30))}</text>"
    ]
    if lane.note:
        out.append(
            f'<text x="6" y="{mid + 9}" class="dl-quiet"><title>{_a(lane.note)}</title>'
            f"{_a(elide(lane.note, 36))}</text>"
        )
    bar_y = y + (LANE_H - BAR_H) // 2
    free_x = 0.0  # where the next token written above a narrow bar may start
    for bar in lane.bars:
        drawn, free_x = _bar(axis, bar, bar_y, tz, free_x)
        out += drawn
    # Stale writes last, on top: they are what the picture is for.
    for mark in sorted(lane.marks, key=lambda m: m.kind in _ON_TOP):
        out += _mark(axis, mark, bar_y + BAR_H // 2, tz)
    out.append("</g>")
    return out


def _bar(
    axis: _Axis, bar: Bar, y: int, tz: tzinfo, free_x: float
) -> tuple[list[str], float]:
    """A grant's bar and token; returns where the next label above a bar may start (a
    run of short grants writes only the tokens that do not overlap: hover for the rest).
    """
    x0 = axis.x(bar.start_us)
    open_end = bar.end_us is None
    end = bar.end_us if bar.end_us is not None else (
        bar.expires_us if bar.ended == "held" and bar.expires_us is not None else axis.end
    )
    x1 = max(axis.x(end), x0 + 2)
    token = "?" if bar.token is None else str(bar.token)
    tip = [f"token {token}, {bar.holder or 'unknown holder'}",
           f"granted {_tip_clock(bar.start_us, tz)}" + (" (expired take-over)" if bar.took_over
                                                      else "")]
    if bar.ended == "held":
        tip.append("held now" + (f", lease ends {_tip_clock(bar.expires_us, tz)}"
                                 if bar.expires_us else ""))
    elif bar.end_us is not None:
        tip.append(f"{bar.ended} {_tip_clock(bar.end_us, tz)}")
    if bar.acted_until_us is not None:
        tip.append(f"holder still acting until {_tip_clock(bar.acted_until_us, tz)}")
    out = [
        f'<g class="dl-bar dl-bar-{_a(bar.ended)}" data-token="{_a(token)}" '
        f'data-start-us="{bar.start_us}" data-end-us="{"" if open_end else bar.end_us}" '
        f'data-ended="{_a(bar.ended)}" data-holder="{_a(bar.holder)}">'
        f"<title>{_a(chr(10).join(tip))}</title>"
        f'<rect x="{x0}" y="{y}" width="{round(x1 - x0, 1)}" height="{BAR_H}" rx="3"/>'
    ]
    text = f"token {token}" if x1 - x0 > 7 * (len(token) + 6) else token
    if x1 - x0 > 7 * len(text) + 4:
        out.append(f'<text x="{x0 + 4}" y="{y + BAR_H - 5}">{_a(text)}</text>')
    elif x0 >= free_x:  # too narrow: the token above the bar, if there is room
        out.append(f'<text x="{x0}" y="{y - 3}" style="fill:currentColor">{_a(text)}</text>')
        free_x = x0 + 7 * len(text) + 4
    if bar.ended == "held" and bar.expires_us is not None and bar.expires_us > axis.end:
        out.append(
            f'<text x="{axis.right}" y="{y + BAR_H + 11}" text-anchor="end" '
            f'style="fill:currentColor">lease ends {_a(_clock(bar.expires_us, tz, False))} →'
            "</text>"
        )
    if bar.acted_until_us is not None and bar.end_us is not None:
        # Below the bar row: in a lock's lane the next grant's bar is already there.
        xa, below = axis.x(bar.acted_until_us), y + BAR_H + 5
        out.append(
            f'<line class="dl-tail" x1="{x1}" x2="{xa}" y1="{below}" y2="{below}">'
            f"<title>token {_a(token)}: the holder still believed it held the lock</title>"
            "</line>"
        )
    out.append("</g>")
    return out, free_x


def _mark(axis: _Axis, mark: Mark, y: int, tz: tzinfo) -> list[str]:
    x = axis.x(mark.at_us)
    token = "" if mark.token is None else str(mark.token)
    head = (
        f'<g class="dl-mark-g dl-mark-{_a(mark.kind)}" data-kind="{_a(mark.kind)}" '
        f'data-token="{_a(token)}" data-at-us="{mark.at_us}">'
        # The detail's own times (stored as UTC ISO) in the site's zone, as in the lists.
        f"<title>{_a(_tip_clock(mark.at_us, tz))} {_a(detail_text(mark.text, mark.at_us))}"
        f"{_a(f' (token {token})') if token else ''}</title>"
    )
    if mark.kind == "took_over":  # on the new grant's bar's upper edge
        y -= BAR_H // 2
    elif mark.kind == "lost":  # on the lower edge, clear of a stale write at that moment
        y += BAR_H // 2 + 2
    return [head, _symbol(mark.kind, x, y), "</g>"]


def _symbol(kind: str, x: float, y: float) -> str:
    if kind == "took_over":
        return f'<path class="dl-mark dl-orange" d="M{x} {y - 7}l7 7-7 7-7-7z"/>'
    if kind == "renewed":
        return f'<line class="dl-tick" x1="{x}" x2="{x}" y1="{y - 11}" y2="{y + 11}"/>'
    if kind == "broken":
        return (f'<path class="dl-x" d="M{x - 6} {y - 6}l12 12M{x + 6} {y - 6}l-12 12"/>')
    if kind == "lost":
        return (f'<circle class="dl-mark dl-orange" cx="{x}" cy="{y}" r="6"/>'
                f'<text class="dl-glyph" x="{x}" y="{y + 4}" text-anchor="middle" '
                'style="fill:#fff;font-weight:700">!</text>')
    if kind == "stale_write":
        return (f'<circle class="dl-mark dl-red" cx="{x}" cy="{y}" r="8"/>'
                f'<path d="M{x - 3.5} {y - 3.5}l7 7M{x + 3.5} {y - 3.5}l-7 7" '
                'style="stroke:#fff;stroke-width:2"/>')
    if kind == STALE_WRITE_ACCEPTED:
        return (f'<path class="dl-mark dl-red" d="M{x} {y - 10}l9 16h-18z"/>'
                f'<text class="dl-glyph" x="{x}" y="{y + 4}" text-anchor="middle" '
                'style="fill:#fff;font-weight:700">!</text>')
    if kind == "released":
        return f'<circle class="dl-mark dl-ink" cx="{x}" cy="{y}" r="3"/>'
    return f'<circle class="dl-mark dl-ink" cx="{x}" cy="{y}" r="4"/>'


_LEGEND = [
    ("bar", "released", "grant (token), released"),
    ("bar", "expired", "lease ran out"),
    ("bar", "broken", "broken"),  # with the break's mark on it when both are drawn
    ("bar", "held", "held now"),
    ("tail", "", "holder still acting"),
    ("took_over", "", "expired take-over"),
    ("stale_write", "", "stale write refused"),
    (STALE_WRITE_ACCEPTED, "", "stale write ACCEPTED"),
    ("lost", "", "lease lost"),
    ("broken", "", "broken"),  # only without a broken bar: one key per word
    ("renewed", "", "renewed"),
]


def _legend(timeline: Timeline, top: int) -> tuple[list[str], int]:
    """A key to the symbols this picture uses (only those, each once), in rows that wrap
    inside the picture's width; returns the markup and its height."""
    bars = [bar for lane in timeline.lanes for bar in lane.bars]
    used = {("bar", bar.ended) for bar in bars} | {
        (mark.kind, "") for lane in timeline.lanes for mark in lane.marks
    }
    if any(bar.acted_until_us is not None for bar in bars):
        used.add(("tail", ""))
    broken_mark = ("broken", "") in used
    if ("bar", "broken") in used:
        used.discard(("broken", ""))
    out = ['<g class="dl-legend">']
    x, y = 8.0, top + LEGEND_ROW
    for kind, css, text in _LEGEND:
        if (kind, css) not in used:
            continue
        symbol_w = 20 if kind not in ("bar", "tail") else 22
        if x > 8 and x + symbol_w + _text_w(text) > WIDTH - 8:
            x, y = 8.0, y + LEGEND_ROW
        out.append(f'<g class="dl-key" data-key="{_a(kind)}{"-" + _a(css) if css else ""}">')
        if kind == "bar":
            out.append(f'<g class="dl-bar dl-bar-{css}"><rect x="{x}" y="{y - 9}" '
                       'width="18" height="10" rx="2"/></g>')
            if css == "broken" and broken_mark:
                out.append(_symbol("broken", x + 9, y - 4))
        elif kind == "tail":
            out.append(f'<line class="dl-tail" x1="{x}" x2="{x + 18}" y1="{y - 4}" '
                       f'y2="{y - 4}"/>')
        else:
            out.append(_symbol(kind, x + 8, y - 4))
        x += symbol_w
        out.append(f'<text x="{x}" y="{y}">{_a(text)}</text></g>')
        x += _text_w(text) + 14
    out.append("</g>")
    return out, y - top + LEGEND_PAD
