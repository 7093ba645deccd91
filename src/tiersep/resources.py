"""Where tiersep finds the files it reads besides its code (schemas, shipped presets, captions), and
the module of its own command.

In a source checkout (and an editable install) they live where the workflow's users expect them:
workflow/schemas, config/presets and workflow/report. A wheel (`pip install .`) carries the same
files inside the package, as tiersep/schemas, tiersep/presets and tiersep/captions (pyproject's
package-dir mapping), so an install works from any directory.
"""
from __future__ import annotations

import functools
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_DIRS = {"schemas": "workflow/schemas", "presets": "config/presets", "captions": "workflow/report"}


def resource_dir(kind: str) -> Path:
    """The folder of `kind` (schemas, presets, captions): the installed copy, else the checkout's."""
    installed = PACKAGE_DIR / kind
    if installed.is_dir():
        return installed
    return PACKAGE_DIR.parents[1] / CHECKOUT_DIRS[kind]


@functools.cache
def command_module() -> str:
    """The module of the `tiersep` command: its console script, as the installed package's metadata
    declares it. Processes that start the command again (torchrun's ranks) or import what it
    imports (the CPU booking's probe) find it here rather than name it, so that no layer names a
    module of the one above it (tests/test_architecture.py). RuntimeError where tiersep is not
    installed (pip install -e .)."""
    from importlib.metadata import entry_points

    found = list(entry_points(group="console_scripts", name="tiersep"))
    if not found:
        raise RuntimeError("tiersep is not installed (pip install -e .): the `tiersep` command's module "
                           "is not declared")
    return found[0].module
