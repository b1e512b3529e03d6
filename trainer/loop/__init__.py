"""The training loop: the controller and its step, start-up, preflight, placement and memory budget, step statistics, health gates, validation."""
