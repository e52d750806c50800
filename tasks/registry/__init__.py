"""The deployable model: registry helpers, the pyfunc, serving."""
