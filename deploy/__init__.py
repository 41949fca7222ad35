"""Launching tandem: `local.py` starts a whole topology as processes on one host."""
