"""How any stage runs: params, the stage contract, io, scratch, lock, tracking, lineage, env, workspaces."""
