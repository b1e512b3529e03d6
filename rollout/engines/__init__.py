"""Generation engines behind one interface (see base.py)."""
