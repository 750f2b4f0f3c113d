"""Checks of the exported graph against the library that made the folder."""
