"""The pipelines: dump, restore, distributed jobs (with their barriers and Slurm lookup), the demo.

Empty on purpose (a docstring only): the commands import these modules inside their functions
so that ``npusnap --help`` stays fast, and this package must not undo that.
"""
