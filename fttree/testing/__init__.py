"""Simulation for tests: real Nodes on an in-memory network with a fake clock, speaking the
fault language of the netem scripts."""
