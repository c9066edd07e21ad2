"""Tally a stager's voluntary context switches (perf's sched:sched_switch with DWARF call chains, `perf script -F
comm,tid,event,trace,ip,sym` output on stdin) by what the thread waited in, and its waits for the GIL (take_gil)
by the call that had given the GIL back. Usage: python gil_waits.py OBJECTS < sw.txt"""
import collections
import sys

objects = int(sys.argv[1])
waits, gil = collections.Counter(), collections.Counter()
for block in sys.stdin.read().split("\n\n"):
    lines = block.strip().split("\n")
    if not lines or "sched_switch" not in lines[0] or "prev_state=R" in lines[0]:
        continue  # a preempted thread is not a wait
    syms = [ln.split(None, 1)[1].strip() if len(ln.split(None, 1)) > 1 else "" for ln in lines[1:]]
    what = next((k for s in syms for k in ("take_gil", "poll", "sem_", "PyThread_acquire_lock_timed") if k in s),
                "other")
    waits[what] += 1
    if what == "take_gil":
        i = max(j for j, s in enumerate(syms) if "take_gil" in s)
        gil[" < ".join(s.replace(" (inlined)", "") for s in syms[i + 1:i + 4])] += 1
print(f"voluntary switches: {sum(waits.values())} ({sum(waits.values()) / objects:.1f} per object)")
for k, v in waits.most_common():
    print(f"  {v:7d} {v / objects:5.2f}/object  {k}")
print("waits for the GIL, by the call that gave it back:")
for k, v in gil.most_common(12):
    print(f"  {v:7d} {v / objects:5.2f}/object  {k}")
