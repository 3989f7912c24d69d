"""FUSED steps: several torch CALLs run as one ``torch.compile``'d step (made by the fuse-torch pass,
flowvm.passes.fuse_torch): the element, its generated function, its compiler and its runtime."""

from .element import FUSED, FuseSettings, fusable, fused_step, is_fusable  # noqa: F401
