"""The flow's GPU plumbing, checked on a CPU: which GPU a run gets on one machine, what a run asks
a Ray or Dask cluster for, and what a local cluster is started with."""

from __future__ import annotations

import pytest

from flows.resources import GpuSlots, gpu_request, local_cluster_gpus, local_gpus, requesting, spreads_locally


def params_with(tiny_params, runner="threads", gpus_per_task=0, device="auto", address=None):
    return tiny_params.model_copy(
        update={
            "pipeline": tiny_params.pipeline.model_copy(update={"runner": runner, "address": address}),
            "runtime": tiny_params.runtime.model_copy(update={"gpus_per_task": gpus_per_task, "device": device}),
        }
    )


def test_runs_go_to_the_least_loaded_gpu_and_come_back():
    slots = GpuSlots([0, 1])
    a, b, c = slots.take(), slots.take(), slots.take()
    assert (a, b, c) == ("cuda:0", "cuda:1", "cuda:0")
    slots.give(b)
    assert slots.take() == "cuda:1"  # the freed one has the fewest runs now
    slots.give(a)
    slots.give(c)
    assert slots.take() == "cuda:0"
    assert GpuSlots([]).take() is None  # no GPU: the stage's runtime section decides


def test_only_auto_or_cuda_is_spread_and_only_where_the_flow_places_runs(tiny_params, monkeypatch):
    import flows.resources as resources

    monkeypatch.setattr(resources, "visible_cuda", lambda: 2)
    monkeypatch.delenv("CRUCIBLE_DEVICE", raising=False)
    monkeypatch.delenv("CRUCIBLE_DASK_ADDRESS", raising=False)
    assert local_gpus(params_with(tiny_params, device="auto")) == [0, 1]
    assert local_gpus(params_with(tiny_params, device="cuda")) == [0, 1]
    assert local_gpus(params_with(tiny_params, device="cuda:1")) == []  # pinned: every run gets it
    assert local_gpus(params_with(tiny_params, device="cpu")) == []
    monkeypatch.setenv("CRUCIBLE_DEVICE", "cpu")
    assert local_gpus(params_with(tiny_params, device="auto")) == []
    assert spreads_locally(params_with(tiny_params, "threads"))
    assert spreads_locally(params_with(tiny_params, "dask"))
    assert not spreads_locally(params_with(tiny_params, "dask", address="tcp://h:8786"))
    assert not spreads_locally(params_with(tiny_params, "ray"))  # Ray sets CUDA_VISIBLE_DEVICES itself


def test_a_run_asks_the_cluster_for_its_gpus(tiny_params):
    assert gpu_request(params_with(tiny_params, "ray", 1)) == {"num_gpus": 1}
    assert gpu_request(params_with(tiny_params, "dask", 2)) == {"resources": {"GPU": 2}}
    assert gpu_request(params_with(tiny_params, "dask", 0)) == {}
    assert gpu_request(params_with(tiny_params, "threads", 1)) == {}


def test_dask_annotates_the_submitted_runs_and_a_local_cluster_offers_the_resource(tiny_params):
    dask = pytest.importorskip("dask")
    p = params_with(tiny_params, "dask", 1)
    with requesting(p):
        assert dask.get_annotations() == {"resources": {"GPU": 1}}
    assert dask.get_annotations() == {}
    assert local_cluster_gpus(p) == {"resources": {"GPU": 1}}
    from flows.pipeline import task_runner

    runner = task_runner(p)
    assert runner.cluster_kwargs["resources"] == {"GPU": 1} and runner.cluster_kwargs["n_workers"] == 2


def test_a_dask_run_with_a_gpu_request_is_placed_on_a_worker_that_offers_it(tiny_params):
    """The resource plumbing end to end on a real local Dask cluster: a task annotated GPU=1 runs
    on a worker started with resources GPU=1 (a CPU stands in for the GPU here)."""
    pytest.importorskip("dask")
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None, resources={"GPU": 1}
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        with requesting(params_with(tiny_params, "dask", 1)):
            future = client.submit(lambda: distributed.get_worker().state.total_resources, pure=False)
        assert future.result(timeout=60) == {"GPU": 1}
