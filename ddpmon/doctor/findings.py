"""What the doctor concludes: findings (one per ``kind``) and the diagnosis that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .view import RankView

VERDICTS = (
    "healthy",
    "hang",
    "dead_rank",
    "desync",
    "straggler",
    "cannot_write",
    "not_started",
    "no_data",
)


@dataclass
class Finding:
    """One thing found. ``kind`` names the rule that found it (docs/doctor.md lists them)."""

    kind: str
    severity: str  # error | warning | info
    ranks: list[int]
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "ranks": self.ranks,
            "summary": self.summary,
            "evidence": self.evidence,
            "fix": self.fix,
        }


class Verdict(NamedTuple):
    """What a verdict rule concludes: the verdict, the ranks to blame, and why."""

    verdict: str
    suspects: list[int]
    findings: list[Finding]


@dataclass
class Diagnosis:
    verdict: str
    suspect_ranks: list[int]
    findings: list[Finding]
    ranks: list[RankView]
    job: str | None = None
    state_dir: str | None = None
    jobs: dict[str, list[int]] = field(default_factory=dict)
    generated_unix: float = 0.0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Earlier attempts of a restarted job, oldest first (``doctor/load.earlier_attempts``)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "suspect_ranks": self.suspect_ranks,
            "findings": [f.as_dict() for f in self.findings],
            "ranks": [r.as_dict() for r in self.ranks],
            "job": self.job,
            "state_dir": self.state_dir,
            "jobs": self.jobs,
            "generated_unix": self.generated_unix,
            "attempts": self.attempts,
        }
