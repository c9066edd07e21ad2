#!/bin/sh
# in_memcg.sh BYTES CMD...: run CMD in a memory cgroup of its own limited to BYTES (page cache included), as a node
# whose memory is smaller than the dataset: cgroup v1 (/sys/fs/cgroup/memory) or v2 (memory.max). Root only; the
# cgroup is removed when CMD ends.
set -e
limit=$1; shift
if [ -d /sys/fs/cgroup/memory ]; then
    cg=/sys/fs/cgroup/memory/apl-memcg-$$; mkdir "$cg"; echo "$limit" > "$cg/memory.limit_in_bytes"
else
    cg=/sys/fs/cgroup/apl-memcg-$$; mkdir "$cg"; echo "$limit" > "$cg/memory.max"
fi
echo $$ > "$cg/cgroup.procs"
set +e
"$@"
rc=$?
echo $$ > "$(dirname "$cg")/cgroup.procs"
rmdir "$cg"
exit $rc
