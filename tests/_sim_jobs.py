"""Shared by the simulator's tests: the tiny job they simulate, and a cluster change of it."""
from __future__ import annotations

import dataclasses

from dipaco.config import compose_config
from dipaco.sim.job import SimJob, sim_job

TINY = ["experiment=smoke", "cluster.chips=4", "cluster.step_s=0.5"]


def tiny_job() -> SimJob:
    """``experiment=smoke`` on a 4-chip cluster of 0.5 s steps."""
    return sim_job(compose_config(TINY))


def on(job: SimJob, **cluster) -> SimJob:
    """``job`` on a cluster with ``cluster`` changed (no recomposition)."""
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **cluster))
