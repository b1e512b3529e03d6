"""Ray plumbing: worker groups, in-process handles, Ray start-up, call faults, start-up timing."""
