"""The Hydra glue the Hydra CLIs share: typed config + run directory, and a pre-launch check."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from dipaco.cli import sweep_dir as _sweep_dir  # noqa: F401  (registers the job-folder resolver)
from dipaco.cli.errors import fail, user_errors
from dipaco.cli.help import usage, wants_help
from dipaco.config import Config, compose_config, to_config
from dipaco.config.paths import pin_argument, pin_paths
from dipaco.run.path_guard import check_run_root
from dipaco.runtime.progress import say
from dipaco.runtime.slurm import dry_run_text, submission_warnings
from dipaco.job.preflight import preflight, resolve_tokenizer_vocab

# Written by Hydra into the output directory before any dipaco code runs: switched off
# for every single run, so a refused command (a resume, a new run) leaves the directory as
# it was, however it is spelled on the command line; the CLIs write Hydra's record
# (`.hydra/`) themselves once a new run is accepted (hydra_record). Multirun jobs keep
# Hydra's own: each writes a new folder of the sweep.
_QUIET_HYDRA = ("hydra.output_subdir=null", "hydra/job_logging=none")
# Folders that existed before Hydra made the output directory: a refused new run removes
# only the empty folders Hydra made for it (protect_run_dir, remove_if_refused).
_EXISTING: set[Path] = set()
_OUTPUT_DIR: list[Path] = []


def config_from_hydra(cfg: DictConfig) -> Config:
    """The typed config, with ``run_dir`` defaulting to Hydra's output directory.

    With ``data.tokenizer`` set, ``model.vocab_size`` comes from that tokenizer unless
    given on the command line (then ``preflight`` refuses a size too small for it).
    """
    hydra = HydraConfig.get()
    _OUTPUT_DIR[:] = [Path(hydra.runtime.output_dir).resolve()]
    conf = to_config(cfg)
    if conf.run_dir is None:
        conf.run_dir = hydra.runtime.output_dir
    return resolve_tokenizer_vocab(pin_paths(conf), hydra.overrides.task)


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


def hydra_record(cfg: DictConfig) -> dict[str, str]:
    """Hydra's ``.hydra/`` files (config, hydra, overrides), for the run to write once it
    is accepted (Hydra's own writing is switched off: :data:`_QUIET_HYDRA`)."""
    hydra = HydraConfig.get()
    return {".hydra/config.yaml": OmegaConf.to_yaml(cfg),
            ".hydra/hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra})),
            ".hydra/overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(list(hydra.overrides.task)))}


def _run_dir_argument(argv: list[str]) -> Optional[str]:
    """``hydra.run.dir`` as Hydra will read it (quotes and escapes parsed), or ``None``."""
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except HydraException:
        return None  # Hydra reports a malformed override itself (check_overrides)
    given = [o.value() for o in parsed if o.key_or_group == "hydra.run.dir"]
    return str(given[-1]) if given and isinstance(given[-1], str) else None


def protect_run_dir(argv: list[str]) -> list[str]:
    """The command line to hand to Hydra: ``--debug`` taken out (it sets DIPACO_DEBUG,
    keeping tracebacks); for a single run, Hydra's own files switched off, the run
    directory checked (:func:`dipaco.run.path_guard.check_run_root`: not a file, not inside
    another run) and every override checked against the schema, each a one-line refusal
    before Hydra makes any folder."""
    if "--debug" in argv:
        os.environ["DIPACO_DEBUG"] = "1"
        argv = [a for a in argv if a != "--debug"]
    if "-m" in argv or "--multirun" in argv or any(a.startswith("-") for a in argv):
        return argv  # a sweep, --help, --cfg, ...: Hydra's own behaviour
    argv = pin_run_dir(argv)
    run_dir = _run_dir_argument(argv)
    try:
        if run_dir is not None and "${" not in run_dir:
            check_run_root(run_dir)
        check_overrides(argv)
    except user_errors() as e:
        fail(str(e))
    base = Path(run_dir).expanduser().resolve() if run_dir else Path.cwd() / "outputs"
    _EXISTING.update(d for d in (base, *base.parents) if d.exists())
    given = {a.split("=", 1)[0] for a in argv}
    return argv + [q for q in _QUIET_HYDRA if q.split("=", 1)[0] not in given]


def pin_run_dir(argv: list[str]) -> list[str]:
    """``hydra.run.dir`` pinned (:func:`dipaco.config.paths.pin_argument`: ``~`` expanded,
    absolute), so the folder the guard checks is the folder Hydra makes; under
    ``launcher=slurm``, whose Hydra launcher writes under ``hydra.sweep.dir`` instead, the
    same folder is also the job's ``run_dir``: the run lands where ``hydra.run.dir`` says."""
    run_dir = _run_dir_argument(argv)
    if run_dir is None or "${" in run_dir:
        return argv
    out = [pin_argument("hydra.run.dir", run_dir) if a.split("=", 1)[0] == "hydra.run.dir" else a for a in argv]
    if "launcher=slurm" in argv and not any(a.split("=", 1)[0] == "run_dir" for a in argv):
        out.append(pin_argument("run_dir", run_dir))
    return out


def check_overrides(argv: list[str]) -> None:
    """Compose the config from the command line: a value of the wrong type, a malformed
    override or an unknown key is a :class:`ConfigError` naming the key, not Hydra's
    multi-line report."""
    compose_config([a for a in argv if not a.lstrip("+~").startswith("hydra")])


def remove_if_refused() -> None:
    """After a refusal: remove the output directory Hydra made for it (and its parents)
    while empty, never a folder that existed before."""
    made = [_OUTPUT_DIR[0], *_OUTPUT_DIR[0].parents] if _OUTPUT_DIR else []
    for d in made:
        if d in _EXISTING or d == Path.cwd() or not d.is_dir() or any(d.iterdir()):
            break
        d.rmdir()


def run_command(tool: str, app: Any) -> None:
    """The ``main`` of a Hydra console script (``dipaco-train``, ``dipaco-route``): one screen
    of help for ``--help`` (not Hydra's 190 lines of config), else ``app`` run with the run
    directory protected; a refused run (exit code 2) leaves no folder Hydra made for it."""
    if wants_help(sys.argv[1:]):
        print(usage(tool))
        return
    sys.argv[1:] = protect_run_dir(sys.argv[1:])
    register_launcher()
    try:
        app()
    except SystemExit as e:
        if e.code not in (0, None):
            remove_if_refused()
        raise


def print_dry_run(conf: Config, config: DictConfig) -> None:
    """``launcher.dry_run=true``: the job script and each task's environment, on stdout."""
    la = conf.launcher
    print(dry_run_text(OmegaConf.to_container(config.hydra.launcher, resolve=True), nodes=la.nodes,
                       nproc=la.nproc, threads=conf.trainer.threads, cpus_per_task=la.cpus_per_task,
                       gpus_per_node=la.gpus_per_node, device=conf.trainer.device,
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
            preflight(conf)
        except user_errors() as e:
            fail(str(e))
        if conf.launcher.name == "slurm":
            la = conf.launcher
            for line in submission_warnings(la.nproc, la.gpus_per_node, la.timeout_min,
                                            OmegaConf.to_container(config.hydra.launcher, resolve=True)):
                say(line)
        if conf.launcher.name == "slurm" and conf.launcher.dry_run:
            print_dry_run(conf, config)
            raise SystemExit(0)  # before the sweeper writes anything
        if job.launcher.name == "slurm" and shutil.which("srun") is None:
            # submitit would raise its own traceback for this
            fail("launcher=slurm: no `srun` on PATH; submit from a SLURM login node "
                 "(this machine is not one)")
