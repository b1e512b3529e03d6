"""crossrl hal layer (see ../shared/DESIGN.md)."""
