"""Failure detection for one job (train.launch): rank exits in horovodrun's output, and node liveness (a heartbeat of
TCP connects to each node's sshd). When something failed and the job is still running ``grace`` seconds later,
every process carrying the job's id is killed on every node that answers (by PID), so the job always ends."""

from __future__ import annotations

import re
import shlex
import socket
import threading
import time
from collections.abc import Callable

from ..cluster import Cluster, Node
from ..errors import ApplianceError
from ..protocol import EXIT_STOPPED, Env
from ..remote import LocalRemote, Session, SSHRemote

# Output of a rank that failed *because another rank did* (so it is not the one to blame).
COLLATERAL = re.compile(r"Horovod has been shut down|HorovodInternalError|Connection closed by peer|"
                        r"Connection reset by peer|Broken pipe|gloo/transport|Read error \[")
PROBES_IN_FLIGHT = 16  # nodes the heartbeat probes, and the reaper clears, at once (Watch)

REAP_SCRIPT = r"""
id="$1"
for d in /proc/[0-9]*; do
  pid=${d#/proc/}
  if tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF "%s=$id"; then
    kill -9 "$pid" 2>/dev/null && echo "$pid"
  fi
done
true
""" % Env.JOB_ID


class Watch:
    """Failure detection for one job: rank exits and node liveness."""

    def __init__(self, cluster: Cluster, session: Session, job_id: str, grace: float, heartbeat: float,
                 say: Callable[[str], None]):
        self.cluster, self.session, self.job_id = cluster, session, job_id
        self.grace, self.heartbeat, self.say = grace, heartbeat, say
        self.failure: str | None = None
        self.failed_at: float | None = None
        self.exits: list[tuple[int, int]] = []  # (rank, status) in the order horovodrun reported them
        self.collateral: set[int] = set()  # ranks whose output shows they failed because a peer did
        self.own_status: dict[int, int] = {}  # exit status each rank reported itself (RANK_WRAPPER)
        self.own_order: list[int] = []  # ranks in the order their own exit reports arrived
        self.dead_nodes: set[str] = set()
        self.stop = threading.Event()  # set to abandon the head channel
        self.head_lost = threading.Event()  # the head stopped answering: the launcher reconnects (the job goes on)
        self.abandoned = False  # the launcher gave up reconnecting: the job may still be running
        self.paused = threading.Event()  # set while reconnecting: no liveness verdicts then
        self.done = threading.Event()
        self.reaped = False
        self._lock = threading.Lock()
        self._pool = None  # the heartbeat's probes (_probe)

    def fail(self, msg: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = msg
                self.failed_at = time.monotonic()
                self.say(f"[appliance] {msg}; stopping the job")

    def _describe(self, rank: int, code: int) -> str:
        hosts = self.cluster.rank_hosts()
        host = hosts[rank] if rank < len(hosts) else "?"
        code = self.own_status.get(rank, code)
        why = (f"rank {rank} on {host} ended the job as asked (status {code})" if code == EXIT_STOPPED else
               f"rank {rank} on {host} exited with status {code}")
        if code == 255 and rank not in self.own_status:
            why += f" (lost the SSH connection to {host})"
        return why

    def rank_exit(self, rank: int, code: int) -> None:
        self.exits.append((rank, code))
        self.fail(self._describe(rank, code))

    def own_exit(self, rank: int, code: int) -> None:
        self.own_status[rank] = code
        self.own_order.append(rank)

    def verdict(self) -> str | None:
        """The failure to report: the first rank that failed on its own, then the others.

        A rank's own report (RANK_WRAPPER) arrives before horovodrun's exit line for it, so the first nonzero own
        report from a rank that did not fail because of a peer names the culprit. When every rank we heard from
        failed because of a peer, the culprit is a rank horovodrun stopped before it could report: name it.
        """
        if not self.exits:
            return self.failure
        failing = [r for r in self.own_order if self.own_status[r] != 0] + [r for r, _ in self.exits]
        failing = list(dict.fromkeys(failing))
        own = [r for r in failing if r not in self.collateral]
        codes = dict((r, c) for r, c in reversed(self.exits))
        if own:
            first = own[0]
            msg = self._describe(first, codes.get(first, self.own_status.get(first, 1)))
        else:
            quiet = [r for r in range(self.cluster.world_size)
                     if r not in self.collateral and self.own_status.get(r, 1) != 0]
            first = failing[0]
            msg = self._describe(first, codes.get(first, 1))
            if quiet:
                hosts = self.cluster.rank_hosts()
                first = quiet[0]
                host = hosts[first] if first < len(hosts) else "?"
                msg = (f"rank {first} on {host} failed first (its exit status was lost when horovodrun stopped "
                       f"it; the other ranks failed because of it)")
        if self.failure and self.failure.startswith("node "):
            msg = f"{self.failure}; {msg}"
        rest = [(r, c) for r, c in self.exits if r != first]
        if rest:
            msg += " (then " + ", ".join(f"rank {r}: status {c}" for r, c in rest) + ")"
        return msg

    def _node_alive(self, node: Node) -> bool:
        if node.address is None:
            return True
        head = self.session.head
        if node.via_head and isinstance(head, SSHRemote):
            try:
                ch = head.transport.open_channel("direct-tcpip", (node.address, node.port), ("127.0.0.1", 0),
                                                 timeout=3)
                ch.close()
                return True
            except Exception:
                return False
        try:
            with socket.create_connection((node.address, node.port), timeout=3):
                return True
        except OSError:
            return False

    def _probe(self, nodes: list[Node]) -> list[bool]:
        """Whether each node answers, PROBES_IN_FLIGHT at a time: a node that does not costs its 3 s timeout once
        a round, not once for every node checked after it (a round over 64 nodes took 64 round trips in turn)."""
        if len(nodes) <= 1:
            return [self._node_alive(n) for n in nodes]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=PROBES_IN_FLIGHT, thread_name_prefix="appliance-heartbeat")
        return list(self._pool.map(self._node_alive, nodes))

    def _round(self, misses: dict[str, int]) -> None:
        """One heartbeat: the head first (the workers are reached through it), then every worker at once; the
        first node missed twice in a row fails the job."""
        head = self.cluster.head
        remote_head = not isinstance(self.session.head, LocalRemote)
        if remote_head:
            if self._probe([head])[0]:
                misses[head.name] = 0
            else:
                # the launcher's link to the head (or the head itself) is down: the detached job may well go on;
                # the launcher reconnects and decides then. Workers are reached through the head: no verdict on
                # them this round
                misses[head.name] = misses.get(head.name, 0) + 1
                if misses[head.name] >= 2:
                    misses[head.name] = 0
                    self.head_lost.set()
                    self.stop.set()
                return
        nodes = [n for n in self.cluster.nodes if not (remote_head and n is head)]
        alive = self._probe(nodes)
        if self.paused.is_set():  # a reconnect began meanwhile: no verdicts from this round
            return
        for node, ok in zip(nodes, alive):
            misses[node.name] = 0 if ok else misses.get(node.name, 0) + 1
        for node in nodes:
            if misses[node.name] >= 2:
                self.dead_nodes.add(node.name)
                ranks = [r for r, h in enumerate(self.cluster.rank_hosts()) if h == node.name]
                self.fail(f"node {node.name} stopped answering (ranks {', '.join(map(str, ranks))})")
                return

    def run(self) -> None:
        misses: dict[str, int] = {}
        try:
            while not self.done.wait(self.heartbeat if self.failure is None else 0.5):
                if self.failure is None:
                    if not self.paused.is_set():  # a reconnect: no verdicts, and nothing failed to reap
                        self._round(misses)
                elif time.monotonic() - self.failed_at > self.grace and not self.reaped:
                    self.reap()
                    self.stop.set()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def reap(self) -> None:
        """Kill this job's processes on every node that answers (matched by job id, killed by PID), on
        PROBES_IN_FLIGHT nodes at once: one that hangs holds up only itself, for its 15 s."""
        from concurrent.futures import ThreadPoolExecutor

        self.reaped = True
        cmd = f"sh -c {shlex.quote(REAP_SCRIPT)} reap {shlex.quote(self.job_id)}"
        targets = [(name, remote) for name, remote in self.session.remotes.items() if name not in self.dead_nodes]

        def one(target) -> int:
            try:
                return len(target[1].run(cmd, timeout=15).out.split())
            except ApplianceError:
                return 0

        if not targets:
            return
        with ThreadPoolExecutor(max_workers=min(PROBES_IN_FLIGHT, len(targets))) as ex:
            for (name, _), n in zip(targets, ex.map(one, targets)):
                if n:
                    self.say(f"[appliance] killed {n} leftover process(es) of the job on {name}")
