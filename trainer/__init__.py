"""crossrl trainer layer (see ../shared/DESIGN.md)."""
