"""Where tiersep finds the files it reads besides its code: schemas, shipped presets, captions.

In a source checkout (and an editable install) they live where the workflow's users expect them:
workflow/schemas, config/presets and workflow/report. A wheel (`pip install .`) carries the same
files inside the package, as tiersep/schemas, tiersep/presets and tiersep/captions (pyproject's
package-dir mapping), so an install works from any directory.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_DIRS = {"schemas": "workflow/schemas", "presets": "config/presets", "captions": "workflow/report"}


def resource_dir(kind: str) -> Path:
    """The folder of `kind` (schemas, presets, captions): the installed copy, else the checkout's."""
    installed = PACKAGE_DIR / kind
    if installed.is_dir():
        return installed
    return PACKAGE_DIR.parents[1] / CHECKOUT_DIRS[kind]
