"""``dipaco-plan --simulate``: a discrete-event simulation (SimPy) of a DiPaCo job on a
described cluster (``cluster.*``), per sync mode: wall time per round, exposed
communication, bytes, goodput, steps lost to failures, time to the run's tokens.

* :mod:`~dipaco.sim.job`: the run's config on the cluster, in numbers (the project's planners);
* :mod:`~dipaco.sim.faults`: failures and stragglers, seeded;
* :mod:`~dipaco.sim.modes`: one component per sync mode, built by name (what a round costs);
* :mod:`~dipaco.sim.rounds`: the round-based modes on a SimPy clock;
* :mod:`~dipaco.sim.decoupled`: decoupled workers and synchronisers (:mod:`dipaco.decoupled.quorum`'s rules);
* :mod:`~dipaco.sim.tally`: what a mode reports;
* :mod:`~dipaco.sim.report`: all modes, the table, JSON and the plot.

See docs/planning.md.
"""
