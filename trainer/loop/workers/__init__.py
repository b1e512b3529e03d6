"""Ray workers: policy (actor / reference), critic, rollout host, and the plumbing to place them."""
