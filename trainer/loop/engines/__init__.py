"""The rollout host's side: rollout, stream and replay hosts, sampling, validation rollouts."""
