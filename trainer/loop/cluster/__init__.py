"""Ray plumbing: worker groups, in-process handles, Ray start-up, remote-call faults, process start-up."""
