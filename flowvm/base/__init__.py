"""The base layer: errors, sentinels, the process environment a run records (random states, settings),
the version and the data helper (``Batches``).  It imports nothing else of flowvm's."""
