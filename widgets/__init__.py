"""Jupyter panels over the engine's public API and telemetry (ipywidgets + plotly).

Imported only by notebooks and the dashboard: `workbench` itself never imports this package.
"""
