"""Where and how processes run: devices, launching ranks, SLURM and preemption, faults, progress and logging, metrics."""
