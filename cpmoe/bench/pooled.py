"""A RankPool for benchmarks: a rank failure becomes a value, and the next task gets a
fresh world (a failed RankPool never runs again).

Out-of-memory is told apart from other failures, since a benchmark reports it as a result
("does not fit") rather than a bug; other failures print the rank's traceback to stderr.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from cpmoe.bench.timing import is_oom
from cpmoe.parallel.failures import RankFailure
from cpmoe.parallel.launch import RankPool

OOM = "out of memory"


@dataclass(frozen=True)
class Failure:
    error: str  # OOM or "failed"
    detail: str  # one line: what was running and the rank's error


class Pooled:
    def __init__(self, world_size: int, device: str, collective_timeout_s: float = 300.0
                 ) -> None:
        self.world_size, self.device = world_size, device
        self.timeout_s = collective_timeout_s
        self._pool: RankPool | None = None

    @property
    def started(self) -> bool:
        """False until the first task, and again after a failure (the next is a new world)."""
        return self._pool is not None

    def run(self, what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, Failure | None]:
        """-> (rank 0's result, None) or (None, Failure); `what` names the step in errors."""
        try:
            if self._pool is None:
                self._pool = RankPool(self.world_size, self.device,
                                      collective_timeout_s=self.timeout_s)
            return self._pool.run(fn, *args)[0], None
        except Exception as e:  # noqa: BLE001 -- becomes a row; the benchmark goes on
            summary = e.summary if isinstance(e, RankFailure) else f"{type(e).__name__}: {e}"
            oom = is_oom(str(e))
            if not oom:
                traceback.print_exception(e, file=sys.stderr)
            self.close()
            line = (summary.strip().splitlines() or [type(e).__name__])[0]
            return None, Failure(OOM if oom else "failed", f"{what}: {line}")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
