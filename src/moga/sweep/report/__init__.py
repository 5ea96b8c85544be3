"""The transfer report of a learning-rate sweep: metrics, verdicts, figures, Markdown/HTML/JSON/CSV.

    from moga.sweep.report import analyze, write_report
    panels = analyze(records, scale_key="depth")          # one PanelSummary per optimizer x scaling
    print(panels[0].verdict_line)
    write_report(records, "out/report", scale_key="depth")  # report.md, report.html, summary.json, ...

``records`` are dicts or :class:`SweepRecord` (see :mod:`moga.sweep.report.schema` for the fields and
how statuses count); the definitions of optimum, drift, regret and verdict are in
:mod:`moga.sweep.report.metrics` and :mod:`moga.sweep.report.verdict`.
"""

from moga.sweep.report.bootstrap import Bootstrap
from moga.sweep.report.curves import Curve, Grid
from moga.sweep.report.figures import plot_panels
from moga.sweep.report.metrics import analyze
from moga.sweep.report.summary import Drift, PanelSummary, Regret
from moga.sweep.report.outputs import write_report
from moga.sweep.report.render import print_verdicts, verdict_table
from moga.sweep.report.schema import SweepRecord, load_records, parse_records

__all__ = [
    "Bootstrap", "Curve", "Drift", "Grid", "PanelSummary", "Regret", "SweepRecord", "analyze", "load_records",
    "parse_records", "plot_panels", "print_verdicts", "verdict_table", "write_report",
]
