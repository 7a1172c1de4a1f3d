"""A torch profiler window over engine steps: `POST /start_profile` and `/stop_profile`.

SGLang's endpoints, same fields: a start command (output folder, `num_steps`, activities,
shapes, stacks) reaches rank 0's driver through its frontend and rides the next `StepPlan`
to every rank, so all ranks open the window before the same step. It closes after
`num_steps` steps that ran the model (idle ticks and bookkeeping-only steps are recorded
but not counted; every rank counts the same broadcast plans, so every rank closes at the
same step), on a stop command, or when the loop ends. Each step inside runs under a
`record_function` named "cpmoe step N <kind>", so a trace shows where each step begins and
ends on the host.

Each rank then writes, in the output folder:
- `<name>-rank<r>.trace.json.gz`: the Chrome / Perfetto trace (host ops, and with "GPU"
  the CUDA kernels and copies);
- `<name>-rank<r>.txt`: the ops table (`key_averages`), by device time when the GPU was
  recorded, else by host time.
`name` is rank 0's time stamp of the start command, the same on every rank.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ACTIVITIES = ("CPU", "GPU")
DEFAULT_DIR = "/tmp/cpmoe-profile"  # CPMOE_TORCH_PROFILER_DIR overrides it (serve reads it)


@dataclass(frozen=True)
class ProfileCommand:
    """start=True: open a window (closing one that is open first); False: close it."""

    start: bool
    output_dir: str = DEFAULT_DIR
    num_steps: int | None = None  # None: until a stop command or the loop's end
    activities: tuple[str, ...] = ACTIVITIES
    record_shapes: bool = False
    with_stack: bool = False
    name: str = ""

    @classmethod
    def starting(cls, output_dir: str, num_steps: int | None = None,
                 activities: tuple[str, ...] = ACTIVITIES, record_shapes: bool = False,
                 with_stack: bool = False) -> ProfileCommand:
        """A start command named by the time now (rank 0, when the request arrives)."""
        bad = [a for a in activities if a not in ACTIVITIES]
        if bad or not activities:
            raise ValueError(f"activities: expected a non-empty list of {list(ACTIVITIES)}, "
                             f"got {list(activities)}")
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps: expected a positive number of steps, got {num_steps}")
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 10**9 // 10**6:03d}"
        return cls(True, output_dir, num_steps, tuple(activities), record_shapes, with_stack,
                   f"cpmoe-{stamp}")


class StepProfiler:
    """One rank's profiler window; `apply` each plan's command, wrap each step in `step`."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self._prof: profile | None = None
        self._cmd: ProfileCommand | None = None
        self._steps = 0
        self._on_device = False

    @property
    def active(self) -> bool:
        return self._prof is not None

    def apply(self, cmd: ProfileCommand | None) -> None:
        if cmd is None:
            return
        self.close()
        if not cmd.start:
            return
        Path(cmd.output_dir).mkdir(parents=True, exist_ok=True)
        acts = [ProfilerActivity.CPU]
        if "GPU" in cmd.activities and self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        if "CPU" not in cmd.activities and len(acts) > 1:
            acts = acts[1:]
        self._cmd, self._steps = cmd, 0
        self._on_device = ProfilerActivity.CUDA in acts
        self._prof = profile(activities=acts, record_shapes=cmd.record_shapes,
                             with_stack=cmd.with_stack)
        self._prof.start()

    def step(self, number: int, kind: str, counted: bool):
        """Context of one step: a named range inside an open window (else nothing); a
        counted step (one that ran the model) that fills `num_steps` closes the window."""
        if self._prof is None:
            return contextlib.nullcontext()
        return self._recorded(number, kind, counted)

    @contextlib.contextmanager
    def _recorded(self, number: int, kind: str, counted: bool):
        with record_function(f"cpmoe step {number} {kind}"):
            yield
        self._steps += counted
        assert self._cmd is not None
        if self._cmd.num_steps is not None and self._steps >= self._cmd.num_steps:
            self.close()

    def discard(self) -> None:
        """Stop the open window without writing it (the step failed: a device sync could
        hang, and the process may run another task with a profiler of its own)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            with contextlib.suppress(Exception):
                prof.stop()

    def close(self) -> None:
        """Stop the open window, if any, and write its trace and table."""
        if self._prof is None:
            return
        prof, cmd, self._prof = self._prof, self._cmd, None
        assert cmd is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's last kernels into the trace
        prof.stop()
        stem = Path(cmd.output_dir) / f"{cmd.name}-rank{self.rank}"
        trace = stem.with_name(stem.name + ".trace.json.gz")
        prof.export_chrome_trace(str(trace))
        sort = "self_device_time_total" if self._on_device else "self_cpu_time_total"
        stem.with_name(stem.name + ".txt").write_text(
            f"{self._steps} steps\n" + prof.key_averages().table(sort_by=sort, row_limit=60))
        if self.rank == 0:
            print(f"cpmoe: profile of {self._steps} steps written to {trace} (and .txt; one "
                  f"per rank)", file=sys.stderr, flush=True)
