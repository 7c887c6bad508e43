"""Rollouts fanned out over a Ray cluster, one k7d daemon per node.

The pattern (docs/rl.md, "Beyond one machine: Ray"):

- Every node runs its own `k7d daemon`. A fork's children live on the node
  that holds its base, so a source VM belongs to one node.
- One Ray actor per node owns that node's source VMs. It is pinned there by
  a custom resource the node was started with (`k7d_node_<name>: 1`), and it
  reaches the node's daemon through its local socket.
- A rollout is a method call on the owner of its source: Ray runs it on the
  node that holds the source's base, never elsewhere.
- A new node gets the environment from a snapshot copied to it: the first
  owner prepares the environment and snapshots it; every other owner
  restores that snapshot from a copy in its own directory.

With k7d's built-in test guests (no Linux, so no `exec`), an environment is
a `memwriter` guest counting rounds at a fixed address, an action is how
long a child runs before it is paused, and the observation is its count.
With a Linux guest the action is a command run in the child by `exec`.

Run (root, a daemon per node already up):

    python3 ray_rollouts.py --node a=/run/k7d-a/k7d.sock --node b=/run/k7d-b/k7d.sock

without `--address` it starts a local two-node test cluster
(`ray.cluster_utils.Cluster`), one Ray node per `--node`.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import ray

from k7d import Client, builtin

# k7d_guest::RESULTS_ADDR + result::LOOP_COUNTER (guest/src/defs.rs).
COUNTER = 0x600 + 0x10
RESOURCE = "k7d_node_{}"


def resource(node: str) -> str:
    """The custom resource that pins an owner to node `node`."""
    return RESOURCE.format(node)


@ray.remote(num_cpus=0)
class NodeOwner:
    """Owns the source VMs of one node's daemon; every rollout of them runs
    here, on that node."""

    def __init__(self, node: str, socket: str, workdir: str) -> None:
        self.node = node
        self.k = Client(socket, timeout=60)
        self.workdir = Path(workdir)
        self.sources: List[str] = []

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def prepare(self, source: str, snapshot_dir: str) -> Dict[str, Any]:
        """Boots the environment once, lets it reach its state, and
        snapshots it into `snapshot_dir` for the other nodes."""
        self.k.create(builtin("memwriter", id=source, memory_mib=16, args=[32, 0x20_0000, 1]), start=True)
        while self.k.peek(source, COUNTER)[0] < 1000:
            time.sleep(0.01)
        self.k.snapshot(source, snapshot_dir)
        self.sources.append(source)
        return {"node": self.node, "node_id": self.node_id(), "source": source}

    def adopt(self, source: str, snapshot_dir: str) -> Dict[str, Any]:
        """Restores the environment from a snapshot copied to this node."""
        local = self.workdir / f"snapshot-{source}"
        shutil.copytree(snapshot_dir, local)
        self.k.restore(local, id=source)
        self.sources.append(source)
        return {"node": self.node, "node_id": self.node_id(), "source": source}

    def rollout(self, source: str, actions: Sequence[float]) -> Dict[str, Any]:
        """One step: a child of `source` per action, each run for its action
        (seconds) and paused, its count read; the best child becomes the
        next source (a fork of a fork), the rest and the old source go."""
        if source not in self.sources:
            raise ValueError(f"{source} is not a source of node {self.node}")
        t = time.monotonic()
        forked = self.k.fork(source, count=len(actions))
        fork_ms = (time.monotonic() - t) * 1000
        children = [c["id"] for c in forked["children"]]
        action = dict(zip(children, actions))
        # The source has nothing to do until it is deleted after the step:
        # it stops spinning, leaving the CPUs to the children.
        self.k.pause(source)
        # Held first, then each let run for exactly its action from its
        # own resume: what a child observes follows its action, not the
        # order in which the calls reached it.
        for c in children:
            self.k.pause(c)
        start = {c: self.k.peek(c, COUNTER)[0] for c in children}
        resumed: Dict[str, float] = {}
        for c in sorted(children, key=lambda c: -action[c]):
            self.k.resume(c)
            resumed[c] = time.monotonic()
        observed: Dict[str, int] = {}
        for c in sorted(children, key=lambda c: resumed[c] + action[c]):
            time.sleep(max(0.0, resumed[c] + action[c] - time.monotonic()))
            self.k.pause(c)
            observed[c] = self.k.peek(c, COUNTER)[0] - start[c]
        best = max(observed, key=lambda c: observed[c])
        for c in children:
            if c != best:
                self.k.delete(c)
        self.k.delete(source)
        self.sources[self.sources.index(source)] = best
        self.k.resume(best)
        return {
            "node": self.node,
            "node_id": self.node_id(),
            "daemon_pid": self.k.version()["pid"],
            "source": source,
            "best": best,
            "fork_ms": fork_ms,
            "observed": observed,
            "actions": action,
        }

    def finish(self) -> List[str]:
        """Deletes this node's sources; returns what is left on its daemon."""
        for s in self.sources:
            self.k.delete(s)
        self.sources = []
        return [v["id"] for v in self.k.list()]


def run(nodes: Dict[str, str], workdir: Path, steps: int = 3, children: int = 4) -> List[Dict[str, Any]]:
    """Rollouts on every node of `nodes` (name -> daemon socket), in a Ray
    cluster already joined (`ray.init`) whose nodes carry the custom
    resources `k7d_node_<name>`. Returns every step's record."""
    names = list(nodes)
    owners = {
        n: NodeOwner.options(resources={resource(n): 1}).remote(n, nodes[n], str(workdir / n)) for n in names
    }
    for n in names:
        (workdir / n).mkdir(parents=True, exist_ok=True)
    snapshot = workdir / "environment"
    first = names[0]
    prepared = [ray.get(owners[first].prepare.remote(f"env-{first}", str(snapshot)))]
    prepared += ray.get([owners[n].adopt.remote(f"env-{n}", str(snapshot)) for n in names[1:]])
    sources = {p["node"]: p["source"] for p in prepared}
    records: List[Dict[str, Any]] = []
    for step in range(steps):
        # Each child's action: how long it runs, twice the last one's (its
        # count follows it even when the children share a few CPUs unevenly;
        # from 0.25 s, so that pause and resume calls slowed by a loaded
        # host do not swamp the shortest: a CI run whose fork took 0.3 s
        # saw 0.1 s children count more than 0.4 s ones).
        actions = [0.25 * 2**i for i in range(children)]
        done = ray.get([owners[n].rollout.remote(sources[n], actions) for n in names])
        for r in done:
            r["step"] = step
            sources[r["node"]] = r["best"]
            records.append(r)
    left = ray.get([owners[n].finish.remote() for n in names])
    for n, l in zip(names, left):
        if l:
            raise RuntimeError(f"node {n}'s daemon still holds {l}")
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", action="append", required=True, help="NAME=SOCKET of a node's k7d daemon")
    p.add_argument("--address", help="a Ray cluster to join (its nodes started with --resources k7d_node_NAME)")
    p.add_argument("--workdir", default="/tmp/k7d-ray-rollouts")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--children", type=int, default=4)
    a = p.parse_args()
    nodes = dict(n.split("=", 1) for n in a.node)
    cluster = None
    if a.address:
        ray.init(address=a.address)
    else:
        from ray.cluster_utils import Cluster

        names = list(nodes)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {resource(names[0]): 1}, "include_dashboard": False},
        )
        for n in names[1:]:
            cluster.add_node(num_cpus=1, resources={resource(n): 1})
        ray.init(address=cluster.address)
    try:
        for r in run(nodes, Path(a.workdir), a.steps, a.children):
            obs = ", ".join(f"{c}: ran {r['actions'][c]:.2f} s, counted {o}" for c, o in r["observed"].items())
            print(f"step {r['step']} node {r['node']}: fork {r['fork_ms']:.1f} ms; {obs}; kept {r['best']}")
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
