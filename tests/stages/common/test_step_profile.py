"""The training stages' `profile` setting (stages/common/step_profile.py): a window of optimizer
steps runs under torch.profiler and leaves an operator table and a chrome trace; outside the
window, off rank 0 or without the setting nothing is profiled or written; nonsense windows are
refused naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from stages.common.step_profile import ProfileSettings, StepProfiler
from stages.sft.config import SFTConfig


def _train(profiler: StepProfiler, steps: int) -> list:
    """A tiny training loop calling the profiler as the sft stage does; the paths `after` returned."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    written = []
    for step in range(1, steps + 1):
        profiler.before(step)
        with torch.profiler.record_function(f"train_step_{step}"):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        written.append(profiler.after(step, last=step == steps))
    return written


def test_the_window_writes_a_table_sorted_by_time_and_a_trace_of_its_steps_only(tmp_path):
    profiler = StepProfiler(ProfileSettings(start_step=2, steps=2), tmp_path / "profile", active=True)
    written = _train(profiler, 5)
    assert written == [None, None, profiler.table_path, None, None]
    table = profiler.table_path.read_text()
    assert table.startswith("torch.profiler: optimizer steps 2..3 of rank 0, sorted by self_cpu_time_total")
    assert "aten::addmm" in table
    events = {e["name"] for e in json.loads(profiler.trace_path.read_text())["traceEvents"] if "name" in e}
    assert {"train_step_2", "train_step_3"} <= events
    assert not events & {"train_step_1", "train_step_4", "train_step_5"}


def test_a_run_that_ends_inside_the_window_still_writes_it(tmp_path):
    profiler = StepProfiler(ProfileSettings(start_step=3, steps=10), tmp_path, active=True)
    assert _train(profiler, 4)[-1] == profiler.table_path
    assert "optimizer steps 3..4" in profiler.table_path.read_text()


@pytest.mark.parametrize("settings,active", [(None, True), (ProfileSettings(start_step=1), False)])
def test_without_the_setting_or_off_rank_0_nothing_is_written(tmp_path, settings, active):
    assert _train(StepProfiler(settings, tmp_path / "profile", active=active), 2) == [None, None]
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("profile,field,problem", [
    ({"start_step": 0}, "start_step", "greater than or equal to 1"),
    ({"start_step": -3, "steps": 1}, "start_step", "greater than or equal to 1"),
    ({"start_step": 2, "steps": 0}, "steps", "greater than or equal to 1"),
    ({"start_step": 2, "steps": 500}, "steps", "less than or equal to 50"),
    ({"start_step": "soon"}, "start_step", "valid integer"),
    ({"steps": 2}, "start_step", "Field required"),
    ({"start_step": 2, "step": 2}, "step", "Extra inputs are not permitted")])
def test_nonsense_windows_are_refused_naming_the_field(profile, field, problem):
    with pytest.raises(ValidationError) as err:
        SFTConfig.model_validate({"model": "m", "data": "d", "profile": profile})
    assert err.value.errors()[0]["loc"] == ("profile", field) and problem in str(err.value)


def test_a_window_after_max_steps_is_refused():
    with pytest.raises(ValidationError, match=r"profile.start_step \(9\) is after max_steps \(8\)"):
        SFTConfig.model_validate({"model": "m", "data": "d", "max_steps": 8, "warmup_steps": 1,
                                  "profile": {"start_step": 9}})
    assert SFTConfig.model_validate({"model": "m", "data": "d", "max_steps": 8, "warmup_steps": 1,
                                     "profile": {"start_step": 8, "steps": 5}}).profile.start_step == 8


def test_the_setting_leaves_the_result_config_alone():
    from pipeline.plan import result_config

    plain = SFTConfig.model_validate({"model": "m", "data": "d"})
    profiled = SFTConfig.model_validate({"model": "m", "data": "d", "profile": {"start_step": 3, "steps": 2}})
    assert "profile" not in result_config(profiled) and result_config(profiled) == result_config(plain)
