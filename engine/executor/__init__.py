"""Executors run the model runner on one process (uniproc) or on tensor-parallel worker processes (multiproc),
and the process-group helpers they share."""
