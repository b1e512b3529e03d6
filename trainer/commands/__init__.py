"""The commands a user runs beside ``train`` (doctor, parity, probe, export, plot, layout, devices); ``trainer/cli.py`` only dispatches to them."""
