"""How a rank's failure travels to the parent and reads there: `RankFailure` (one summary
line, the rank's traceback, the rank's own exception when it pickles), `report_failure` (the
rank's side: send it and leave), `peer_loss` (a collective that failed only because another
rank went away, whose own log holds the root error)."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch.distributed as dist


class RankFailure(RuntimeError):
    """A rank raised or died; ``str()`` is one summary line followed by the rank's traceback.
    ``error``: the exception the rank raised, when it could be pickled back (so a caller can
    tell a user error, e.g. a bad checkpoint, from a bug by its type), else None."""

    def __init__(self, rank: int, summary: str, remote_traceback: str | None = None,
                 error: BaseException | None = None) -> None:
        super().__init__(f"{summary}\n{remote_traceback.rstrip()}" if remote_traceback else summary)
        self.rank, self.summary, self.remote_traceback = rank, summary, remote_traceback
        self.error = error

    def __reduce__(self) -> tuple[Any, ...]:  # default pickling replays args: wrong signature
        return (RankFailure, (self.rank, self.summary, self.remote_traceback, self.error))


def report_failure(conn: Connection, err: BaseException) -> NoReturn:
    """Report err to the parent, then leave without interpreter teardown."""
    try:
        conn.send(("error", headline(err), "".join(traceback.format_exception(err)),
                   time.monotonic(), _pickled(err)))
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a broken stream must not mask the error
                stream.flush()
        os._exit(1)  # destructors of a group whose peers are mid-collective could block


# How a peer's death reads in this rank's collectives (gloo's tcp transport, NCCL's
# DistBackendError): the peer's own log holds the root error, this one adds nothing.
_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Connection refused", "NCCL communicator was aborted")


def peer_loss(err: BaseException | None) -> str | None:
    """How a collective failed because another rank went away ("Connection reset by peer"),
    or None when `err` is not that."""
    backend_error = getattr(dist, "DistBackendError", ())
    if not isinstance(err, RuntimeError) or not (isinstance(err, backend_error)
                                                 or "gloo" in str(err)):
        return None
    return next((text for text in _PEER_LOSS if text in str(err)), None)


def headline(err: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def failure(rank: int, err: BaseException) -> RankFailure:
    return RankFailure(rank, f"rank {rank} failed: {headline(err)}",
                       "".join(traceback.format_exception(err)), err)


def _pickled(err: BaseException) -> bytes | None:
    try:
        return pickle.dumps(err, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001  (an unpicklable error still reports its traceback)
        return None


def unpickled(raw: bytes | None) -> BaseException | None:
    try:
        return None if raw is None else pickle.loads(raw)
    except Exception:  # noqa: BLE001  (e.g. a class the parent cannot import)
        return None
