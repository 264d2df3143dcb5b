"""What a finding is: the record every rule returns (:mod:`mpdiag.analysis.findings` for the gradient and
loss-scale rules, :mod:`mpdiag.analysis.fp8_findings` for FP8) and how findings are ordered."""

from __future__ import annotations

from dataclasses import dataclass, field

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    """One diagnosis. ``page`` names the dashboard page that shows the evidence."""

    rule: str
    severity: str
    title: str
    evidence: str
    recommendation: str
    tensors: list[str] = field(default_factory=list)
    fix: dict | None = None
    page: str = "Gradients"
    #: query parameters that select the evidence on ``page`` beyond the run (e.g. the FP8 page's layer, role
    #: and recipe), so the page opens on what the evidence names
    focus: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)
