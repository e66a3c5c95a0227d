"""Synthetic studies with ground truth: the data radreport-tiny trains and is evaluated on.

See docs/interfaces.md, "Synthetic studies". `generate_study` is pure; `write_split` puts a split on disk.
"""

from .generator import GENERATOR_VERSION, SPLITS, SynthStudy, generate_study
from .reports import render_report
from .splits import write_split

__all__ = [
    "GENERATOR_VERSION",
    "SPLITS",
    "SynthStudy",
    "generate_study",
    "render_report",
    "write_split",
]
