"""Checksums of byte buffers computed where the bytes are (the entry transports' integrity check,
services/transport/checksum.py): the reference (naive.py) and a Triton kernel that copies a buffer
and checksums it in one pass (triton.py)."""
