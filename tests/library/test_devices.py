"""crucible.device and the device rule of the library: every function that takes a model moves its
inputs to that model's device. This machine has no GPU, so the model is put on the `meta` device
(shapes without data): a function that left its inputs on the CPU hands the model CPU tensors,
which a hook on the model sees; one that follows the rule hands it meta tensors (and may then stop
where a meta tensor has no value to read, which is fine: the inputs got there first)."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import COMMON, FAMILIES, tokenizer
from torch import nn

from crucible import device as devices

# ---------------------------------------------------------------------------------------------------
# resolving devices and precisions


def test_auto_is_the_cpu_without_cuda_and_cuda_asked_for_names_what_is_visible(monkeypatch):
    monkeypatch.setattr(devices, "visible_cuda", lambda: 0)  # a machine without CUDA, on any machine
    assert devices.resolve_device("auto") == torch.device("cpu")
    assert devices.resolve_device("cpu") == torch.device("cpu")
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(
            devices.DeviceUnavailable, match=rf"runtime.device = '{spec}', but no CUDA device is visible"
        ):
            devices.resolve_device(spec, what="runtime.device")
    assert devices.autocast_dtype(torch.device("cpu"), "auto") is None  # a CPU run stays in float32
    assert devices.from_environment({}) == (torch.device("cpu"), None)
    with pytest.raises(devices.DeviceUnavailable, match="CRUCIBLE_DEVICE = 'cuda'"):
        devices.from_environment({"CRUCIBLE_DEVICE": "cuda"})


def test_bad_specs_and_precisions_are_refused():
    for spec in ("gpu", "cuda:", "cuda:-1", "cuda:x", ""):
        with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
            devices.resolve_device(spec)
    with pytest.raises(ValueError, match="precision = 'fp16'"):
        devices.autocast_dtype(torch.device("cpu"), "fp16")
    assert devices.autocast_dtype(torch.device("cpu"), "bf16") == torch.bfloat16
    assert devices.autocast_dtype(torch.device("cpu"), "fp32") is None


def test_to_device_moves_the_tensors_inside_containers_and_leaves_the_rest():
    batch = {"ids": torch.ones(2), "nested": (torch.zeros(1), "task"), "n": 3}
    moved = devices.to_device(batch, "meta")
    assert moved["ids"].is_meta and moved["nested"][0].is_meta and moved["nested"][1] == "task" and moved["n"] == 3
    assert devices.model_device(nn.Linear(2, 2).to("meta")) == torch.device("meta")
    assert devices.model_device(nn.Identity()) == torch.device("cpu")


def test_cpu_make_deterministic_changes_nothing():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32)
    devices.make_deterministic(torch.device("cpu"))
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32) == before


# ---------------------------------------------------------------------------------------------------
# the inputs reach the model on its device


def meta_model(family: str):
    from transformers import AutoConfig, AutoModel

    spec = dict(FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **{**COMMON, **spec})
    with torch.device("meta"):
        return AutoModel.from_config(config).eval()


def input_devices(module: nn.Module, call) -> set[str]:
    """The devices of every tensor `module`'s forward received while `call()` ran."""
    seen: set[str] = set()

    def hook(mod, args, kwargs):
        for v in [*args, *kwargs.values()]:
            if isinstance(v, torch.Tensor):
                seen.add(v.device.type)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call()
    except (RuntimeError, NotImplementedError):
        # after the model ran, the call may stop where a meta tensor has no value to read or copy
        # out (.item(), .cpu()); what is checked is the inputs' device, recorded before that
        if not seen:  # it failed before the model ran: a real error
            raise
    finally:
        handle.remove()
    assert seen, "the model was never called"
    return seen


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_encode_and_embed_texts_feed_the_model_on_its_device(family):
    from crucible.embed import embed_texts
    from crucible.models import encode

    model = meta_model(family)
    ids, mask = torch.randint(6, 26, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    assert input_devices(model, lambda: encode(model, ids, mask, "mean")) == {"meta"}
    tok = tokenizer(family == "llama")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    assert input_devices(model, lambda: embed_texts(model, tok, ["good film", "bad team"], batch_size=2)) == {"meta"}


def test_predict_and_train_feed_the_model_on_its_device(monkeypatch):
    import crucible.train
    from crucible.train import EncoderClassifier, Examples, TrainConfig, predict, train

    # a meta device has no generator: the run's dropout generator is made on the CPU for this check
    real = crucible.train.torch_generator
    monkeypatch.setattr(crucible.train, "torch_generator", lambda seed, device=None: real(seed))

    clf = EncoderClassifier(meta_model("bert"), 2).to("meta")
    ids = [[2, 7, 8, 3], [2, 9, 3]]
    assert input_devices(clf.encoder, lambda: predict(clf, ids)) == {"meta"}
    data = Examples(ids, [0, 1], [1.0, 1.0])
    cfg = TrainConfig(max_steps=1, batch_size=2, progress=False)
    assert input_devices(clf.encoder, lambda: train(clf, data, data, cfg)) == {"meta"}


def test_calibration_statistics_feed_the_model_on_its_device():
    from crucible.quant.compensate import collect_input_stats, collect_output_sensitivity

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to("meta")
    batches = [(torch.randn(3, 4),)]
    assert input_devices(model, lambda: collect_input_stats(model, ["0"], batches)) == {"meta"}
    assert input_devices(
        model, lambda: collect_output_sensitivity(model, ["0"], batches, lambda m, b: m(*b).sum())
    ) == {"meta"}


def test_moe_batches_and_perplexity_feed_the_model_on_its_device():
    from crucible.moe.lm import perplexity
    from crucible.moe.routing import forward_batch

    model = meta_model("llama")
    ids = torch.randint(6, 26, (2, 6))
    assert input_devices(model, lambda: forward_batch(model, {"input_ids": ids})) == {"meta"}
    assert input_devices(model, lambda: forward_batch(model, ids)) == {"meta"}
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(model.config).to("meta")
    assert input_devices(lm, lambda: perplexity(lm, ids, batch_size=2)) == {"meta"}


# ---------------------------------------------------------------------------------------------------
# bf16 autocast keeps float32 master weights


def test_bf16_autocast_trains_with_float32_weights_and_predicts_close_to_fp32():
    from transformers import AutoConfig, AutoModel

    from crucible.train import EncoderClassifier, Examples, TrainConfig, predict, train

    spec = dict(FAMILIES["bert"])
    config = AutoConfig.for_model(spec.pop("model_type"), **{**COMMON, **spec})
    torch.manual_seed(0)
    encoder = AutoModel.from_config(config)
    ids = [[2, 6 + (i % 7), 6 + (i * 3 % 11), 3] for i in range(16)]
    labels = [i % 2 for i in range(16)]
    data = Examples(ids, labels, [1.0] * 16)
    clf = EncoderClassifier(encoder, 2, seed=0)
    start = {k: v.clone() for k, v in clf.state_dict().items()}
    fp32 = predict(clf, ids)
    bf16 = predict(clf, ids, autocast_dtype=torch.bfloat16)
    assert fp32.dtype == bf16.dtype == torch.float32 and not torch.equal(fp32, bf16)  # it did run in bf16
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.05)
    cfg = TrainConfig(max_steps=4, batch_size=8, eval_every=4, progress=False, autocast="bf16")
    result = train(clf, data, data, cfg)
    assert result.steps == 4
    assert all(p.dtype == torch.float32 for p in clf.parameters()), "master weights stay float32"
    assert any(not torch.equal(v, start[k]) for k, v in clf.state_dict().items() if v.is_floating_point())
    with pytest.raises(ValueError, match="TrainConfig.autocast = 'fp16'"):
        TrainConfig(autocast="fp16")


class _FakeEncoder(nn.Module):
    """An encoder with the Hugging Face output shape and no value reads, so a whole call of the
    library completes on the meta device."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(is_decoder=False, model_type="bert", architectures=None, hidden_size=8)
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=self.embed(input_ids))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_encode_pools_on_the_models_device_too(pooling):
    """The pooling reads the attention mask: it must be on the model's device as well (the GPU
    check found mean pooling mixing a CUDA hidden state with a CPU mask)."""
    from crucible.models import encode

    model = _FakeEncoder().to("meta")
    out = encode(model, torch.randint(0, 32, (2, 5)), torch.ones(2, 5, dtype=torch.long), pooling)
    assert out.is_meta and out.shape == (2, 8)
