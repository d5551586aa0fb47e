"""Limits with one meaning everywhere, in a module of their own so that the wire format
(messages), the transport and Config share them without importing one another."""

DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024 * 1024  # a frame announcing a larger payload is refused
