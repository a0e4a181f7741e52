"""The Hydra glue the Hydra CLIs share: typed config + run directory, and a pre-launch check."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from dipaco.cli.errors import fail, user_errors
from dipaco.config import Config, resolve_tokenizer_vocab, to_config
from dipaco.slurm import dry_run_text
from dipaco.validate import validate_config

# Written by Hydra into the run directory before any dipaco code runs; on an existing
# run they are switched off, so a refused command leaves the directory byte-identical.
_QUIET_HYDRA = ("hydra.output_subdir=null", "hydra/job_logging=none")


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


def command_line_overrides() -> list[str]:
    """The overrides the user typed (``model=tiny``, ``+trainer.x=1``), not Hydra's own."""
    return list(HydraConfig.get().overrides.task)


def register_launcher() -> None:
    """Make ``launcher=slurm``'s Hydra launcher (``hydra_plugins.dipaco_slurm``) known to Hydra.

    Hydra finds plugins by walking the ``hydra_plugins`` namespace with ``pkgutil``, which
    cannot list a package that an editable install (``pip install -e .``) serves through
    an import hook; registering the class by hand works for every kind of install.
    """
    try:
        from hydra_plugins.dipaco_slurm.launcher import DipacoSlurmLauncher  # the optional slurm extra
    except ImportError:  # hydra-submitit-launcher missing: launcher=slurm says so when used
        return
    Plugins.instance().register(DipacoSlurmLauncher)


def protect_run_dir(argv: list[str]) -> list[str]:
    """The command line to hand to Hydra: ``--debug`` taken out (it sets DIPACO_DEBUG,
    keeping tracebacks), and Hydra's own files (``.hydra/``, ``<job>.log``) switched off
    when ``hydra.run.dir`` already holds a run, so nothing there is touched before
    dipaco's checks have passed."""
    if "--debug" in argv:
        os.environ["DIPACO_DEBUG"] = "1"
        argv = [a for a in argv if a != "--debug"]
    if "-m" in argv or "--multirun" in argv:
        return argv
    run_dirs = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    if run_dirs and (Path(run_dirs[-1]).expanduser() / "config.yaml").is_file():
        given = {a.split("=", 1)[0] for a in argv}
        argv = argv + [q for q in _QUIET_HYDRA if q.split("=", 1)[0] not in given]
    return argv


def print_dry_run(conf: Config, config: DictConfig) -> None:
    """``launcher.dry_run=true``: the job script and each task's environment, on stdout."""
    la = conf.launcher
    print(dry_run_text(OmegaConf.to_container(config.hydra.launcher, resolve=True), nodes=la.nodes,
                       nproc=la.nproc, threads=conf.trainer.threads or la.cpus_per_task,
                       master_port=la.master_port, max_requeues=la.max_requeues,
                       overrides=[o for o in config.hydra.overrides.task if not o.startswith("launcher.dry_run")]))


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
            conf = resolve_tokenizer_vocab(to_config(job), config.hydra.overrides.task)
            validate_config(conf)
        except user_errors() as e:
            fail(str(e))
        if conf.launcher.name == "slurm" and conf.launcher.dry_run:
            print_dry_run(conf, config)
            raise SystemExit(0)  # before the sweeper writes anything
        if job.launcher.name == "slurm" and shutil.which("srun") is None:
            # submitit would raise its own traceback for this
            fail("launcher=slurm: no `srun` on PATH; submit from a SLURM login node "
                 "(this machine is not one)")
