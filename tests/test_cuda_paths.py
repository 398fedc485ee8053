"""The CUDA and NCCL paths of the runtime, checked on a CPU with `torch.cuda`, NVML and
`init_process_group` mocked: what they hand CUDA, NVML or NCCL."""

from __future__ import annotations

import fake_pynvml as fake
import pytest
import torch
import torch.distributed as dist

NCCL_WATCHDOG = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@pytest.fixture
def groups(monkeypatch):
    """Every `init_process_group` call's keyword arguments, none of them starting a group."""
    calls: list[dict] = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.delenv(NCCL_WATCHDOG, raising=False)
    return calls


def test_a_group_on_nccl_starts_bound_to_the_ranks_device_with_a_watchdog_that_only_cleans_up(groups, monkeypatch):
    import os

    from orchestrator.runtime import rendezvous
    from orchestrator.runtime.trainer import init_process_group

    store = dist.HashStore()
    rendezvous.join(0, 1, ("127.0.0.1", 1), "nccl", store, torch.device("cuda", 3))
    assert groups[-1]["device_id"] == torch.device("cuda", 3)
    assert os.environ[NCCL_WATCHDOG] == "2"  # 1 and torch's 3 tear a survivor down

    monkeypatch.delenv(NCCL_WATCHDOG)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    init_process_group(0, 1, "127.0.0.1", 1, "nccl")  # the benchmarks' path: the current device
    assert groups[-1]["device_id"] == torch.device("cuda", 5)
    assert os.environ[NCCL_WATCHDOG] == "2"


def test_a_users_watchdog_setting_is_kept_and_gloo_gets_no_device(groups, monkeypatch):
    import os

    from orchestrator.runtime import rendezvous
    from orchestrator.runtime.trainer import init_process_group

    monkeypatch.setenv(NCCL_WATCHDOG, "1")
    init_process_group(0, 1, "127.0.0.1", 1, "nccl", torch.device("cuda", 0))
    assert os.environ[NCCL_WATCHDOG] == "1"
    monkeypatch.delenv(NCCL_WATCHDOG)
    rendezvous.join(0, 1, ("127.0.0.1", 1), "gloo", dist.HashStore(), torch.device("cpu"))
    assert "device_id" not in groups[-1]
    assert NCCL_WATCHDOG not in os.environ
    with pytest.raises(ValueError, match="binds a CUDA device, not cpu"):
        rendezvous.group_options("nccl", torch.device("cpu"))


def _uuid_machine() -> fake.FakeNvml:
    nvml = fake.rtxa6000_pairs()
    nvml.gpus[6].mig_uuids = ["MIG-5c9b2a60-0d3c-5b8e-8f7e-2f1a3c4d5e6f"]
    return nvml


def test_gpu_ids_given_as_uuids_map_to_nvml_indices():
    from orchestrator.runtime.gpu_ids import gpu_indices

    nvml = _uuid_machine()
    assert gpu_indices(["3", 1]) == [3, 1]  # indices need no NVML
    assert gpu_indices([fake.A6000_UUIDS[5], "2", "MIG-5c9b2a60-0d3c-5b8e-8f7e-2f1a3c4d5e6f"], nvml) == [5, 2, 6]
    assert not nvml.initialized  # closed again
    with pytest.raises(RuntimeError, match="GPU id GPU-00000000-dead names no device NVML knows on this node"):
        gpu_indices(["GPU-00000000-dead"], nvml)


def test_a_whole_gpu_sees_the_jobs_gpus_on_its_node_and_a_mig_instance_only_itself():
    from orchestrator.runtime.gpu_ids import cuda_visible

    # GPU 5 among the job's 2, 5 and 7 on its node: all three visible, the rank on the second.
    assert cuda_visible("5", 5, [7, 2, 5, 2]) == ("2,5,7", 1)
    assert cuda_visible(fake.A6000_UUIDS[5], 5, [7]) == ("5,7", 0)
    # A MIG instance of GPU 6: by its UUID, or the index would hand it the whole parent GPU.
    mig = "MIG-5c9b2a60-0d3c-5b8e-8f7e-2f1a3c4d5e6f"
    assert cuda_visible(mig, 6, [6, 6]) == (mig, 0)


def test_the_worker_reports_a_uuid_gpu_by_its_index(monkeypatch):
    import sys

    import ray

    from orchestrator.runtime import worker

    monkeypatch.setitem(sys.modules, "pynvml", _uuid_machine())
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [fake.A6000_UUIDS[4]])
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_node_id": lambda s: "n",
                                                                           "get_actor_id": lambda s: "a"})())
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    report = worker.device_report(cpu_slot=0)
    assert report["gpu_ids"] == [4] and report["gpu"] == 4
    assert report["pci_bus_id"] == _uuid_machine().gpus[4].bus_id


def test_the_metrics_thread_reads_the_ranks_own_device(monkeypatch):
    from orchestrator.runtime import metrics

    read: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: read.append(device) or 7 << 30)
    assert metrics.process_memory_bytes(torch.device("cuda", 3)) == 7 << 30
    assert read == [torch.device("cuda", 3)]  # never None: the current device is the thread's own
    m = metrics.TrainMetrics("job", 3, node="n", device=torch.device("cuda", 3))
    m.record_step({"step": 1, "loss": 2.0})
    m.flush()
    assert read == [torch.device("cuda", 3)] * 2


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_every_setup_starts_the_peak_afresh_and_keeps_the_first_baseline(monkeypatch, kind):
    from orchestrator.runtime import worker

    resets: list = []
    held = iter([2 << 30, 5 << 30])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: next(held))
    monkeypatch.setattr(worker, "_forget_resident_peak", lambda: resets.append("rss"))
    monkeypatch.setattr(worker, "_resident_bytes", lambda: next(held))
    device = torch.device(kind, 0)
    first = worker.memory_baseline(device)
    # A trial's or a heal's next setup: the peak counts this world only, against the first baseline.
    again = worker.memory_baseline(device, first)
    assert (first, again) == (2 << 30, 2 << 30)
    assert resets == ([device] if kind == "cuda" else ["rss"]) * 2


@pytest.mark.parametrize("name, peak", [("NVIDIA H200 NVL", 835.0), ("NVIDIA H200", 989.0),
                                        ("NVIDIA GH200 480GB", 989.0), ("NVIDIA H100 NVL", 835.0)])
def test_an_h200_nvl_is_not_read_as_an_h200(name, peak):
    from orchestrator.planning.gpus import lookup

    assert lookup(name).peak_tflops == peak


def test_a_step_that_returns_after_an_abort_never_counts(monkeypatch):
    import types

    from orchestrator.runtime import worker

    monkeypatch.setattr(worker, "_normal_priority", lambda: None)
    rank = worker.Worker.__ray_actor_class__(0, 2, 0, torch.get_num_threads())
    rank.trainer = types.SimpleNamespace(plan=types.SimpleNamespace(mesh=types.SimpleNamespace(dp_replicate=2)),
                                         applied=4, held_tensors=lambda: [("w", torch.zeros(1))])
    rank._step_done({"step": 3, "loss": 2.0})
    rank._step_done({"step": 4, "loss": 1.9})
    # The control thread aborts while step 5 waits on the loss's reduction, which then returns a
    # partial sum; the loop applies the step and makes its row.
    rank.abort_collectives()
    rank.trainer.applied = 5
    with pytest.raises(RuntimeError, match="step 5 returned after its group's collectives were aborted"):
        rank._step_done({"step": 5, "loss": 0.7})
    assert [r["step"] for r in rank._rows] == [3, 4]  # no row for the driver's restore
    assert rank._keep() is None  # no held state for the survivors' restore
    assert rank._not_held == "its step 5 was applied but not done"
