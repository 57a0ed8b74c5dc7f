"""Command-line entry points (the only place in the package that prints)."""
