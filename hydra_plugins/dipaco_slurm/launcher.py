"""``launcher=slurm``'s Hydra launcher: Hydra's submitit launcher, with a job that fails
reported in one line (:mod:`dipaco.cli.slurm_launcher` has the rule). Hydra instantiates only
launchers found under the ``hydra_plugins`` namespace; this module stays a thin shim so
that Hydra's start-up scan of plugins imports neither dipaco nor torch.
"""
from __future__ import annotations

from typing import Any, Sequence

try:  # the `slurm` extra; without it Hydra's scan must not warn on every dipaco command
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurmLauncher
except ImportError:  # pragma: no cover - the extra is installed in the tests
    _SubmititSlurmLauncher = None

if _SubmititSlurmLauncher is not None:

    class DipacoSlurmLauncher(_SubmititSlurmLauncher):
        """Hydra's ``submitit_slurm`` launcher; a failed submission or job is one line."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
            from dipaco.cli.slurm_launcher import report_failures  # dipaco (and torch) only once launching

            return report_failures(lambda: super(DipacoSlurmLauncher, self).launch(job_overrides, initial_job_idx),
                                   str(self.params["submitit_folder"]))
