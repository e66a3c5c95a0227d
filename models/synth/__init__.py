"""Synthetic studies with ground truth: the data radreport-tiny trains and is evaluated on.

See docs/interfaces.md, "Synthetic studies". `generate_study` is pure; `write_split` puts a split on disk.
"""

from .findings import Finding, KINDS
from .generator import GENERATOR_VERSION, SPLITS, SynthStudy, generate_study
from .reports import ParsedReport, parse_report, render_report
from .splits import write_split

__all__ = [
    "Finding", "KINDS", "GENERATOR_VERSION", "SPLITS", "SynthStudy", "generate_study", "ParsedReport",
    "parse_report", "render_report", "write_split",
]
