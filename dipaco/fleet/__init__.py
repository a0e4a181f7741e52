"""A decoupled run's hosts: ``dipaco-decoupled``, which joins a run from its store.

* :mod:`~dipaco.fleet.cli`: the command and its verbs (``worker``, ``sync``, ``status``,
  ``finish``);
* :mod:`~dipaco.fleet.join`: opening a run for a role (refusals in one line) and running
  this host's share of it, or its finish;
* :mod:`~dipaco.fleet.status`: the run's state, read from the store.

The roles themselves (workers, synchronisers, their supervisor) are decoupled mode's
(:mod:`dipaco.decoupled`); this package is the top layer because the command shares
the other commands' error boundary (:mod:`dipaco.cli.errors`). See docs/decoupled.md,
"Across hosts".
"""
