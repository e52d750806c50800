"""One module per dvc.yaml stage; each holds only what that stage does."""
