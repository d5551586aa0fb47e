"""The pure core: tree shape, wire format, the protocol state machine, timeout policies and the
fault language. Nothing here does I/O, reads a clock, sleeps, or imports asyncio, socket,
threading, time or torch (tests/test_package.py checks it); drivers feed it events and carry out
the actions it returns."""
