"""fv-ray-serve's pluggy hook: the ``ray`` fleet that ``fv serve --ray`` runs (imported only when it runs)."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl


@hookimpl
def fv_register_fleets(register: Callable[..., None]) -> None:
    register("ray", "fv_ray_serve.run:run_fleet")
