"""The program layer: registers, the elements a program is built of (and the ``Leaf`` base class),
element paths, listings, analysis and verification.  Plain data and what reads it; nothing here runs a program."""
