"""Timed comparisons against torch, measured side by side in one run."""
