"""The processes layer: POPEN and SPAWN leaves (leaves.py), the executors SPAWN runs on (executors.py) and a
fragment's job on both sides (job.py).

``register_executor`` names an executor so that a saved run can find it again in another process."""

from .named import register_executor

__all__ = ["register_executor"]
