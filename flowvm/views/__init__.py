"""The views layer: a program as a picture (Graphviz dot, Mermaid) and as Python source (and back)."""
