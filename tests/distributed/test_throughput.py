"""Samples, tokens and FLOPs per second on a real 2-rank gloo DDP job, against figures the
test computes by hand: a model of Linear layers, whose matmuls are 2 x batch x in x out
FLOPs forward and as many again for each gradient backward (the weight's in every layer,
the input's in every layer but the first: the batch needs none), and a small language model
fed token ids. The FLOP count runs on one real step and must leave the training bit for bit
as it was, and nothing of the counter behind.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ddpmon.report.run import load
from ddpmon.report.summary import end_of_run, summarize
from tests.distributed.throughput_worker import (
    LAYERS,
    LENGTH,
    MICRO,
    SEQUENCES,
    STEPS,
    VOCAB,
    WIDTH,
)
from tests.support import harness

pytestmark = pytest.mark.timeout(180)

MICRO_STEPS = 2


def mlp_flops_per_step() -> int:
    forward = sum(2 * MICRO * n_in * n_out for n_in, n_out in LAYERS)
    weight_grads = forward
    input_grads = sum(2 * MICRO * n_in * n_out for n_in, n_out in LAYERS[1:])
    return MICRO_STEPS * (forward + weight_grads + input_grads)


def lm_flops_per_step() -> int:
    tokens = SEQUENCES * LENGTH
    return 3 * 2 * tokens * WIDTH * VOCAB  # the head's matmul; its input and weight gradients


def metric(text: str, name: str) -> float | None:
    found = re.search(rf'^{name}{{job="\w+",rank="\d"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[harness.RankResult], Path]:
    workdir = tmp_path_factory.mktemp("throughput")
    results = harness.run_ranks(
        "flops", 2, workdir, timeout=150, module="tests.distributed.throughput_worker"
    )
    return results, workdir


def test_the_flop_count_is_the_hand_computed_figure_and_leaves_training_as_it_was(job: Any) -> None:
    results, _ = job
    for r in results:
        out = r.result
        t = out["throughput"]
        assert not out["errors"], out["errors"]
        count = t["flop_count"]
        assert count is not None, r.stderr[-3000:]
        assert (count["per_step"], count["step"]) == (mlp_flops_per_step(), out["count_step"])
        assert (count["dtype"], count["device_name"], count["peak_flops_per_second"]) == (
            "float32",
            None,
            None,
        )
        # Every step, the counted one included, bit for bit as without ddpmon.
        assert out["same"] == [True] * STEPS
        # The counter is gone once its step ended: no dispatch mode, no global module hook.
        assert out["dispatch_modes"] == [0] * STEPS and out["global_hooks_added"] == 0


def test_achieved_flops_and_samples_per_second_are_the_hand_figures_over_the_step_time(
    job: Any,
) -> None:
    results, _ = job
    for r in results:
        out = r.result
        t = out["throughput"]
        # The loop's own clock, over the steps ddpmon's figure covers (all but the counted one).
        seconds = [s for step, s in enumerate(out["loop_seconds"], 1) if step != out["count_step"]]
        loop_step = sum(seconds) / len(seconds)
        assert t["window_steps"] == STEPS - 1
        assert t["achieved_flops_per_second"] == pytest.approx(
            mlp_flops_per_step() / loop_step, rel=0.10
        )
        assert t["samples_per_second"] == pytest.approx(MICRO_STEPS * MICRO / loop_step, rel=0.10)
        assert t["samples_total"] == STEPS * MICRO_STEPS * MICRO
        assert (
            t["tokens_total"] == 0 and t["tokens_per_second"] is None
        )  # float inputs hold no tokens
        assert t["mfu"] is None  # a CPU has no peak
        text = out["metrics"]
        assert metric(text, "ddpmon_samples_total") == STEPS * MICRO_STEPS * MICRO
        assert metric(text, "ddpmon_model_flops_per_step") == mlp_flops_per_step()
        assert metric(text, "ddpmon_achieved_flops_per_second") == pytest.approx(
            t["achieved_flops_per_second"]
        )
        assert (
            metric(text, "ddpmon_mfu_ratio") is None and metric(text, "ddpmon_tokens_total") is None
        )


def test_token_ids_count_tokens(job: Any) -> None:
    results, _ = job
    for r in results:
        lm = r.result["lm"]
        assert lm["samples_total"] == 8 * SEQUENCES and lm["tokens_total"] == 8 * SEQUENCES * LENGTH
        assert lm["tokens_per_second"] == pytest.approx(LENGTH * lm["samples_per_second"])
        assert lm["flop_count"]["per_step"] == lm_flops_per_step()
        assert metric(r.result["lm_metrics"], "ddpmon_tokens_total") == 8 * SEQUENCES * LENGTH


def test_the_report_gives_each_rank_s_figures_and_the_job_s_sums(job: Any) -> None:
    results, _ = job
    state_dir = results[0].result["state_dir"]
    s = summarize(load([state_dir]))
    per_rank = {r["rank"]: r for r in s["per_rank"]}
    for r in results:
        mine = per_rank[r.rank]
        assert mine["flops_per_step"] == mlp_flops_per_step()
        assert mine["mfu"] is None and mine["achieved_flops_per_second"] > 0
    job_rates = s["throughput"]
    assert job_rates["samples_per_second"] == pytest.approx(
        sum(r["samples_per_second"] for r in per_rank.values())
    )
    assert job_rates["achieved_flops_per_second"] == pytest.approx(
        sum(r["achieved_flops_per_second"] for r in per_rank.values())
    )
    assert job_rates["mfu"] is None
    assert "samples/s" in end_of_run(state_dir) and "MFU unknown" in end_of_run(state_dir)
