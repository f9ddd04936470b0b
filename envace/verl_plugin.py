"""verl plugin entry point (``verl.plugins``); filled in by the foundation work."""
