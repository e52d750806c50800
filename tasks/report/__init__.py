"""The evaluate stage's HTML report and its plots."""
