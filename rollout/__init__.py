"""crossrl rollout layer (see ../shared/DESIGN.md)."""
