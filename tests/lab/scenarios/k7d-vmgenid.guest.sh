# The guest of k7d-vmgenid (busybox sh on Debian's generic kernel, which has
# CONFIG_VMGENID=y). It says whether the kernel's vmgenid driver bound the
# VM Generation ID device k7d describes in its DSDT:
#   LAB-GUEST vmgenid-driver=bound|none
# then, over and over: sleeps 3 s, says it begins draw n,
#   LAB-GUEST wake n=<n>
# counts the kernel's "crng reseeded due to virtual machine fork" messages
# (the driver's reseed on a new ID) and draws 16 bytes from /dev/urandom:
#   LAB-GUEST rng n=<n> forks=<messages before the draw> draw=<32 hex> end
# The count is taken before the draw, so a child whose first line shows one
# more message than its source had reseeded before that draw. A VM whose
# log ends with a complete rng line (no wake after it) is asleep: its next
# count and draw are still to come (the scenario pauses its source there
# for each fork). The trailing " end" marks a complete line (a fork child's
# log may begin mid-line). It never returns: it draws until k7d stops the
# VM. k7d-exec runs it too (on the cloud kernel, through its agent's exec:
# forks= stays 0 there, the agent's own log line marks its reseed), with
# NAP (default 3) the seconds of each sleep.
g() { echo "LAB-GUEST $*"; }

drv=none
for d in /sys/bus/acpi/drivers/vmgenid/*; do
  case $d in *VMGENCTR*) drv=bound ;; esac
done
g "vmgenid-driver=$drv"

n=0
# A bound, in case nothing stops the VM: ~ a day of draws. Each sleep is one
# process (ten VMs share L1's one emulated CPU: no polling). The 0.2 s after
# "wake" lets the line leave the UART (echo returns once the kernel holds
# it) before the count begins, so a source paused with no wake in its log
# had not begun counting.
while [ "$n" -lt 30000 ]; do
  sleep "${NAP:-3}"
  n=$((n + 1))
  g "wake n=$n"
  sleep 0.2
  forks=$(dmesg | grep -c 'virtual machine fork')
  draw=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  g "rng n=$n forks=$forks draw=$draw end"
done
