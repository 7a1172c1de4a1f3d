"""engine/profiler.py on CPU: which steps a window records and counts, when it writes its
files, and that a discarded window writes nothing and leaves the profiler free."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from cpmoe.engine.profiler import ProfileCommand, StepProfiler


def _step(prof: StepProfiler, n: int, kind: str) -> None:
    with prof.step(n, kind, counted=kind != "idle"):
        torch.ones(8, 8) @ torch.ones(8, 8)


def _names(path) -> list[str]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return [e["name"] for e in events if e.get("name", "").startswith("cpmoe step ")]


def test_a_window_counts_model_steps_only_and_writes_when_full(tmp_path):
    prof = StepProfiler(0, torch.device("cpu"))
    cmd = ProfileCommand.starting(str(tmp_path), num_steps=2)
    prof.apply(cmd)
    for n, kind in enumerate(["idle", "prefill", "idle", "decode", "decode"]):
        _step(prof, n, kind)
    assert not prof.active  # closed after the second counted step
    trace = tmp_path / f"{cmd.name}-rank0.trace.json.gz"
    assert _names(trace) == ["cpmoe step 0 idle", "cpmoe step 1 prefill", "cpmoe step 2 idle",
                             "cpmoe step 3 decode"]
    assert (tmp_path / f"{cmd.name}-rank0.txt").read_text().startswith("2 steps\n")


def test_a_new_start_writes_the_open_window_and_a_stop_closes(tmp_path):
    prof = StepProfiler(1, torch.device("cpu"))
    first = ProfileCommand.starting(str(tmp_path / "a"))
    prof.apply(first)
    _step(prof, 0, "prefill")
    second = ProfileCommand.starting(str(tmp_path / "b"))
    prof.apply(second)
    assert (tmp_path / "a" / f"{first.name}-rank1.txt").read_text().startswith("1 steps")
    _step(prof, 1, "decode")
    prof.apply(ProfileCommand(start=False))
    assert not prof.active
    assert _names(tmp_path / "b" / f"{second.name}-rank1.trace.json.gz") == [
        "cpmoe step 1 decode"]
    prof.apply(None)  # no command: nothing happens
    prof.close()


def test_a_discarded_window_writes_nothing_and_the_next_one_works(tmp_path):
    prof = StepProfiler(0, torch.device("cpu"))
    prof.apply(ProfileCommand.starting(str(tmp_path / "lost")))
    _step(prof, 0, "prefill")
    prof.discard()
    assert not any((tmp_path / "lost").iterdir())
    cmd = ProfileCommand.starting(str(tmp_path / "next"), num_steps=1)
    prof.apply(cmd)
    _step(prof, 1, "prefill")
    assert (tmp_path / "next" / f"{cmd.name}-rank0.trace.json.gz").exists()


@pytest.mark.parametrize("kwargs,field", [({"num_steps": 0}, "num_steps"),
                                          ({"activities": ("TPU",)}, "activities"),
                                          ({"activities": ()}, "activities")])
def test_bad_start_commands_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ProfileCommand.starting("/tmp/unused", **kwargs)
