"""Tools that measure a running server: load generator, stress suite, benches, the perf_analyzer driver.

Apart from `client` (what a caller installs): these tokenise, export and launch servers locally, and
need the `tools` extra (the benches that export a model, the `export` one too).
"""
