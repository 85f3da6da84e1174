"""The torch-only core."""
