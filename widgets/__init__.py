"""Jupyter panels over the engine's public API and telemetry (ipywidgets + plotly).

    from widgets import Dashboard, Live, Stepper, TokenStreamPanel, BatchTimeline, KVBlockMap

Imported only by notebooks and the dashboard: `workbench` itself never imports this package.
Panels are fed on the kernel's own asyncio loop (see `widgets.live`), at most ~20 times a
second, from the in-process Engine, a remote OpenAI-compatible server, or a recorded trace
(`ReplaySource`). `RooflinePanel`, `ABPanel` and `TunePanel` are the dashboard's instruments;
`widgets.figures` draws static figures for notebooks (no widget state to save).
"""
from .ab import ABPanel
from .dashboard import Dashboard
from .knobs import KnobPanel
from .kv_map import KVBlockMap
from .live import Live, Pump
from .replay import ReplaySource
from .roofline import RooflinePanel
from .sources import LocalSource, RemoteSource
from .stepper import Stepper
from .summary import SummaryPanel
from .timeline import BatchTimeline
from .token_stream import TokenStreamPanel
from .tune import TunePanel

__all__ = ["Dashboard", "Live", "Pump", "Stepper", "KnobPanel", "KVBlockMap", "BatchTimeline",
           "TokenStreamPanel", "SummaryPanel", "LocalSource", "RemoteSource", "ReplaySource",
           "RooflinePanel", "ABPanel", "TunePanel"]
