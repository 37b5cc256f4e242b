"""The command line (``python -m pdcore COMMAND``): ``demo``, ``bootstrap``, ``chaos``, and what they share
(``cli``: parser types and one-line errors; ``progress``: live progress)."""
