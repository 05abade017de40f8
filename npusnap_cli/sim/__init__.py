"""The simulated Ascend NPU (npusim): device daemon, its wire format and its manager.

Standard library only. See shared/npusim-spec.md and docs/internals.md.
"""
