"""A rank given a GPU trains on it; on CPU only where its node declares its GPUs simulated; else
the run stops before the process group forms, in one line that no restart retries."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError, RayTaskError

from orchestrator.control.supervise import user_error_of
from orchestrator.errors import UserError
from orchestrator.runtime.device_choice import NoCudaDevice, rank_device


def test_a_rank_with_a_visible_gpu_trains_on_it_over_nccl():
    chosen = rank_device(5, 1, cuda_available=True, declared_topology=None, rank=3)
    assert (chosen.kind, chosen.index, chosen.backend, chosen.note) == ("cuda", 1, "nccl", None)


def test_a_rank_without_a_gpu_trains_on_cpu_over_gloo():
    chosen = rank_device(None, None, cuda_available=True, declared_topology=None, rank=0)
    assert (chosen.kind, chosen.index, chosen.backend, chosen.note) == ("cpu", None, "gloo", None)


def test_simulated_gpus_run_on_cpu_with_a_note_naming_the_declaration():
    chosen = rank_device(2, 0, cuda_available=False, declared_topology="/caps/hgx.txt", rank=1)
    assert (chosen.kind, chosen.backend) == ("cpu", "gloo")
    assert chosen.note == ("Ray assigned GPU 2 but this process has no CUDA device (the node's GPUs are declared "
                           "by /caps/hgx.txt): running on CPU with gloo")


def test_a_gpu_plan_on_a_node_without_cuda_is_one_line_not_a_silent_cpu_run():
    with pytest.raises(NoCudaDevice, match=r"^rank 4: Ray assigned GPU 1 but this process has no CUDA device") as e:
        rank_device(1, 1, cuda_available=False, declared_topology=None, rank=4)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert "ORCHESTRATOR_TOPOLOGY_FILE" in str(e.value)


def test_the_driver_takes_a_ranks_one_line_mistake_as_it_is_and_anything_else_as_a_failure():
    mistake = NoCudaDevice("rank 0: no CUDA")
    raised = RayTaskError("setup", "Traceback ...", mistake).as_instanceof_cause()  # what ray.get raises
    assert user_error_of(raised) is mistake
    assert user_error_of(RayTaskError("setup", "Traceback ...", RuntimeError("boom"))) is None
    assert user_error_of(RayActorError()) is None
