"""The machine layer: frames and the moves through them, the driver that steps a program, its fast paths,
the one leaf code generator (compile.py), Depends arguments, and waiting on pending leaves."""
