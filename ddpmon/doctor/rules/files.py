"""What the state directory holds: bad_state_file, unreachable_daemon, no_state_files,
other_job, leftover_state_file, missing_ranks.

Not verdicts but the ground under them: a file that cannot be read, a daemon that does not
answer, files of another job or of an earlier, larger run, ranks without a file. Each says
what the diagnosis could not see, so that a reader does not trust it further than it goes.
"""

from __future__ import annotations

from collections import Counter

from .. import words
from ..findings import Finding
from ..load import StateFile


def bad_files(bad: list[tuple[str, str]]) -> list[Finding]:
    """bad_state_file: a file that cannot be read (named, with the reason);
    unreachable_daemon: a node daemon (``--from``) that did not answer."""
    out = []
    for path, reason in bad:
        if path.startswith(("http://", "https://")):
            out.append(
                Finding(
                    "unreachable_daemon",
                    "warning",
                    [],
                    f"{path} {reason}",
                    fix=words.FIX_UNREACHABLE_DAEMON,
                )
            )
        else:
            out.append(
                Finding(
                    "bad_state_file",
                    "warning",
                    [],
                    f"{path} {reason}",
                    fix=words.FIX_BAD_STATE_FILE,
                )
            )
    return out


def no_state_files(state_dir: str) -> Finding:
    """no_state_files: nothing to diagnose (verdict no_data)."""
    return Finding(
        "no_state_files",
        "warning",
        [],
        f"no readable rank state files (rank-<R>.json) in {state_dir}",
        fix=words.FIX_NO_STATE_FILES,
    )


def other_job(job: str, jobs: dict[str, list[int]]) -> list[Finding]:
    """other_job: the directory also holds files of other jobs; the diagnosis is of one."""
    return [
        Finding(
            "other_job",
            "info",
            jobs[other],
            f"the directory also holds state files of job {other!r} (ranks "
            f"{words.ranks(jobs[other])}); this diagnosis is about job {job!r}",
            fix=words.fix_other_job(other),
        )
        for other in sorted(set(jobs) - {job})
    ]


def membership(files: list[StateFile]) -> tuple[list[StateFile], int, list[int], list[Finding]]:
    """The job's world size, its files, the ranks without one, and leftover_state_file:
    files of ranks beyond the world size, left by an earlier, larger run (ignored)."""
    sizes = Counter(f.state.world_size for f in files if f.state.world_size is not None)
    world = sizes.most_common(1)[0][0] if sizes else max(f.rank for f in files) + 1
    leftover = [f for f in files if f.rank >= world]
    notes = []
    if leftover:
        notes.append(
            Finding(
                "leftover_state_file",
                "info",
                [f.rank for f in leftover],
                f"ignored {', '.join(f.name for f in leftover)}: rank beyond the job's world size "
                f"{world} (left by an earlier, larger run)",
                fix=words.FIX_LEFTOVER,
            )
        )
    files = [f for f in files if f.rank < world]
    missing = sorted(set(range(world)) - {f.rank for f in files})
    return files, world, missing, notes


def missing_ranks(
    missing: list[int], world: int, unreadable: set[int], findings: list[Finding]
) -> list[Finding]:
    """missing_ranks: ranks of the job without a state file (those with an unreadable one are
    named by bad_state_file), unless missing_rank, lost_node or not_arrived already blames
    them, or the job is starting (``starting``: ranks never write their first file
    together)."""
    blamed = {
        r
        for f in findings
        if f.kind in ("missing_rank", "lost_node", "not_arrived")
        for r in f.ranks
    }
    if any(f.kind == "starting" for f in findings):
        blamed.update(missing)
    absent = [r for r in missing if r not in unreadable and r not in blamed]
    if not absent:
        return []
    return [
        Finding(
            "missing_ranks",
            "warning",
            absent,
            f"no state file for ranks {words.ranks(absent)} of {world}",
            fix=words.FIX_MISSING_RANKS,
        )
    ]
