"""The parity gate: cases, comparison, and the reference libraries' checks."""
