"""KVBlockMap: the paged KV pool as a grid, one square per block.

Coloured by the request that holds it; a dark outline marks a block shared by several
requests (a common prompt prefix, thanks to prefix caching); hatched blue marks a free block
that still holds a cached prefix (the next request with that prefix reuses it instead of
recomputing). Hover a square for its id, owners and reference count.
"""
from __future__ import annotations

import ipywidgets as w
import traitlets

from .style import PALETTE, css_widget, esc

MAX_SHOWN = 4096


class KVBlockMap(w.VBox):
    """Feed it with `show(engine.kv_blocks())`; it redraws only when the pool changed."""

    num_used = traitlets.Int(0)
    num_shared = traitlets.Int(0)
    num_cached_free = traitlets.Int(0)
    renders = traitlets.Int(0)

    def __init__(self, columns: int = 48, title: str = "KV block map", **kw):
        self.columns = columns
        self.title = title
        self.colours: dict[str, int] = {}
        self._key = None
        self.view = w.HTML(f'<div class="wb"><h3>{esc(title)}</h3>'
                           '<div class="muted">No engine yet.</div></div>')
        super().__init__([css_widget(), self.view], **kw)

    def unavailable(self, why: str) -> None:
        self.view.value = (f'<div class="wb"><h3>{esc(self.title)}</h3>'
                           f'<div class="muted">{esc(why)}</div></div>')
        self._key = None

    def _colour(self, rid: str) -> int:
        if rid not in self.colours:
            self.colours[rid] = len(self.colours) % len(PALETTE)
        return self.colours[rid]

    def show(self, snap) -> None:
        if snap is None:
            return
        key = (tuple(snap.ref_counts), tuple(snap.cached),
               tuple((r, tuple(t)) for r, t in snap.block_tables.items()))
        if key == self._key:
            return
        self._key = key
        owners = snap.owners()
        n = min(snap.num_blocks, MAX_SHOWN)
        cells = []
        used = shared = cached_free = 0
        for b in range(snap.num_blocks):
            refs = snap.ref_counts[b]
            used += refs > 0
            shared += refs > 1
            cached_free += refs == 0 and snap.cached[b]
            if b >= n:
                continue
            if b == snap.null_block:
                cells.append(f'<i class="n" title="block {b} · the null block: reserved, '
                             'never handed out; padded graph rows write here"></i>')
            elif refs > 0:
                who = owners[b]
                cls = f"o{self._colour(who[0])}" + (" s" if refs > 1 else "")
                tip = f"block {b} · {', '.join(who)} · refs {refs}" + (" · cached" if snap.cached[b] else "")
                cells.append(f'<i class="{cls}" title="{esc(tip)}"></i>')
            elif snap.cached[b]:
                cells.append(f'<i class="c" title="block {b} · free, holds a cached prefix"></i>')
            else:
                cells.append("<i></i>")
        self.num_used, self.num_shared, self.num_cached_free = used, shared, cached_free
        legend = "".join(f'<span><i class="o{self._colour(r)}"></i>{esc(r)} '
                         f'<span class="muted">{len(t)}</span></span>'
                         for r, t in list(snap.block_tables.items())[:24])
        more = "" if n == snap.num_blocks else f" · showing the first {n}"
        usable = snap.num_blocks - (snap.null_block is not None)
        null = ('<span><i class="n"></i>null block (reserved)</span>'
                if snap.null_block is not None and snap.null_block < n else "")
        self.view.value = (
            f'<div class="wb"><h3>{esc(self.title)} <span class="muted">· {snap.num_blocks} '
            f'blocks of {snap.block_size} tokens · {used} used ({used / max(usable, 1):.0%}) · '
            f'{shared} shared · {cached_free} cached-free{more}</span></h3>'
            f'<div class="kv" style="grid-template-columns: repeat({self.columns}, 11px)">'
            f'{"".join(cells)}</div><div class="legend">{legend}'
            '<span><i style="background: var(--jp-layout-color3, #e4e6ea)"></i>free</span>'
            '<span><i style="background: repeating-linear-gradient(45deg, #a0cbe8 0 2px, '
            '#dbe9f4 2px 4px)"></i>cached-free</span>'
            '<span><i style="outline: 2px solid #222; outline-offset: -2px; background: '
            f'#ccc"></i>shared prefix</span>{null}</div></div>')
        self.renders += 1
