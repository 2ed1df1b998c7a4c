"""quantspec.report: the per-pair compatibility matrix (`quantspec report`).

config.py (what is measured, typed), defaults.py (built-in prompts and texts), pipeline.py (the
verbs a report composes), cache.py (content-keyed artifacts), matrix.py (cells, resumable run),
render.py (rich table, report.md, report.json, heatmap).
"""

from quantspec.report.config import Cell, ReportConfig
from quantspec.report.matrix import CellResult, Report, run_report
from quantspec.report.pipeline import Pipeline

__all__ = ["Cell", "CellResult", "Pipeline", "Report", "ReportConfig", "run_report"]
