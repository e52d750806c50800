"""crucible: the algorithms of the post-training pipeline (no orchestration imports)."""
