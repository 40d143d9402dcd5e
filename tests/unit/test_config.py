from __future__ import annotations

import dataclasses
import os
import re
import tempfile

import pytest

from ddpmon.config import Config, Options
from ddpmon.errors import ConfigError


def test_explicit_argument_wins_over_environment() -> None:
    cfg = Config.from_env({"DDPMON_PORT": "9700", "DDPMON_JOB": "env-job"}, port=9800)
    assert cfg.port == 9800 and cfg.job == "env-job"


def test_environment_values_are_parsed() -> None:
    cfg = Config.from_env(
        {
            "DDPMON_HANG_TIMEOUT": "12.5",
            "DDPMON_NVML": "off",
            "DDPMON_STATE_DIR": "/x",
            "DDPMON_BUCKET_METRICS": "aggregate",
            "DDPMON_COMM_HOOK": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
        }
    )
    assert cfg.hang_timeout == 12.5 and cfg.nvml is False and cfg.state_dir == "/x"
    assert cfg.bucket_metrics == "aggregate"
    assert cfg.comm_hook.__name__ == "fp16_compress_hook"


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"DDPMON_PORT": "nine"}, "DDPMON_PORT='nine'"),
        ({"DDPMON_NVML": "maybe"}, "DDPMON_NVML='maybe'"),
        ({"DDPMON_HANG_TIMEOUT": "-1"}, "hang_timeout=-1.0"),
        ({"DDPMON_BUCKET_METRICS": "some"}, "per_bucket or aggregate or off"),
        ({"DDPMON_COMM_HOOK": "no_such_module.hook"}, "DDPMON_COMM_HOOK='no_such_module.hook'"),
        ({"DDPMON_PORT": "70000"}, "up to 65535"),
    ],
)
def test_bad_values_name_the_variable_and_what_is_expected(env: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    assert fragment in str(err.value)


def test_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_env({}, hang_timout=3)
    assert "hang_timout" in str(err.value) and "hang_timeout" in str(err.value)


def test_job_and_state_dir_defaults() -> None:
    cfg = Config.from_env({})
    assert cfg.resolved_job({"TORCHELASTIC_RUN_ID": "run42"}) == "run42"
    # without torchrun's run id: unique per launch, the same for every call in one process
    default = cfg.resolved_job({"MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    assert re.fullmatch(r"ddp-[0-9a-f]{8}", default) and cfg.resolved_job({}) == default
    assert cfg.resolved_state_dir("node1:29500") == os.path.join(
        tempfile.gettempdir(), f"ddpmon-{os.geteuid()}", "node1_29500"
    )
    assert os.path.basename(cfg.resolved_state_dir("..")) == "_."
    assert os.path.basename(cfg.resolved_state_dir("../../etc")) == "_._.._etc"
    assert Config.from_env({}, state_dir="").resolved_state_dir("x") is None


@pytest.mark.parametrize(
    "option,value",
    [
        ("bucket_timing", "false"),
        ("nvml", "0"),
        ("track_collectives", 1),
        ("unused_parameters_advice_steps", "10"),
    ],
)
def test_options_of_the_wrong_type_are_errors_not_truthy(option: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_env({}, **{option: value})
    assert f"{option}={value!r}" in str(err.value)


def test_bucket_timing_names_its_source_and_keeps_the_boolean_spelling() -> None:
    assert Config.from_env({}).bucket_timing == "auto"
    assert Config.from_env({}, bucket_timing=True).bucket_timing == "auto"
    assert Config.from_env({}, bucket_timing=False).bucket_timing == "off"
    assert Config.from_env({"DDPMON_BUCKET_TIMING": "C10D"}).bucket_timing == "c10d"
    assert (
        Config.from_env({"DDPMON_BUCKET_TIMING": "flight_recorder"}).bucket_timing
        == "flight_recorder"
    )
    assert Config.from_env({"DDPMON_BUCKET_TIMING": "0"}).bucket_timing == "off"
    assert (
        Config.from_env({"DDPMON_BUCKET_TIMING": "hook"}, bucket_timing="off").bucket_timing
        == "off"
    )
    with pytest.raises(ConfigError) as err:
        Config.from_env({"DDPMON_BUCKET_TIMING": "nccl"})
    assert "DDPMON_BUCKET_TIMING='nccl'" in str(
        err.value
    ) and "auto, hook, c10d, flight_recorder, off" in str(err.value)
    with pytest.raises(ConfigError) as err:
        Config.from_env({}, bucket_timing="events")
    assert "auto or hook or c10d or flight_recorder or off" in str(err.value)


def test_hang_action_is_report_unless_abort_is_asked_for() -> None:
    assert Config.from_env({}).hang_action == "report"
    assert Config.from_env({"DDPMON_HANG_ACTION": " Abort "}).hang_action == "abort"
    assert (
        Config.from_env({"DDPMON_HANG_ACTION": "abort"}, hang_action="report").hang_action
        == "report"
    )
    with pytest.raises(ConfigError, match="DDPMON_HANG_ACTION='kill'.*report or abort"):
        Config.from_env({"DDPMON_HANG_ACTION": "kill"})
    with pytest.raises(ConfigError, match="hang_action='restart'"):
        Config.from_env({}, hang_action="restart")


def test_attachs_typed_options_are_configs_fields() -> None:
    """``attach(**options)`` is typed by ``Options``: a field added to Config and not there
    would be an option that type checkers reject."""
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    typed = {name: getattr(t, "__forward_arg__", t) for name, t in Options.__annotations__.items()}
    assert typed == fields
    assert not Options.__required_keys__
