"""Allreduce sizes the tools share, kept apart from demo.py so that a command's option
defaults need not import numpy and the allreduce machinery just to print --help."""

from __future__ import annotations

THESIS_MLP_PARAMS = 407_050  # 784-512-10 MLP of the seed thesis
