"""I/O: the transport seam (TCP for real runs, in memory for simulations), the in-process fault
layer that wraps either, and the Node that drives the core's state machine over them."""
