#!/usr/bin/env bash
# Start (or start again, after it died) the slurmd of namespaced node nI of `NETNS=1 start_local_slurm.sh`,
# inside its namespaces: network dora-nI, its own host name, /etc/hosts, /sys/class/net and boot id.
set -euo pipefail
i=$1; SHARED=/run/dora-slurm
# nsenter, not `ip netns exec`: the latter remounts /sys, hiding /sys/fs/cgroup from slurmd
nsenter --net=/var/run/netns/dora-n$i unshare --uts --mount --propagation private sh -c "
  mount --bind $SHARED/hosts /etc/hosts && mount --bind $SHARED/boot_id-n$i /proc/sys/kernel/random/boot_id &&
  mkdir -p $SHARED/sys-n$i && mount -t sysfs sysfs $SHARED/sys-n$i && mount --bind $SHARED/sys-n$i/class/net /sys/class/net &&
  hostname n$i && exec /usr/sbin/slurmd -N n$i"
