"""The compiled core, sans-IO: the per-request state table (``_table``, its pure twin ``_table_py``, the
grids of ``_spec``, the chooser ``table``), the shared-memory reduction (``_shm``/``_shm_py``), the
replica's agreement, and the vocabulary every layer shares: events, errors, deadlines."""
