"""The command line: ``flowvm run/resume/show/...`` (cli.py) and the loop that runs a program with
periodic checkpoints and signal handling (runner.py)."""
