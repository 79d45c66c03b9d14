"""Evaluation: metrics (numpy/scikit-learn, no torch at import) and published reference numbers."""
