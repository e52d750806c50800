"""Quiet output: what other libraries print that tells a crucible user nothing, silenced at its
source, each message by name, so that everything else they say, and every warning of ours, shows.

    quiet.install()    # idempotent; imports none of the libraries it quiets

The `crucible` command calls it before anything heavy is imported; the stage contract
(tasks/runtime/stage.py) calls it again wherever a stage runs (a Prefect worker thread, a Dask
worker process, `crucible stage` under `dvc repro`), and the merge worker subprocess calls it too.
CRUCIBLE_QUIET=0 turns it off (every message as the libraries print it).

What is silenced, and why it carries no information here:

- torchao (installed for the tests' MXFP4 reference, imported by transformers whenever it is
  present): "Failed to load .../torchao/_C_*.so" for each C++/CUDA extension built for another
  Python or GPU. crucible never calls torchao's kernels. Dropped by a filter on the `torchao` logger;
  its other messages (an incompatible torch version, ...) still show.
- torch, on torchao's import: "<enum ...> is an Enum subclass and is now natively supported by
  torch.compile ... Calling register_constant() on Enum subclasses is deprecated": a deprecation
  addressed to torchao's maintainers. Dropped by a filter on the `torch.utils._pytree` logger.
- MLflow's INFO lines "Validating input example against model signature" (every log_model) and
  "Creating initial MLflow database tables..." / "Updating database tables" (a new mlflow.db):
  dropped by filters on the `mlflow.pyfunc` and `mlflow.store.db.utils` loggers.
- MLflow's "Downloading artifacts" bars (log_model reads the model it has just written back from the
  local store to validate the input example): MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false, MLflow's
  own switch.
- transformers' "Loading weights" bar on every model load (offline: nothing is downloaded):
  HF_HUB_DISABLE_PROGRESS_BARS=1, huggingface_hub's switch, which transformers follows. The stages
  show their own progress (crucible/progress.py).
- transformers' "Converting and de-quantizing GGUF tensors" bar (the one-time conversion of the
  packaged SmolLM2 GGUF): a plain tqdm bar that no switch of transformers reaches; `without_bar`
  disables that module's tqdm for the duration of the call, nothing else.

Environment switches are defaults: a value the user set wins. No Python warning is filtered: MLflow's
"Add type hints to the `predict` method" was ours to fix (tasks/registry/pyfunc.py annotates
MultiTaskClassifier.predict), and MLflow shows it under its own `warnings.simplefilter("once")`,
which no filter of ours would outrank.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import sys
from contextlib import contextmanager

ENV = {
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

# logger -> messages (regular expressions, matched at the start of the formatted message) dropped there
LOG_NOISE = {
    "torchao": (r"Failed to load \S*torchao\S*\.so: ",),
    "torch.utils._pytree": (r"<enum '[^']*'> is an Enum subclass and is now natively supported by torch\.compile",),
    "mlflow.pyfunc": (r"Validating input example against model signature$",),
    "mlflow.store.db.utils": (r"Creating initial MLflow database tables", r"Updating database tables$"),
}


class DropMessages(logging.Filter):
    """A logger filter that drops the records whose message matches one of `patterns`."""

    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True
        return not any(p.match(message) for p in self.patterns)


def enabled() -> bool:
    return os.environ.get("CRUCIBLE_QUIET", "1").strip().lower() not in ("0", "false", "no", "off")


def install() -> None:
    """Silence the messages listed above in this process (and, through the environment, in the
    processes it starts). Safe to call any number of times, from any thread."""
    if not enabled():
        return
    user_set_hf = "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    for name, patterns in LOG_NOISE.items():
        logger = logging.getLogger(name)
        # a filter, not a level: it outlives the libraries' own logging set-up (MLflow sets its
        # loggers' levels when it is imported), and leaves the logger's other messages alone
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(patterns))
    # huggingface_hub reads HF_HUB_DISABLE_PROGRESS_BARS when it is imported, transformers when it
    # is; where they already are (a worker process that imported them first), switch them off here
    if not user_set_hf:
        if "transformers.utils.logging" in sys.modules:
            sys.modules["transformers.utils.logging"].disable_progress_bar()
        elif "huggingface_hub.utils" in sys.modules:
            sys.modules["huggingface_hub.utils"].disable_progress_bars()


@contextmanager
def without_bar(module_name: str):
    """Within the block, the tqdm bars that module `module_name` draws through its own `tqdm` name
    are disabled (a bar with no switch of its library's own); everything else is untouched. Not for
    code that another thread runs at the same time."""
    if not enabled():
        yield
        return
    module = importlib.import_module(module_name)
    original = module.tqdm
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original
