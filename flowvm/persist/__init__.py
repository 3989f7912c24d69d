"""The persist layer: how a run becomes bytes and back (the pickler), the checkpoint file format, saving
and loading, local and remote storage."""
