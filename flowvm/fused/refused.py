"""The one refusal of fused/'s compile stages."""


class Refused(Exception):
    """A stage of a step's compile refuses it (the message says why, and ends in ``runtime().refused``): the step
    runs eagerly, or compiles another way (on the thread, under dynamo's guards)."""
