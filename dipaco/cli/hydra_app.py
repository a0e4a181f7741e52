"""The Hydra glue the Hydra CLIs share: typed config + run directory, and a pre-launch check."""
from __future__ import annotations

import shutil
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from dipaco.cli.errors import fail, user_errors
from dipaco.config import Config, resolve_tokenizer_vocab, to_config, validate_config


def config_from_hydra(cfg: DictConfig) -> Config:
    """The typed config, with ``run_dir`` defaulting to Hydra's output directory.

    With ``data.tokenizer`` set, ``model.vocab_size`` comes from that tokenizer unless
    given on the command line (then ``validate_config`` refuses a size too small for it).
    """
    conf = to_config(cfg)
    hydra = HydraConfig.get()
    if conf.run_dir is None:
        conf.run_dir = hydra.runtime.output_dir
    return resolve_tokenizer_vocab(conf, hydra.overrides.task)


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
            validate_config(resolve_tokenizer_vocab(to_config(job), config.hydra.overrides.task))
        except user_errors() as e:
            fail(str(e))
        if job.launcher.name == "slurm" and shutil.which("srun") is None:
            # submitit would raise its own traceback for this
            fail("launcher=slurm: no `srun` on PATH; submit from a SLURM login node "
                 "(this machine is not one)")
