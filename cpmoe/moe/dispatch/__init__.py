"""MoE token dispatch: the interface (base.py), its backends (local.py: none, alltoall.py,
padded.py: alltoall_padded) and the factory that picks one by `--moe-a2a-backend`."""

from __future__ import annotations

import importlib.util

from cpmoe.moe.dispatch.alltoall import AllToAllDispatcher
from cpmoe.moe.dispatch.base import Dispatcher
from cpmoe.moe.dispatch.local import LocalDispatcher
from cpmoe.moe.dispatch.padded import PaddedAllToAllDispatcher
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import LayoutError


class MissingBackendError(LayoutError):
    """A --moe-a2a-backend this process cannot run (a layout it cannot serve)."""


# external backends -> the Python package each needs
EXTERNAL_PACKAGES = {"deepep": "deep_ep", "mori": "mori"}


def create_dispatcher(name: str, groups: ProcessGroups, num_experts: int) -> Dispatcher:
    if name == "none":
        return LocalDispatcher(groups, num_experts)
    if name == "alltoall":
        return AllToAllDispatcher(groups, num_experts)
    if name == "alltoall_padded":
        return PaddedAllToAllDispatcher(groups, num_experts)
    if name in EXTERNAL_PACKAGES:
        check_backend_available(name)
        raise MissingBackendError(f"--moe-a2a-backend {name}: package "
                                  f"{EXTERNAL_PACKAGES[name]!r} is installed but cpmoe has no "
                                  f"adapter for it yet; use 'alltoall'")
    raise MissingBackendError(f"--moe-a2a-backend {name!r} is unknown")


def check_backend_available(name: str) -> None:
    """Fail early (before spawning ranks) when an external backend's package is missing."""
    module = EXTERNAL_PACKAGES.get(name)
    if module and importlib.util.find_spec(module) is None:
        raise MissingBackendError(f"--moe-a2a-backend {name} needs the Python package "
                                  f"{module!r}, which is not installed")
