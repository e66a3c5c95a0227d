"""Findings: the schema and vocabulary a report can state, and the parser that reads them out of report text."""

from .parser import NUMBER_WORDS, ParsedReport, parse_report
from .vocabulary import (
    COUNTED_TYPES,
    KIND_BY_NAME,
    KINDS,
    LATERAL_TYPES,
    SIDES,
    SIZED_TYPES,
    TYPE_ORDER,
    Finding,
    FindingSpec,
    KindSpec,
    sort_findings,
    sort_types,
)

__all__ = [
    "COUNTED_TYPES",
    "KIND_BY_NAME",
    "KINDS",
    "LATERAL_TYPES",
    "NUMBER_WORDS",
    "SIDES",
    "SIZED_TYPES",
    "TYPE_ORDER",
    "Finding",
    "FindingSpec",
    "KindSpec",
    "ParsedReport",
    "parse_report",
    "sort_findings",
    "sort_types",
]
