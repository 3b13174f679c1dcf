"""Checkpoints exo-split makes itself: tiny.py builds the random-weight models used for timing
work and tests (no download)."""
