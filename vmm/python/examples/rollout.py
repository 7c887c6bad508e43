"""RL rollouts on one node, acting in each fork child (docs/rl.md).

An environment is any running Linux VM with k7d-agent (a vsock device) and
a shell. Its state is prepared once, in the source: a file on disk, and a
long-running process holding a running total in memory (reached through
two FIFOs). Each step forks the current source into N children,
copy-on-write, process and all. In child i the action is a number added
to both, and the observation is both read back, through the child's guest
agent (`Client.exec`). The child with the highest score (the sum of its
state) becomes the next step's source: a fork of a fork. At the end every
VM the rollouts made is deleted; the source keeps its prepared state.

    python3 rollout.py --socket /run/k7d/k7d.sock --source env --steps 3 --children 4

It checks what makes forking worth it: each child observes its source's
state plus its own action, and nothing else (no sibling's action leaks into
it, and no child's into its source), in its file and in its process's
memory alike. Per step it prints the fork's time, each child's exec round
trip and what it observed; at the end one JSON line with the time from a
fork to the first command's answer in a child beside a command on the
source.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Tuple

from k7d import Client, NotFound

#: The environment's state on disk, in the guest.
STATE = "/tmp/k7d-rollout.state"
#: The FIFOs of its process holding a running total in memory.
TO_MEMORY, FROM_MEMORY = "/tmp/k7d-rollout.in", "/tmp/k7d-rollout.out"

#: Starts the process: it adds each number written to TO_MEMORY to its
#: total and answers the total on FROM_MEMORY; its stdio on /dev/null, so
#: the exec that starts it ends at once.
MEMORY = f"""rm -f {STATE} {TO_MEMORY} {FROM_MEMORY} && : >{STATE} && mkfifo {TO_MEMORY} {FROM_MEMORY}
(total=0; while read -r a <{TO_MEMORY}; do total=$((total + a)); echo "$total" >{FROM_MEMORY}; done) </dev/null >/dev/null 2>&1 &"""

#: Adds $ACTION to the state on disk and in memory; prints the total in
#: memory, then the state on disk.
ACT = f'echo "$ACTION" >>{STATE} && echo "$ACTION" >{TO_MEMORY} && cat {FROM_MEMORY} && cat {STATE}'


def median(xs: List[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def ints(out: bytes) -> List[int]:
    return [int(x) for x in out.split()]


def prepare(k: Client, vm: str) -> None:
    """The environment's state, once: an empty file and the process."""
    r = k.exec(vm, ["sh", "-c", MEMORY], timeout=60)
    if r.status != 0:
        raise RuntimeError(f"{vm}: preparing the state exited {r.status}: {r.stderr!r}")


def act(k: Client, vm: str, action: int) -> Tuple[int, List[int]]:
    """Takes `action` in `vm` (0: only looks); what it observes after: the
    total in memory and the state on disk."""
    r = k.exec(vm, ["sh", "-c", ACT if action else f"echo 0 >{TO_MEMORY} && cat {FROM_MEMORY} {STATE}"],
               env={"ACTION": str(action)}, timeout=60)
    if r.status != 0:
        raise RuntimeError(f"{vm}: the action exited {r.status}: {r.stderr!r}")
    got = ints(r.stdout)
    return got[0], got[1:]


def rollouts(k: Client, source: str, steps: int, children: int) -> Dict[str, Any]:
    """`steps` steps of `children` forks each from `source`; what they did."""
    before_all = {v["id"] for v in k.list()}
    made: List[str] = []
    src = source
    first_ms: List[float] = []
    child_exec_ms: List[float] = []
    source_ms: List[float] = []
    chosen: List[str] = []
    try:
        for step in range(1, steps + 1):
            t = time.monotonic()
            memory, state = act(k, src, 0)
            source_ms.append((time.monotonic() - t) * 1000)
            t = time.monotonic()
            forked = k.fork(src, count=children)
            fork_ms = (time.monotonic() - t) * 1000
            kids = [c["id"] for c in forked["children"]]
            made += kids
            print(f"step {step}: {children} children of {src} forked in {fork_ms:.1f} ms", flush=True)
            observed: Dict[str, List[int]] = {}
            for i, kid in enumerate(kids):
                action = 100 * step + i
                t_exec = time.monotonic()
                got_memory, got = act(k, kid, action)
                now = time.monotonic()
                child_exec_ms.append((now - t_exec) * 1000)
                if i == 0:
                    first_ms.append((now - t) * 1000)
                print(f"  {kid}: action {action}: observed {got}, {got_memory} in memory ({(now - t_exec) * 1000:.1f} ms)",
                      flush=True)
                if got != state + [action] or got_memory != memory + action:
                    raise RuntimeError(
                        f"step {step}: {kid} observed {got} and {got_memory} in memory, not its source's {state} "
                        f"and {memory} with its own action {action}"
                    )
                observed[kid] = got
            if act(k, src, 0) != (memory, state):
                raise RuntimeError(f"step {step}: the source {src} changed while its children acted")
            best = max(kids, key=lambda c: sum(observed[c]))
            for kid in kids:
                if kid != best:
                    k.delete(kid)
                    made.remove(kid)
            chosen.append(best)
            print(f"  kept {best}", flush=True)
            src = best
        final_memory, final = act(k, src, 0)
    finally:
        for vm in reversed(made):
            try:
                k.delete(vm)
            except NotFound:
                pass
    left = {v["id"] for v in k.list()} - before_all
    if left:
        raise RuntimeError(f"the rollouts left VMs behind: {sorted(left)}")
    return {
        "steps": steps,
        "children": children,
        "chosen": chosen,
        "final_state": final,
        "final_memory": final_memory,
        "fork_to_first_exec_ms_p50": round(median(first_ms), 1),
        "exec_in_child_ms_p50": round(median(child_exec_ms), 1),
        "exec_on_source_ms_p50": round(median(source_ms), 1),
    }


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default="/run/k7d/k7d.sock", help="the k7d daemon's socket")
    p.add_argument("--source", required=True, help="a running Linux VM with k7d-agent: the environment")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--children", type=int, default=4)
    a = p.parse_args(argv)
    if a.steps < 1 or not 1 <= a.children <= 64:
        p.error("--steps is at least 1, --children 1 to 64")
    k = Client(a.socket, timeout=120)
    prepare(k, a.source)
    result = rollouts(k, a.source, a.steps, a.children)
    print("rollout:", json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
