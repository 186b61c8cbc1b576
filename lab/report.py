"""The lab's results as a text table and as one self-contained HTML page.

The page has the table (stale and lost cells tinted), the rates, and per scenario and
contender the timeline of the first trial with the fault on: each client's lane from its
grant to its release, its writes (accepted, accepted though stale, refused) and the
fault's marks. No script, no outside file: it opens from disk or from a CI artifact.
"""

from __future__ import annotations

import html as escape
from typing import Any

COLUMNS = ("contender", "scenario", "fault", "trials", "overlapping", "stale accepted",
           "stale refused", "increments accepted", "counter total", "lost updates",
           "tokens again")
KEYS = ("trials", "overlapping", "stale_accepted", "stale_refused", "increments", "total",
        "lost", "reissued")


def rows(results: dict[str, Any]) -> list[list[str]]:
    return [[cell["contender"], cell["scenario"], "on" if cell["fault"] else "off (control)",
             *(str(cell.get(key, 0)) for key in KEYS)] for cell in results["cells"]]


def broken_controls(results: dict[str, Any]) -> list[str]:
    """Control cells with an overlap, a stale write, a lost update or a token issued again
    (must be none). Results from before the tokens were counted have none."""
    return [f"{cell['contender']} × {cell['scenario']}: {cell['overlapping']} overlapping, "
            f"{cell['stale_accepted'] + cell['stale_refused']} stale, {cell['lost']} lost, "
            f"{cell.get('reissued', 0)} tokens again"
            for cell in results["cells"] if not cell["fault"]
            and (cell["overlapping"] or cell["stale_accepted"] or cell["stale_refused"]
                 or cell["lost"] or cell.get("reissued", 0))]


def text(results: dict[str, Any]) -> str:
    table = [list(COLUMNS), *rows(results)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True))
             .rstrip() for row in table]
    if results["rates"]:
        lines.append("acquire + release per second, uncontended, one client process:")
        lines.append("  " + ", ".join(f"{name} {value:.0f}/s"
                                      for name, value in results["rates"].items()))
    lines.extend(results["notes"])
    lines.append(f"{results['command']}: {results['seconds']:g} s")
    return "\n".join(lines)


COLOURS = {"ok": "#2e7d32", "stale": "#c62828", "refused": "#757575"}


def timeline(cell: dict[str, Any]) -> str:
    """An SVG of one trial: lanes A and B, their sections, writes and the fault's marks."""
    data = cell["timeline"] or {"events": [], "marks": []}
    events, marks = data["events"], data["marks"]
    if not events:
        return ""
    end = max([e["t1"] for e in events] + [t for _, t in marks]) or 1.0
    width, left, lane = 760, 40, 44
    right = 50  # room for the last mark's label
    scale = (width - left - right) / end

    def x(t: float) -> float:
        return left + t * scale

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="150" '
             f'role="img" aria-label="timeline of one trial">'
             '<defs><pattern id="stopped" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="3" height="6" fill="#ef6c00" '
             'opacity="0.35"/></pattern></defs>']
    for index, client in enumerate(("A", "B")):
        y = 20 + index * lane
        parts.append(f'<text x="4" y="{y + 16}" font-size="13">{client}</text>')
        mine = [e for e in events if e["client"] == client]
        grants = [e for e in mine if e["op"] == "acquire" and e["result"] is not None]
        asks = [e for e in mine if e["op"] == "acquire"]
        if asks:  # waiting for the lock: a thin line from the ask to the grant (or refusal)
            parts.append(f'<line x1="{x(asks[0]["t0"]):.1f}" x2="{x(asks[0]["t1"]):.1f}" '
                         f'y1="{y + 12}" y2="{y + 12}" stroke="#bbb" stroke-dasharray="3 3"/>')
        if grants:
            ends = [e["t0"] for e in mine if e["op"] in ("write", "release")]
            start, stop = grants[0]["t1"], max(ends) if ends else end
            span = max(1.0, (stop - start) * scale)
            parts.append(f'<rect x="{x(start):.1f}" y="{y}" width="{span:.1f}" '
                         f'height="24" fill="#90caf9" opacity="0.6"><title>{client} holds '
                         f'(its view), {start:.3f}–{stop:.3f} s</title></rect>')
        for event in mine:
            if event["op"] != "write":
                continue
            kind = "refused" if not event["result"] else "stale" if event["stale"] else "ok"
            label = {"ok": "write accepted", "stale": "STALE write accepted",
                     "refused": "stale write refused"}[kind]
            parts.append(f'<rect x="{x(event["t0"]) - 3:.1f}" y="{y - 2}" width="6" height="28" '
                         f'fill="{COLOURS[kind]}"><title>{client}: {label} (row '
                         f'{escape.escape(event["key"])}) at {event["t0"]:.3f} s</title></rect>')
    times = dict(marks)
    if "heal" in times:  # A stopped (a pause) or cut off (a partition) until the heal
        what = ("A cut off (its link down)" if cell["scenario"] == "partition"
                else "A stopped (SIGSTOP)")
        parts.append(f'<rect x="{x(times["fault"]):.1f}" y="14" '
                     f'width="{(times["heal"] - times["fault"]) * scale:.1f}" height="36" '
                     f'fill="url(#stopped)"><title>{what}</title></rect>')
    for what, t in marks:
        colour = "#ef6c00" if what == "fault" else "#6a1b9a"
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="10" y2="112" stroke="{colour}" '
                     f'stroke-width="2"/><text x="{x(t) + 3:.1f}" y="122" font-size="11" '
                     f'fill="{colour}">{what}</text>')
    parts.append(f'<text x="{left}" y="142" font-size="11" fill="#555">0 s</text>'
                 f'<text x="{x(end):.1f}" y="142" font-size="11" fill="#555" '
                 f'text-anchor="end">{end:.2f} s</text></svg>')
    return "".join(parts)


def html(results: dict[str, Any]) -> str:
    head = "".join(f"<th>{escape.escape(c)}</th>" for c in COLUMNS)
    body = []
    for cell, row in zip(results["cells"], rows(results), strict=True):
        tds = []
        for column, value in zip(COLUMNS, row, strict=True):
            bad = value not in ("0", "") and column in ("stale accepted", "lost updates",
                                                            "tokens again")
            tds.append(f'<td class="{"bad" if bad else ""}">{escape.escape(value)}</td>')
        body.append(f'<tr class="{"on" if cell["fault"] else "off"}">{"".join(tds)}</tr>')
    rates = "".join(f"<tr><td>{escape.escape(name)}</td><td>{value:.0f}</td></tr>"
                    for name, value in results["rates"].items())
    pictures = "".join(
        f"<figure><figcaption>{escape.escape(cell['contender'])} × "
        f"{escape.escape(cell['scenario'])}, fault on, first trial</figcaption>"
        f"{timeline(cell)}</figure>"
        for cell in results["cells"] if cell["fault"])
    notes = "".join(f"<p>{escape.escape(n)}</p>" for n in results["notes"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>distlock comparison lab</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:nth-child(-n+3) {{ text-align: left; }}
tr.off td {{ color: #666; }}
td.bad {{ background: #ffcdd2; font-weight: bold; }}
figure {{ margin: 1.5em 0; }} figcaption {{ font-weight: bold; }}
.key span {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }}
</style></head><body>
<h1>distlock comparison lab</h1>
<p>Command: <code>{escape.escape(results["command"])}</code>, {results["trials"]} trial(s) per
cell, pause ttl {results["ttl"]:g} s, {results["seconds"]:g} s in all. Each row with the fault
off is the control: the same harness, whose overlaps, stale writes, lost updates and tokens
issued again must be 0.</p>
<table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>
{notes}
<h2>Acquire + release per second (uncontended, one client process)</h2>
<table><tbody>{rates}</tbody></table>
<h2>One trial of each cell, with the fault on</h2>
<p class="key">A client's bar runs from its grant to its release (its own view).
<span style="background:{COLOURS['ok']}"></span>write accepted
<span style="background:{COLOURS['stale']}"></span>stale write accepted
<span style="background:{COLOURS['refused']}"></span>stale write refused;
orange line: the fault strikes (hatched: A stopped, or cut off in the partition), purple: it
heals.</p>
{pictures}
</body></html>
"""


def main(argv: list[str] | None = None) -> None:
    """``python -m lab.report RESULTS.json PAGE.html``: the page again from saved results."""
    import json
    import sys
    from pathlib import Path

    source, target = (sys.argv[1:] if argv is None else argv)
    Path(target).write_text(html(json.loads(Path(source).read_text())))


if __name__ == "__main__":
    main()
