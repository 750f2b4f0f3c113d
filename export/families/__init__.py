"""Model families: one module each, ending in its declaration; the registry lists them."""
