"""The alpha-beta fit on synthetic timings, and a real gloo measurement between two actors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from orchestrator.topology import measure
from orchestrator.topology.measure import (
    Fit,
    apply_fits,
    cache_key,
    fit_alpha_beta,
    measure_cluster,
    pairs_to_measure,
)
from orchestrator.topology.model import ClusterTopology, Device, Link, NodeTopology, cpu_node

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def test_fit_recovers_alpha_and_beta_from_noisy_timings() -> None:
    rng = random.Random(7)
    alpha, beta = 8e-6, 20e9  # 8 us, 20 GB/s
    times = [(alpha + s / beta) * rng.uniform(0.97, 1.03) for s in SIZES]
    fit = fit_alpha_beta(SIZES, times)
    assert fit.latency_us == pytest.approx(8.0, rel=0.1)
    assert fit.bandwidth_gbps == pytest.approx(20.0, rel=0.05)


def test_fit_exact_two_points() -> None:
    fit = fit_alpha_beta([0, 1_000_000_000], [1e-6, 0.1 + 1e-6])
    assert (fit.latency_us, fit.bandwidth_gbps) == (pytest.approx(1.0), pytest.approx(10.0))


def test_fit_negative_intercept_is_clamped_to_a_positive_latency() -> None:
    # Pure bandwidth, no latency, plus noise that pushes the intercept below zero.
    times = [s / 50e9 for s in SIZES]
    times[0] *= 0.5
    fit = fit_alpha_beta(SIZES, times)
    assert fit.latency_us > 0 and fit.bandwidth_gbps == pytest.approx(50.0, rel=0.1)


@pytest.mark.parametrize("sizes,times,match", [
    ([1024, 1024], [1e-5, 1e-5], "two message sizes"),
    ([1024, 4096], [1e-5, 1e-6], "does not grow"),
    ([1024, 4096], [1e-5], "pair up"),
    ([1024, 4096], [0.0, 1e-5], "positive"),
])
def test_fit_rejects_unfittable_series(sizes, times, match) -> None:
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(sizes, times)


def _pcie_node() -> NodeTopology:
    devices = [Device(index=i, uuid=f"GPU-{i}") for i in range(3)]
    links = [Link(0, 1, "pix", bandwidth_gbps=31.5, latency_us=1.5),
             Link(0, 2, "sys", bandwidth_gbps=12.6, latency_us=6.0),
             Link(1, 2, "sys", bandwidth_gbps=12.6, latency_us=6.0)]
    return NodeTopology(hostname="h", source="nvml", devices=devices, links=links)


def test_quick_mode_measures_one_pair_per_class_and_spreads_it() -> None:
    node = _pcie_node()
    assert pairs_to_measure(node, quick=True) == [(0, 1), (0, 2)]
    assert pairs_to_measure(node, quick=False) == [(0, 1), (0, 2), (1, 2)]
    apply_fits(node, {(0, 1): Fit(2.0, 30.0), (0, 2): Fit(7.0, 3.0)})
    assert all(l.measured for l in node.links)
    assert node.link(1, 2).bandwidth_gbps == 3.0  # the class figure
    # 3 GB/s on a path expected to carry 12.6 is degraded; 30 of 31.5 is not.
    assert [l.degraded for l in node.links] == [False, True, True]
    assert any("0-2, 1-2" in w for w in node.warnings)


def test_cache_key_is_host_and_gpus() -> None:
    a, b = _pcie_node(), _pcie_node()
    assert cache_key(a) == cache_key(b)
    b.devices[2].uuid = "GPU-other"
    assert cache_key(a) != cache_key(b)


@pytest.fixture()
def local_ray():
    import ray

    # address="local": always a new private cluster, never a stale one from /tmp/ray.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_gloo_actors_measure_and_cache(local_ray, tmp_path: Path, monkeypatch) -> None:
    node = cpu_node(4, hostname="bench-host", node_id=local_ray)
    cluster = ClusterTopology(nodes=[node, NodeTopology(hostname="sim", node_id="x", source="declared:f.txt")])
    measure_cluster(cluster, quick=True, cache=tmp_path)
    assert all(l.measured for l in node.links)
    link = node.link(0, 1)
    assert link.bandwidth_gbps > 0 and link.latency_us > 0
    assert not link.degraded  # loopback gloo is no wire to fall short of
    assert node.link(2, 3).bandwidth_gbps == link.bandwidth_gbps
    assert any("not measured" in w for w in cluster.nodes[1].warnings)
    [cached] = list(tmp_path.glob("*.json"))
    stored = cached.read_bytes()
    assert json.loads(stored)["quick"] is True and json.loads(stored)["hostname"] == "bench-host"

    # Same host and devices: the cached figures are reused without starting actors.
    def no_actors(*_args, **_kwargs):
        raise AssertionError("a cached node must not start measuring actors")

    monkeypatch.setattr(measure, "_start", no_actors)
    again = cpu_node(4, hostname="bench-host", node_id=local_ray)
    measure_cluster(ClusterTopology(nodes=[again]), quick=True, cache=tmp_path)
    assert again.link(0, 1).bandwidth_gbps == link.bandwidth_gbps and again.link(0, 1).measured
    assert again.link(2, 3).bandwidth_gbps == link.bandwidth_gbps
    # Nothing was measured again, so nothing was written again.
    assert list(tmp_path.glob("*.json")) == [cached] and cached.read_bytes() == stored


@pytest.mark.ray
@pytest.mark.slow
def test_two_nodes_time_the_network_with_all_reduce(tmp_path: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False))
    other = cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        nodes = [cpu_node(2, hostname="a", node_id=cluster.head_node.node_id),
                 cpu_node(2, hostname="b", node_id=other.node_id)]
        topo = measure_cluster(ClusterTopology(nodes=nodes), quick=True, cache=tmp_path)
        assert topo.network.source == "measured"
        assert topo.network.bandwidth_gbps > 0 and topo.network.latency_us > 0
        assert all(l.measured for n in topo.nodes for l in n.links)
        stored = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
        assert len(stored) == 2
        # Both nodes run on this machine's cores: their pairs slow each other down when they move
        # data at once, as a step's in-node collectives do (1.2-2.0x here; a node's reading
        # can fall under the mark now and then, both nodes' together hardly ever), and a node
        # that reads it says so and carries it in its links.
        slowed = 0
        for node, data in zip(topo.nodes, sorted(stored, key=lambda d: d["hostname"])):
            slowdown = data["shared_slowdown"]
            said = [w for w in node.warnings if "slower while every node did at once" in w]
            assert slowdown == 1.0 and not said or slowdown >= measure.SHARED_MIN_SLOWDOWN and len(said) == 1, data
            slowed += slowdown > 1.0
            [pair] = data["pairs"]
            assert node.link(0, 1).bandwidth_gbps == pytest.approx(pair["bandwidth_gbps"], abs=1e-3)
        assert slowed >= 1, stored
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_shared_host_is_told_from_run_to_run_spread() -> None:
    """Nodes whose pairs slow each other down when every node moves data at once share a host;
    a slowdown within one machine's spread is none."""
    assert measure.shared_slowdown(0.010, 0.021) == pytest.approx(2.1)
    assert measure.shared_slowdown(0.010, 0.0115) == 1.0  # 15%: spread, not sharing
    assert measure.shared_slowdown(0.010, 0.008) == 1.0  # faster together: never a speed-up
    with pytest.raises(ValueError, match="exchange times must be > 0 s"):
        measure.shared_slowdown(0.0, 0.01)


def test_fit_reads_the_sustained_rate_of_a_link_that_passes_a_burst_at_once() -> None:
    # A token bucket (tc's tbf, a NIC's coalescing) lets the first 96 KiB through at once and
    # the rest at 62.5 MB/s: the rate is what the large messages see, not a line through all.
    rate, burst, alpha = 62.5e6, 96 << 10, 150e-6
    times = [alpha + max(0, s - burst) / rate for s in SIZES]
    fit = fit_alpha_beta(SIZES, times)
    assert fit.bandwidth_gbps == pytest.approx(rate / 1e9, rel=0.1)
    assert 0 < fit.latency_us <= alpha * 1e6 * 1.01
