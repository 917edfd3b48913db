"""Run at the start of every Python process the tests start (conftest.py puts this folder on
their PYTHONPATH): servers, Jupyter, Voila, kernels, CLI runs.

jsonschema imports `rfc3987_syntax` when it is installed (jupyter-events asks for
jsonschema[format-nongpl]), and that module builds some forty lark grammars as it is imported:
2-4 s of CPU in every process that imports jsonschema, which here is every Jupyter or Voila
server and every kernel that draws a plotly figure (plotly.io -> nbformat -> jsonschema).
Nothing the tests check validates an IRI, the one format it adds; without it jsonschema
behaves as it does where the package is not installed."""
import sys

sys.modules.setdefault("rfc3987_syntax", None)
