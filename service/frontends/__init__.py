"""The front ends: each protocol parses its wire format, passes the envelope and renders answers."""
