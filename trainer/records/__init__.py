"""The run's records: metrics and fingerprint files, checkpoints, the run directory."""
