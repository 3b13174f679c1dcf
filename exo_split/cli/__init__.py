"""The command line. `exo_split.cli.main:main` is the `exo-split` console script."""
