"""Start-up of a run: the run itself, preflight checks, launching the workers, restarts."""
