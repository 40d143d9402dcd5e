"""Step time of a training job while a client holds 250 half-open connections to its
metrics endpoint (a slowloris), with ddpmon's bounded endpoint and, for comparison, with
prometheus_client's thread-per-connection server.

A 2-rank gloo job (tests/distributed/fault_worker.py, mode ``bench``) trains in blocks
that alternate, in ABBA order, quiet and with rank 0's endpoint under attack (every
connection the server drops is reopened; the attacker runs at nice 19 so that its own CPU
is not what is measured). Printed per server: rank 0's median step time, the median over
block pairs of (attacked / quiet) with a 95% bootstrap interval, and the peak thread count
of the training process.

    python benchmarks/slowloris.py                # 8 pairs of 60-step blocks per server
    python benchmarks/slowloris.py --pairs 16 --block 100
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

from tests.support.harness import collect, describe, start_ranks, stop


def interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def one(server: str, pairs: int, block: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        env = {"DDPMON_BENCH_SERVER": server, "DDPMON_STATE_DIR": ""}
        procs = start_ranks("bench", 2, Path(work), env, (str(pairs), str(block)),
                            module="tests.distributed.fault_worker")
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        stop(procs)
        results = collect(procs, Path(work))
        if any(r.returncode != 0 for r in results):
            raise SystemExit(describe(results))
        return results[0].result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="quiet/attacked block pairs (default 8)")
    parser.add_argument("--block", type=int, default=60, help="steps per block (default 60)")
    args = parser.parse_args()
    for server in ("ddpmon", "prometheus_client"):
        r = one(server, args.pairs, args.block)
        ratios = [statistics.median(attacked) / statistics.median(quiet) for quiet, attacked in r["pairs"]]
        quiet = statistics.median(t for q, _ in r["pairs"] for t in q)
        lo, hi = interval(ratios)
        peaks = r["threads_peak"]
        print(f"{server:>17}: median step {quiet * 1e3:.2f} ms quiet; under {r['attack_opened']} half-open "
              f"connections x{statistics.median(ratios):.3f} (median of {len(ratios)} ABBA pairs, 95% CI "
              f"{lo:.3f}-{hi:.3f}); threads in the training process {peaks['quiet']} quiet, "
              f"{peaks['slowloris']} under attack", flush=True)


if __name__ == "__main__":
    main()
