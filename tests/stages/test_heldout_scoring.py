"""The held-out scoring the merge stage runs: the feature store encodes each distinct set of weights
once (weights already scored are copied, byte for byte what an encode gives; other weights are
encoded), and the merge workers run in the background (a failing one names its method, a stopped
one is gone)."""

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load

torch.set_num_threads(1)
WORDS = ["market", "goal", "chip", "vote", "film", "great", "awful", "team", "price", "phone"]
CLASSES = {"news": ["business", "sport"], "mood": ["neg", "pos"]}


def rows(n: int, task: str, seed: int) -> pd.DataFrame:
    g = torch.Generator().manual_seed(seed)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (5,), generator=g)) for _ in range(n)]
    return pd.DataFrame({"text": texts, "label": [CLASSES[task][i % 2] for i in range(n)]})


@pytest.fixture
def store():
    from tasks.data.heldout_scoring import FeatureStore, Scorer
    from tasks.data.models import resolve_model

    g = torch.Generator().manual_seed(0)
    specs = [
        {
            "task": t,
            "classes": c,
            "max_length": 16,
            "head": {"weight": torch.randn(2, 384, generator=g), "bias": torch.zeros(2)},
        }
        for t, c in CLASSES.items()
    ]
    tests = {t: rows(6, t, k) for k, t in enumerate(CLASSES)}
    probes = {t: rows(4, t, 10 + k) for k, t in enumerate(CLASSES)}
    scorer = Scorer(resolve_model("all-MiniLM-L6-v2"), specs, tests, 4, probes=probes)
    calls = []
    features = scorer.features
    scorer.features = lambda task, split="test", limit=None: calls.append((task, split)) or features(task, split, limit)
    store = FeatureStore(scorer)
    store.calls = calls
    return store


def test_the_same_weights_are_encoded_once_and_other_weights_again(store):
    scorer = store.scorer
    base = scorer.theta_0
    acc = store.add("base", "base", "base", -1, ["news", "mood"], state=base)
    assert len(store.calls) == 4 and store.encoded == 4 and store.copied == 0  # 2 tasks x (test, probe)
    # the same weights in another dict (copies, keys in reverse order): nothing encoded, features equal
    same = {k: base[k].clone() for k in reversed(list(base))}
    acc_same = store.add("copy", "merge", "m", 0, ["news"], state=same)
    assert len(store.calls) == 4 and store.copied == 2
    assert acc_same["news"] == acc["news"]
    for split in ("test", "probe"):
        copied, first = store.tensors[f"copy/news/{split}"], store.tensors[f"base/news/{split}"]
        assert torch.equal(copied, first) and copied.data_ptr() != first.data_ptr()
    # one weight changed by one step in its last bit: encoded again, and the features differ
    other = dict(same)
    name = "encoder.layer.0.attention.self.query.weight"
    other[name] = same[name].clone()
    other[name].view(torch.int32)[0, 0] += 1
    store.add("other", "merge", "m", 1, ["news", "mood"], state=other)
    assert store.calls[4:] == [("news", "test"), ("news", "probe"), ("mood", "test"), ("mood", "probe")]
    assert store.encoded == 8
    # a copy is what an encode of those weights gives, to the byte (the encoder now holds `other`)
    store.add("base again", "base", "base", -1, ["mood"], state=base)
    assert len(store.calls) == 8
    scorer.load(base)
    assert torch.equal(scorer.features("mood", "probe"), store.tensors["base again/mood/probe"])
    assert not torch.equal(store.tensors["other/mood/test"], store.tensors["base/mood/test"])
    # every variant's features are in the file, under its own name
    tensors = load(store.to_bytes())
    names = [v["name"] for v in json.loads(_metadata(store.to_bytes())["variants"])]
    assert names == ["base", "copy", "other", "base again"]
    for variant, tasks in (("base", CLASSES), ("copy", ["news"]), ("other", CLASSES), ("base again", ["mood"])):
        for t in tasks:
            for split in ("test", "probe"):
                assert torch.equal(tensors[f"{variant}/{t}/{split}"], store.tensors[f"{variant}/{t}/{split}"])


def test_a_test_limit_scores_the_first_rows_and_slices_what_is_known(store):
    """The continual matrices score the first `test_limit` test rows; the final models every row. A
    limited variant of weights known on every row is a slice (nothing encoded); a variant wanting
    every row of weights known on fewer is encoded; the file checks each variant's own row count."""
    base = store.scorer.theta_0
    store.add("base", "base", "base", -1, ["news"], state=base)
    store.add("first", "merge", "m", 0, ["news"], state=base, test_limit=4)
    assert len(store.calls) == 2 and store.copied == 2
    assert torch.equal(store.tensors["first/news/test"], store.tensors["base/news/test"][:4])
    assert store.tensors["first/news/probe"].shape[0] == 4  # probe rows are never limited
    assert store.accuracy("base", "news", 4) == store.accuracy("first", "news")
    other = {k: v.clone() for k, v in base.items()}
    name = "encoder.layer.0.attention.self.query.weight"
    other[name].view(torch.int32)[0, 0] += 1
    store.add("limited", "merge", "m", 1, ["news"], state=other, test_limit=3)
    assert store.tensors["limited/news/test"].shape[0] == 3 and store.calls[2] == ("news", "test")
    store.add("full", "merge", "m", 1, ["news"], state=other)
    assert store.tensors["full/news/test"].shape[0] == 6 and len(store.calls) == 5  # test encoded again
    variants = {v["name"]: v["test_rows"] for v in store.variants}
    assert variants == {"base": {"news": 6}, "first": {"news": 4}, "limited": {"news": 3}, "full": {"news": 6}}
    from tasks.data.heldout_scoring import _features_problem

    tensors = load(store.to_bytes())
    meta = _metadata(store.to_bytes())
    assert _features_problem(tensors, meta) is None
    tensors["first/news/test"] = tensors["first/news/test"][:2]
    assert "expected [4, hidden]" in _features_problem(tensors, meta)


def test_without_weights_the_current_encoder_is_scored_every_time(store):
    """Quantize scores encoder modules (no state dict): nothing is shared."""
    store.add("a", "quantize", "x", -1, ["news"])
    store.add("b", "quantize", "y", -1, ["news"])
    assert len(store.calls) == 4 and store.copied == 0


def _metadata(data: bytes) -> dict:
    import struct

    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])["__metadata__"]


def test_a_failing_worker_names_its_method_and_a_stopped_one_is_gone(tmp_path, base_state):
    from safetensors.torch import save_file

    from tasks.data.merge_worker import start_method

    theta0 = tmp_path / "theta0.safetensors"
    save_file({k: v.contiguous() for k, v in base_state.items()}, str(theta0))
    missing = tmp_path / "no-such-model.safetensors"
    failing = start_method("task_arithmetic", {"lam": 0.5}, theta0, [missing], tmp_path / "ta", "each", 1)
    with pytest.raises(
        RuntimeError,
        match=r"merge method 'task_arithmetic' failed \(exit 1\)"
        r"(.|\n)*no-such-model.safetensors",
    ):
        failing.result()
    running = start_method("weight_average", {}, theta0, [theta0], tmp_path / "wa", "each", 1)
    running.stop()
    assert running.proc.poll() is not None and not (tmp_path / "wa" / "result.json").exists()
