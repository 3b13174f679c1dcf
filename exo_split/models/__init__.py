"""Checkpoints exo-split makes itself: tiny.py builds the random-weight models used for timing
work and tests (no download); gguf*.py converts a GGUF file into a Hugging Face directory;
smollm2.py finds the embedded real model (SmolLM2-135M-Instruct) and converts it once."""
