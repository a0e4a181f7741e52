"""The Hydra glue the Hydra CLIs share: typed config + run directory, and a pre-launch check."""
from __future__ import annotations

import shutil
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from dipaco.cli.errors import fail, user_errors
from dipaco.config import Config, to_config, validate_config


def config_from_hydra(cfg: DictConfig) -> Config:
    """The typed config, with ``run_dir`` defaulting to Hydra's output directory."""
    conf = to_config(cfg)
    if conf.run_dir is None:
        conf.run_dir = HydraConfig.get().runtime.output_dir
    return conf


class ValidateBeforeLaunch(Callback):
    """Validate the job's config before a Hydra launcher submits anything.

    With a remote launcher (``launcher=slurm``) the job body, which validates, first runs
    on the cluster after the queue wait; a missing partition or an impossible grid must
    fail here in one line instead. Sweep points are each validated again when they run.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        job = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        with open_dict(job):
            job.run_dir = "<submitted>"  # filled by Hydra per job; not checked here
        try:
            validate_config(to_config(job))
        except user_errors() as e:
            fail(str(e))
        if job.launcher.name == "slurm" and shutil.which("srun") is None:
            # submitit would raise its own traceback for this
            fail("launcher=slurm: no `srun` on PATH; submit from a SLURM login node "
                 "(this machine is not one)")
