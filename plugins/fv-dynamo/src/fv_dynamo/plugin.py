"""fv-dynamo's pluggy hook: the ``fv dynamo-worker`` command (Dynamo is imported only when it runs)."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl


@hookimpl
def fv_register_commands(register: Callable[..., None]) -> None:
    register("dynamo-worker", "fv_dynamo.cli:add_worker_parser")
