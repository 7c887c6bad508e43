"""Rollouts over Ray, beyond one machine (issue 37, item 5): a two-node Ray
cluster on this one machine (`ray.cluster_utils.Cluster`: two raylets, each
a node of its own), two k7d daemons with their own sockets and state
directories, one per Ray node, and `examples/ray_rollouts.py` driving 3
steps of 4 children on each. Every rollout must have run on the Ray node
that owns its source, through that node's daemon; the second node's
environment came from the first one's snapshot; nothing is left."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from conftest import running_daemon

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ray_rollouts.py"


def load_example():
    spec = importlib.util.spec_from_file_location("ray_rollouts", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_rollouts"] = module
    spec.loader.exec_module(module)
    return module


def test_rollouts_run_on_the_node_that_owns_their_source(tmp_path: Path) -> None:
    ex = load_example()
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(running_daemon(tmp_path / "a"))
        b = stack.enter_context(running_daemon(tmp_path / "b", id_base=2000002200))
        daemons = {"a": a, "b": b}
        pids = {n: d.version()["pid"] for n, d in daemons.items()}
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {ex.resource("a"): 1}, "include_dashboard": False},
        )
        stack.callback(cluster.shutdown)
        node_b = cluster.add_node(num_cpus=1, resources={ex.resource("b"): 1})
        ray.init(address=cluster.address)
        stack.callback(ray.shutdown)
        node_ids = {"a": cluster.head_node.node_id, "b": node_b.node_id}
        assert node_ids["a"] != node_ids["b"], "the two Ray nodes are one"

        sockets = {n: str(tmp_path / n / "k7d.sock") for n in daemons}
        records = ex.run(sockets, tmp_path / "work", steps=3, children=4)

        assert len(records) == 6, records
        for r in records:
            n = r["node"]
            # On the Ray node that owns the source, through its daemon.
            assert r["node_id"] == node_ids[n], f"a rollout of node {n}'s {r['source']} ran elsewhere: {r}"
            assert r["daemon_pid"] == pids[n], f"a rollout of node {n} reached another daemon: {r}"
            assert r["source"].startswith(f"env-{n}"), r
            # Each child's observation follows its action (how long it ran:
            # 8 times longer for the last than the first; the children share
            # two CPUs with the rest, so neighbours may swap places).
            by_action = sorted(r["observed"], key=lambda c: r["actions"][c])
            counts = [r["observed"][c] for c in by_action]
            assert len(set(counts)) == len(counts), r
            assert counts[-1] == max(counts) and counts[0] * 2 < counts[-1], r
            assert r["best"] == by_action[-1], r
        # Step n's best is step n + 1's source: a fork of a fork.
        for n in daemons:
            steps = [r for r in records if r["node"] == n]
            for earlier, later in zip(steps, steps[1:]):
                assert later["source"] == earlier["best"], steps
        # Node b's environment is node a's snapshot, restored there.
        assert (tmp_path / "work" / "b" / "snapshot-env-b").is_dir()
        for n, d in daemons.items():
            assert d.list() == [], f"node {n}'s daemon holds VMs after the run"
