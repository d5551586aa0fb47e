"""Command-line tools: the `fttree` CLI, local launches, the demo job, benchmarks and their
baselines, analysis, and the real-fault (iptables) runner."""

from pathlib import Path

#: The checkout this package runs from (an editable install): where netem/ and .git live.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
