"""The run directory and its safety: named files, checkpoints, fingerprints, the write guard, the lock, resume."""
