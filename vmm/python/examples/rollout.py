"""RL rollouts on one node, acting in each fork child (docs/rl.md).

An environment is any running Linux VM with k7d-agent (a vsock device) and
a shell. Each step forks the current source into N children, copy-on-write.
In child i the action is a number its command appends to the environment's
state file, and the observation is the state read back, both through the
child's guest agent (`Client.exec`). The child with the highest score (the
sum of its state) becomes the next step's source: a fork of a fork. At the
end every VM the rollouts made is deleted; the source is left as it was.

    python3 rollout.py --socket /run/k7d/k7d.sock --source env --steps 3 --children 4

It checks what makes forking worth it: each child observes its source's
state plus its own action, and nothing else (no sibling's action leaks into
it, and no child's into its source), and it prints, as one JSON line, the
time from a fork to the first command's answer in a child beside a command
on the source.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List

from k7d import Client, NotFound

#: The environment's state, in the guest.
STATE = "/tmp/k7d-rollout.state"


def median(xs: List[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def ints(out: bytes) -> List[int]:
    return [int(x) for x in out.split()]


def observe(k: Client, vm: str) -> List[int]:
    """The environment's state in `vm`."""
    r = k.exec(vm, ["sh", "-c", f"cat {STATE} 2>/dev/null; true"], timeout=60)
    if r.status != 0:
        raise RuntimeError(f"{vm}: reading the state exited {r.status}: {r.stderr!r}")
    return ints(r.stdout)


def act(k: Client, vm: str, action: int) -> List[int]:
    """Takes `action` in `vm`; what it observes after."""
    r = k.exec(vm, ["sh", "-c", f'echo "$ACTION" >>{STATE} && cat {STATE}'], env={"ACTION": str(action)}, timeout=60)
    if r.status != 0:
        raise RuntimeError(f"{vm}: the action exited {r.status}: {r.stderr!r}")
    return ints(r.stdout)


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
            state = observe(k, src)
            source_ms.append((time.monotonic() - t) * 1000)
            t = time.monotonic()
            kids = [c["id"] for c in k.fork(src, count=children)["children"]]
            made += kids
            observed: Dict[str, List[int]] = {}
            for i, kid in enumerate(kids):
                action = 100 * step + i
                t_exec = time.monotonic()
                got = act(k, kid, action)
                now = time.monotonic()
                child_exec_ms.append((now - t_exec) * 1000)
                if i == 0:
                    first_ms.append((now - t) * 1000)
                if got != state + [action]:
                    raise RuntimeError(
                        f"step {step}: {kid} observed {got}, not its source's {state} and its own action {action}"
                    )
                observed[kid] = got
            if observe(k, src) != state:
                raise RuntimeError(f"step {step}: the source {src} changed while its children acted")
            best = max(kids, key=lambda c: sum(observed[c]))
            for kid in kids:
                if kid != best:
                    k.delete(kid)
                    made.remove(kid)
            chosen.append(best)
            src = best
        final = observe(k, src)
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
    result = rollouts(Client(a.socket, timeout=120), a.source, a.steps, a.children)
    print("rollout:", json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
