"""A deterministic simulator: the real engines and state tables over a seeded network, data plane
and clock, checking the library's promises after every step (``python -m pdcore simulate``)."""
