"""The timing report of one split request: its data (timeline.py), figures (figures.py) and
JSON document (document.py); the renderings are text.py (terminal) and html.py (one page).

The names most callers need are re-exported here: `from exo_split.report import build_report`.
"""

from exo_split.report.document import load, load_comparison, load_report, to_json
from exo_split.report.figures import (
    build_report,
    clock_offset,
    compare,
    hidden_fraction,
    ideal_pipelined_time,
    measured_ideal,
    median_inject_s,
    overlap_efficiency,
    percentile,
    piece_compute_s,
    piece_starts,
    time_span,
    wire_intervals,
)
from exo_split.report.timeline import (
    COMPARISON_SCHEMA,
    MODES,
    SCHEMA,
    ClockSync,
    Comparison,
    ComparisonRow,
    HandoffReport,
    LayerTiming,
    Timeline,
)

__all__ = [
    "COMPARISON_SCHEMA",
    "MODES",
    "SCHEMA",
    "ClockSync",
    "Comparison",
    "ComparisonRow",
    "HandoffReport",
    "LayerTiming",
    "Timeline",
    "build_report",
    "clock_offset",
    "compare",
    "hidden_fraction",
    "ideal_pipelined_time",
    "load",
    "load_comparison",
    "load_report",
    "measured_ideal",
    "median_inject_s",
    "overlap_efficiency",
    "percentile",
    "piece_compute_s",
    "piece_starts",
    "time_span",
    "to_json",
    "wire_intervals",
]
