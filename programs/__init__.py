"""Learning algorithms written as flowvm programs, one module each.

Each module has ``build(**options)`` returning a program with sensible
defaults, ``SHOW`` (register names worth showing while it runs) and
``report(registers)`` (a one-paragraph summary of the result).
"""
