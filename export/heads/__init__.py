"""Task heads on an encoder: classifier, yes/no, SPLADE, ColBERT, bge-m3, Dense."""
