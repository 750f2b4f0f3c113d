"""The launcher: one process's life (ports, signals, drain), the processes of --frontends N, Envoy's process.

It starts the front ends and hands them what they need; no front end imports it.
"""
