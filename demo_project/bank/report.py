"""The contention demo's HTML report: the story of each run as a picture.

One self-contained file (inline CSS and SVG, no script, no URL to fetch) that opens from
disk anywhere: per mode, the grants of the account's lock along time, one lane per worker
(drawn by distlock's own timeline renderer from the run's audit events), the stalls, the
stale writes refused — or, unfenced, accepted — and the final balance against the
expected one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC
from html import escape
from pathlib import Path
from typing import Any

from distlock.admin.timeline import STALE_WRITE_ACCEPTED, build
from distlock.admin.timeline_svg import render

#: The zone of the report's times: UTC, a fixed zone that reads the same on every
#: machine the demo runs on. demo_project/settings.py's TIME_ZONE is the same, so the
#: demo's admin shows the times the report does (tests/test_demo.py checks they agree).
ZONE = UTC


@dataclass(frozen=True)
class _Accepted:
    """An unfenced stale write, as an event: nothing in distlock saw it happen."""

    at_us: int
    name: str
    token: int
    holder: str
    detail: str
    kind: str = STALE_WRITE_ACCEPTED


def mode_picture(lock: str, events: list[Any], attempts: list[Any], base: int) -> str:
    """The SVG of one mode: its grants per worker, the stalls and the stale writes."""
    workers = {a.token: a.worker for a in attempts}
    shown = [e for e in events if e.token is None or e.token > base]  # not the probe
    for a in attempts:
        if a.outcome == "written" and a.taken_over_by and a.wrote_us:
            shown.append(_Accepted(
                a.wrote_us, lock, a.token, a.worker,
                f"wrote {a.wrote_balance} over the newer holder's deposit (lock at token "
                f"{a.taken_over_by})",
            ))
    timeline = build(
        shown, lane_of=lambda bar: workers.get(bar.token or 0, bar.holder or "?"),
        title=f"grants of {lock} per worker",
    )
    return render(timeline, tz=ZONE)


_CSS = """
:root{--body-fg:#222;--body-bg:#fff;--body-quiet-color:#666;--border-color:#ccc;
 --darkened-bg:#f3f3f3;--good:#2e8b46;--bad:#d32f2f;color-scheme:light dark}
@media (prefers-color-scheme:dark){:root{--body-fg:#eee;--body-bg:#121212;
 --body-quiet-color:#bbb;--border-color:#444;--darkened-bg:#222;--good:#5cc27a;
 --bad:#ff6b6b}}
body{background:var(--body-bg);color:var(--body-fg);font:15px/1.45 system-ui,sans-serif;
 margin:2em auto;max-width:1000px;padding:0 1em}
h1{font-size:1.5em}h2{margin-top:2em;border-bottom:1px solid var(--border-color)}
table{border-collapse:collapse;margin:1em 0}td,th{padding:.3em .8em;
 border-bottom:1px solid var(--border-color);text-align:left}th{font-weight:600}
.good{color:var(--good);font-weight:600}.bad{color:var(--bad);font-weight:600}
.quiet{color:var(--body-quiet-color)}.picture{overflow-x:auto}
"""


def html(run: dict[str, Any], results: dict[str, dict[str, Any]], pictures: dict[str, str],
         intro: str) -> str:
    """The whole report page. ``pictures``: the SVG of each mode (already escaped)."""
    e = escape
    rows = []
    for mode, r in results.items():
        ok = r["lost_updates"] == 0 and r["complete"]
        rows.append(
            f"<tr><th>{e(mode)}</th><td>{r['grants']}</td><td>{len(r['stalled'])}</td>"
            f"<td>{len(r['stale_writes_refused'])}</td>"
            f"<td>{len(r['stale_writes_accepted'])}</td>"
            f"<td class=\"{'good' if ok else 'bad'}\" data-mode=\"{e(mode)}\">"
            f"{r['final']} of {r['expected']}</td><td>{r['lost_updates']}</td></tr>"
        )
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>distlock contention demo {e(run['run'])}</title><style>{_CSS}</style>"
        "</head><body>",
        f"<h1>distlock contention demo <span class=\"quiet\">{e(run['run'])}</span></h1>",
        f"<p>{e(intro)}</p>",
        "<table id=\"summary\"><tr><th>mode</th><th>grants</th><th>stalls</th>"
        "<th>stale writes refused</th><th>stale writes accepted</th>"
        "<th>final balance</th><th>lost updates</th></tr>", *rows, "</table>",
    ]
    for mode, r in results.items():
        parts.append(f"<section id=\"{e(mode)}\"><h2>{e(mode)}: {e(r['lock'])}</h2>")
        parts.append(
            f"<p>Balance <b>{r['final']}</b>, expected {r['expected']}: "
            + ("<span class=\"good\">no update lost</span>" if r["lost_updates"] == 0 else
               f"<span class=\"bad\">{r['lost_updates']} update(s) lost</span>")
            + f". {r['grants']} grants, tokens {r['first_token']}..{r['last_token']}, "
            f"{r['seconds']:.1f} s.</p>"
        )
        parts.append(f"<div class=\"picture\">{pictures.get(mode, '')}</div><ul>")
        for token, paused, by in r["stalled"]:
            parts.append(
                f"<li>token {token} stalled {paused:.2f} s past its lease"
                + (f"; token {by} took the lock meanwhile" if by else "") + "</li>"
            )
        for token, by in r["stale_writes_refused"]:
            parts.append(f"<li class=\"good\">stale write of token {token} refused "
                         f"(the lock was at token {by})</li>")
        for token, by in r["stale_writes_accepted"]:
            parts.append(f"<li class=\"bad\">stale write of token {token} ACCEPTED over "
                         f"token {by}'s deposit</li>")
        parts.append("</ul></section>")
    parts.append(
        "<p class=\"quiet\">Bars: each grant of the lock, labelled with its fencing token, "
        "from its grant to its release or expiry; the dashed line under a bar is a stalled "
        "holder still acting after its lease ran out. Times are the database clock, "
        f"{ZONE}. "
        "Hover for details.</p></body></html>"
    )
    return "".join(parts)


def write(path: Path, run: dict[str, Any], results: dict[str, dict[str, Any]],
          pictures: dict[str, str], intro: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html(run, results, pictures, intro), encoding="utf-8")
    return path
