"""crossrl bench layer (see ../shared/DESIGN.md)."""
