"""What the chaos driver and its workers agree on (a file name, an exit status), kept apart
from chaos_worker.py so that the driver, and `fttree --help`, need not import torch."""

from __future__ import annotations

STOP_FILE = "stop"
EXIT_EVICTED = 3  # the group went on without this process (it was stopped too long): restart it
