"""``dipaco-plan [overrides]``: print the communication plan of a config.

Per module: the paths that share it, the worker groups that hold it, its parameters and
the bytes it sends per round with the configured codec; and the bytes a data-parallel
(DDP) run of one path's model over the same ranks would send in the same H steps.
Takes the same overrides as ``dipaco-train``, so a plan can be read before launching::

    dipaco-plan grid=4x4 diloco.codec=int8 diloco.inner_steps=100
"""
from __future__ import annotations

import sys
from typing import Optional

from dipaco.build import build_comm_plan
from dipaco.cli.errors import report_user_errors
from dipaco.comm_plan import CommPlan, format_plan
from dipaco.config import Config, compose_config, validate_config


def plan_for(cfg: Config) -> CommPlan:
    """The communication plan of ``cfg`` (no data, no training: module sizes only)."""
    return build_comm_plan(cfg, cfg.launcher.nproc)


def main(argv: Optional[list[str]] = None) -> None:
    """Print the plan for ``argv`` (Hydra-style overrides)."""
    @report_user_errors
    def run(overrides: list[str]) -> None:
        if any(a in ("-h", "--help") for a in overrides):
            print(__doc__)
            return
        cfg = compose_config(overrides)
        validate_config(cfg)
        print(format_plan(plan_for(cfg)))

    run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
