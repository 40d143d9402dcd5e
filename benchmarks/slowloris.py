"""Step time of a training job while a client attacks its metrics endpoint with 1,000
half-open connections and 50 that trickle a byte a second (a slowloris), against the same
job unattacked, in one run; /metrics is scraped every second throughout.

A 2-rank gloo job (tests/distributed/fault_worker.py, mode ``bench``) trains in blocks
that alternate, in ABBA order, quiet and with rank 0's endpoint under attack
(tests/distributed/attacker.py: every connection the server closes is reopened; it runs
at nice 19 so that its own CPU is not what is measured; ``--decoy`` shows what it costs
the machine all the same). Printed: rank 0's median step time, the median over block
pairs of (attacked / quiet) with a 95% bootstrap interval, the peak thread count of the
training process, the connections the attacker opened, the scrapes (how many, failed,
the slowest) and the CPU the endpoint's threads used (ddpmon's server only).

    python benchmarks/slowloris.py                 # 8 pairs of 2,500-step blocks
    python benchmarks/slowloris.py --nofile 1024   # the ranks at a common default limit
    python benchmarks/slowloris.py --compare       # also prometheus_client's threaded server
    python benchmarks/slowloris.py --decoy         # the same attack on a decoy process instead
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.harness import collect, describe, start_ranks, stop  # noqa: E402 (after the path is set)


def interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def one(server: str, pairs: int, block: int, nofile: int | None, decoy: bool) -> dict:
    with tempfile.TemporaryDirectory() as work:
        env = {
            "DDPMON_BENCH_SERVER": server,
            "DDPMON_STATE_DIR": "",
            "DDPMON_BENCH_DECOY": "1" if decoy else "",
        }
        if nofile:
            env["DDPMON_TEST_NOFILE"] = str(nofile)
        procs = start_ranks(
            "bench",
            2,
            Path(work),
            env,
            (str(pairs), str(block)),
            module="tests.distributed.fault_worker",
        )
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        stop(procs)
        results = collect(procs, Path(work))
        if any(r.returncode != 0 for r in results):
            raise SystemExit(describe(results))
        return results[0].result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs", type=int, default=8, help="quiet/attacked block pairs (default 8)"
    )
    parser.add_argument("--block", type=int, default=2500, help="steps per block (default 2500)")
    parser.add_argument(
        "--nofile", type=int, help="the ranks' file-descriptor limit (default: as inherited)"
    )
    parser.add_argument(
        "--compare", action="store_true", help="also run prometheus_client's threaded server"
    )
    parser.add_argument(
        "--decoy",
        action="store_true",
        help="attack a decoy endpoint in a process of its own instead of rank 0's: what the "
        "attack costs the machine (its CPU, the kernel's TCP work), not the rank",
    )
    args = parser.parse_args()
    for server in ("ddpmon", "prometheus_client") if args.compare else ("ddpmon",):
        r = one(server, args.pairs, args.block, args.nofile, args.decoy)
        ratios = [
            statistics.median(attacked) / statistics.median(quiet) for quiet, attacked in r["pairs"]
        ]
        quiet = statistics.median(t for q, _ in r["pairs"] for t in q)
        lo, hi = interval(ratios)
        peaks, scrapes = r["threads_peak"], r["scrapes"]
        cpu = {phase: 100 * used / wall for phase, (used, wall) in r["endpoint_cpu"].items()}
        name = f"{server} (decoy attacked)" if args.decoy else server
        print(
            f"{name:>17}: median step {quiet * 1e3:.2f} ms quiet; attacked x{statistics.median(ratios):.3f} "
            f"(median of {len(ratios)} ABBA pairs, 95% CI {lo:.3f}-{hi:.3f}); threads in the training "
            f"process {peaks['quiet']} quiet, {peaks['slowloris']} attacked; up to {r['attack_opened']:,} "
            f"attacking connections opened in a block; scrapes {scrapes['scrapes']}, {scrapes['failed']} failed, "
            f"slowest {scrapes['slowest_seconds'] * 1e3:.0f} ms; the endpoint's threads used {cpu['quiet']:.1f}% of a "
            f"core quiet, {cpu['slowloris']:.1f}% attacked",
            flush=True,
        )


if __name__ == "__main__":
    main()
