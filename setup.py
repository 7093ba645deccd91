"""The package list, found rather than written by hand: every folder of src/ with an __init__.py
ships (a hand-written list once left out tiersep.separate). The data folders mapped into the
package by pyproject.toml's package-dir are added by name. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=find_packages("src") + ["tiersep.schemas", "tiersep.presets", "tiersep.captions"])
