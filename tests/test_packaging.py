"""setup.cfg lists every package folder (setuptools installs only what is listed).

A folder with an ``__init__.py`` under dipaco/, modules/, router/, hydra_plugins/ or conf/ that is not in
``[options] packages`` would work in the editable checkout and be missing from a wheel.
"""
from __future__ import annotations

import configparser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def listed_packages() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return {line.strip() for line in cfg["options"]["packages"].splitlines() if line.strip()}


def package_folders() -> set[str]:
    found = set()
    for top in ("dipaco", "modules", "router", "hydra_plugins"):  # hydra_plugins: a namespace (no __init__)
        for init in (REPO / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(REPO).parts))
    if (REPO / "conf" / "__init__.py").exists():
        found.add("dipaco.conf")  # installed under dipaco/ through package_dir
    return found


def test_every_package_folder_is_listed() -> None:
    folders, listed = package_folders(), listed_packages()
    assert folders - listed == set(), f"add to setup.cfg [options] packages: {sorted(folders - listed)}"
    assert listed - folders == set(), f"listed but not a package folder: {sorted(listed - folders)}"
