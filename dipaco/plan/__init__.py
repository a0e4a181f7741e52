"""The run's shape: the grid and topology built from the config, and what a round costs in bytes and memory."""
