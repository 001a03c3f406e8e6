"""`stoker eval`: a live deployment against a reference run (or replicas against each other)."""
