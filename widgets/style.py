"""Colours, CSS and number formatting shared by the panels.

The CSS goes out once per panel (a static HTML widget), so the HTML that changes on every
tick carries only class names. It follows JupyterLab's theme variables, with fallbacks for
Voila and plain notebooks.
"""
from __future__ import annotations

import html
import math

import ipywidgets as w

PREFILL = "#f28e2b"
DECODE = "#4e79a7"
RUNNING = "#59a14f"
WAITING = "#e15759"
KV = "#b07aa1"
GRAPH = "#76b7b2"
DRAFTED = "#bab0ac"
ACCEPTED = "#8cd17d"
"""Speculative decoding: tokens drafted, and those of them the target accepted."""
# Request colours (Tableau 20, reordered so neighbours differ).
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#a0cbe8", "#ffbe7d", "#8cd17d", "#f1ce63", "#86bcb6",
           "#d37295", "#fabfd2", "#b6992d", "#499894", "#d4a6c8", "#79706e"]

CSS = """
<style>
.wb { font-family: var(--jp-ui-font-family, system-ui, sans-serif); font-size: 13px;
      color: var(--jp-ui-font-color1, #222); }
.wb h3 { margin: 4px 0 6px; font-size: 14px; font-weight: 600; }
.wb .muted { color: var(--jp-ui-font-color2, #666); }
.wb .badge { display: inline-block; padding: 1px 7px; border-radius: 9px; font-size: 11px;
             font-weight: 600; color: #fff; background: #888; margin-right: 4px; }
.wb .b-waiting { background: #9aa0a6; } .wb .b-streaming { background: #4e79a7; }
.wb .b-stop, .wb .b-length { background: #59a14f; } .wb .b-abort { background: #e8a33d; }
.wb .b-error { background: #e15759; }
.wb .b-prefill { background: #f28e2b; } .wb .b-chunk { background: #d37295; }
.wb .b-decode { background: #4e79a7; } .wb .b-mixed { background: #9c755f; }
.wb .b-preempt { background: #e15759; } .wb .b-idle { background: #9aa0a6; }
.wb .cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(220px, 1fr));
             gap: 6px; }
.wb .card { border: 1px solid var(--jp-border-color2, #ddd); border-radius: 6px;
            padding: 4px 6px; background: var(--jp-layout-color1, #fff); min-width: 0; }
.wb .card .hd { display: flex; justify-content: space-between; align-items: center;
                gap: 6px; white-space: nowrap; }
.wb .card .prompt { color: var(--jp-ui-font-color2, #666); font-size: 11px; overflow: hidden;
                    text-overflow: ellipsis; white-space: nowrap; margin: 1px 0; }
/* Three whole lines, newest at the bottom: the box is exactly 3 line-heights tall and has no
   vertical padding, so the top line is never cut through. */
.wb .card .txt { height: 48px; line-height: 16px; overflow-y: auto; display: flex;
                 flex-direction: column-reverse; font-family: var(--jp-code-font-family, monospace);
                 font-size: 12px; white-space: pre-wrap; word-break: break-word;
                 background: var(--jp-layout-color2, #f6f7f9); border-radius: 4px;
                 padding: 0 4px; }
.wb .card .txt .tk { border-radius: 2px; }
.wb .card .txt .think { color: var(--jp-ui-font-color3, #999); font-style: italic; }
/* Speculative decoding: an accepted draft underlined green, the token the target chose
   itself at a verify step double-underlined blue, a rejected draft faint and struck through
   (the underlines stay readable over the probability shading, which is a background). */
.wb .txt .acc, .wb .legend .acc { border-bottom: 2px solid #59a14f; }
.wb .txt .own, .wb .legend .own { border-bottom: 3px double #4e79a7; }
.wb .txt .rej, .wb .legend .rej { color: var(--jp-ui-font-color3, #999); opacity: .8;
                                  text-decoration: line-through; }
/* The footer's figures wrap as whole items where a card is narrow, never cut off. */
.wb .card .st { font-size: 11px; color: var(--jp-ui-font-color2, #555); margin-top: 2px;
                display: flex; flex-wrap: wrap; column-gap: 7px; }
.wb .card .st span { white-space: nowrap; }
.wb h3.one-line { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.wb h3.one-line .muted { font-size: 12px; font-weight: 500; }
.wb .stats { display: flex; flex-wrap: wrap; gap: 6px; }
.wb .stat { border: 1px solid var(--jp-border-color2, #ddd); border-radius: 6px;
            padding: 2px 8px; min-width: 70px; background: var(--jp-layout-color1, #fff); }
.wb .stat .v { font-size: 15px; font-weight: 600; }
.wb .stat .k { font-size: 11px; color: var(--jp-ui-font-color2, #666); }
.wb .kv { display: grid; gap: 2px; }
.wb .kv i { width: 11px; height: 11px; border-radius: 2px; display: block;
            background: var(--jp-layout-color3, #e4e6ea); }
.wb .kv i.n, .wb .legend i.n { background: var(--jp-ui-font-color2, #616161); }
.wb .kv i.c { background: repeating-linear-gradient(45deg, #a0cbe8 0 2px, #dbe9f4 2px 4px); }
.wb .kv i.s { outline: 2px solid var(--jp-ui-font-color1, #222); outline-offset: -2px; }
.wb .legend { display: flex; flex-wrap: wrap; gap: 4px 12px; margin-top: 6px; font-size: 11px; }
.wb .legend span i { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
                     margin-right: 4px; vertical-align: -1px; }
.wb table.steps { border-collapse: collapse; width: 100%; font-size: 12px; }
.wb table.steps th, .wb table.steps td { text-align: left; padding: 3px 8px;
            border-bottom: 1px solid var(--jp-border-color2, #e3e3e3); vertical-align: top; }
.wb table.steps td.mono { font-family: var(--jp-code-font-family, monospace); }
.wb .notice { border-left: 4px solid #edc948; background: rgba(237, 201, 72, .12);
              padding: 4px 8px; margin: 4px 0; border-radius: 3px; }
.wb .error { border-left: 4px solid #e15759; background: rgba(225, 87, 89, .10);
             padding: 4px 8px; margin: 4px 0; border-radius: 3px; white-space: pre-wrap; }
.wb .ok { border-left: 4px solid #59a14f; background: rgba(89, 161, 79, .10);
          padding: 4px 8px; margin: 4px 0; border-radius: 3px; }
</style>
""" + "".join(f"<style>.wb .kv i.o{i}, .wb .legend i.o{i} {{ background: {c}; }}</style>"
              for i, c in enumerate(PALETTE))


def css_widget() -> w.HTML:
    """The shared stylesheet, as a widget that never changes."""
    return w.HTML(CSS, layout=w.Layout(height="0px", margin="0", overflow="hidden"))


def esc(text: str) -> str:
    return html.escape(text, quote=True)


def notices_html(notices) -> str:
    return "".join(f'<div class="wb"><div class="notice">{esc(n)}</div></div>' for n in notices)


def modelled_label(info) -> str:
    """'' for a real device; for a modelled one (info.modelled), what every time shown of it
    is: modelled, on which profile, and how far off it measured (or that it is
    uncalibrated: no error figure then, rather than a bare number)."""
    m = getattr(info, "modelled", None)
    if not m:
        return ""
    name = m.get("device_name", m.get("profile", "?"))
    if not m.get("calibrated"):
        return f"MODELLED on {name}: uncalibrated (spec-sheet roofs; its error is unknown)"
    e = m.get("error") or {}
    err, med = e.get("max_abs_pct"), e.get("median_abs_pct")
    return (f"MODELLED on {name}: calibrated, measured error median {med:.0f} %, worst "
            f"{err:.0f} %" if err is not None and med is not None
            else f"MODELLED on {name}: calibrated (error not measured yet)")


def modelled_html(label: str) -> str:
    """The label as a banner line ('' when it is '')."""
    return f'<div class="wb"><div class="notice"><b>{esc(label)}</b></div></div>' if label else ""


def ms(seconds: float | None, digits: int = 0) -> str:
    """Seconds -> '123 ms', '4.6 s' from 10 s on (or '—')."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "—"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    return f"{seconds * 1e3:.{digits}f} ms"


def stat(value: str, key: str) -> str:
    return f'<div class="stat"><div class="v">{value}</div><div class="k">{esc(key)}</div></div>'
