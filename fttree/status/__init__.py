"""Observability: a monitor that turns a node's structured snapshots into link and step state,
Prometheus metrics, the aiohttp control plane (/status, /metrics, /faults) and `fttree status`."""
