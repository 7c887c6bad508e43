# The guest of k7d-vmgenid (busybox sh on Debian's generic kernel, which has
# CONFIG_VMGENID=y). It says whether the kernel's vmgenid driver bound the
# VM Generation ID device k7d describes in its DSDT:
#   LAB-GUEST vmgenid-driver=bound|none
# then, each time its uptime reaches a multiple of 3 s, counts the kernel's
# "crng reseeded due to virtual machine fork" messages (the driver's reseed
# on a new ID) and then draws 16 bytes from /dev/urandom:
#   LAB-GUEST rng n=<n> forks=<messages before the draw> draw=<32 hex> end
# The count is taken before the draw, so a child whose first line shows one
# more message than its source had reseeded before that draw. The trailing
# " end" marks a complete line (a fork child's log may begin mid-line). It
# never returns: it draws until k7d stops the VM.
g() { echo "LAB-GUEST $*"; }

drv=none
for d in /sys/bus/acpi/drivers/vmgenid/*; do
  case $d in *VMGENCTR*) drv=bound ;; esac
done
g "vmgenid-driver=$drv"

n=0
# A bound, in case nothing stops the VM: ~ a day of draws. Between draws it
# sleeps until the next multiple of 3 s in one go (ten VMs share L1's one
# emulated CPU: no polling).
while [ "$n" -lt 30000 ]; do
  read -r up _ </proc/uptime
  cs=$(( ${up%.*} * 100 + 1${up#*.} - 100 ))
  d=$(( (cs / 300 + 1) * 300 - cs ))
  sleep "$((d / 100)).$(printf '%02d' $((d % 100)))"
  n=$((n + 1))
  forks=$(dmesg | grep -c 'virtual machine fork')
  draw=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  g "rng n=$n forks=$forks draw=$draw end"
done
