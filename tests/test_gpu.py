"""CUDA paths: the communication worker's side stream and NCCL collectives (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from quietsync import CommWorker, Topology, Transport

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_comm_worker_orders_its_stream_after_the_producer_without_host_sync():
    worker = CommWorker("cuda")
    x = torch.zeros(1 << 20, device="cuda")
    for _ in range(20):  # a long queue of kernels on the main stream
        x.add_(1)
    job = worker.submit(lambda: x.sum())  # must see all 20 additions
    total = job.wait()
    torch.cuda.current_stream().synchronize()
    assert total.item() == 20 * (1 << 20)
    assert worker.stream is not None and worker.stream != torch.cuda.current_stream()
    worker.close()


def test_world_of_one_transport_on_cuda_is_local():
    t = Transport(Topology.single(), backend="nccl")
    x = torch.ones(8, device=t.device)
    t.all_reduce(x)
    assert torch.all(x == 1) and t.device.type == "cuda"
