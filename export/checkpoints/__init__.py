"""Reading a model folder: its weights, its sentence-transformers declarations, the loaded checkpoint."""
