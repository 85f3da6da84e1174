"""Features on the core."""
