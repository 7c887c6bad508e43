# The guest of k7d-fork (busybox sh, run by the guest's /init after it loaded
# virtio_pci and virtio_blk). The VMM gives it /dev/vda, a 64 MiB raw image
# that starts all zeros. It never returns: it ticks until k7d stops the VM.
#
# Each tick, in this order:
#   prev  sector 0 of /dev/vda read back with O_DIRECT (what the device holds
#         before this tick writes: the counter of the tick before, or "none"
#         on a zeroed disk)
#   n     the counter (a shell variable in guest RAM) + 1, written as "n=<n>"
#         into sector 0 with O_DIRECT (dd conv=sync pads it to 512 bytes)
#   disk  sector 0 read back again with O_DIRECT (must be n)
#   up    /proc/uptime's first field (CLOCK_BOOTTIME, 10 ms resolution)
#   date  `date +%s` (the wall clock; busybox's date has no %N)
# then one line
#   LAB-GUEST tick n=<n> prev=<prev> disk=<disk> date=<date> up=<up> end
# and a 100 ms sleep. Every 10th tick also times `sleep 1` on /proc/uptime:
#   LAB-GUEST sleep1=<seconds> n=<n> end
# The trailing " end" marks a complete line: the scenario reads the serial logs
# while they grow, and a fork child's log can begin in the middle of a line.
#
# After a fork, source and child run this same loop from the same n, each on
# its own copy of the disk: in both, every tick must read prev = n-1 and
# disk = n. The scenario (k7d-fork.sh) tells the two apart by their serial logs.
# A failure is printed as "LAB-GUEST error ..." and the loop goes on.
g() { echo "LAB-GUEST $*"; }

[ -b /dev/vda ] || { g "error no /dev/vda (virtio-blk not bound: $(cd /sys/block && echo *))"; exit 1; }
g "vda-sectors=$(cat /sys/block/vda/size)"

# sector0: the counter sector 0 holds ("none": zeros; "bad": anything else).
sector0() {
  _s=$(dd if=/dev/vda bs=512 count=1 iflag=direct 2>/dev/null | tr -d '\000')
  case $_s in
    n=[0-9]*) _s=${_s#n=}; case $_s in *[!0-9]*) echo bad ;; *) echo "$_s" ;; esac ;;
    '') echo none ;;
    *) echo bad ;;
  esac
}

n=0
# A bound, in case nothing stops the VM: ~ an hour of ticks.
while [ "$n" -lt 30000 ]; do
  prev=$(sector0)
  n=$((n + 1))
  if ! printf 'n=%d\n' "$n" | dd of=/dev/vda bs=512 count=1 conv=sync,notrunc oflag=direct 2>/tmp/dd.err; then
    g "error writing n=$n to /dev/vda: $(grep -v records /tmp/dd.err | head -n1)"
  fi
  disk=$(sector0)
  read -r up _ </proc/uptime
  g "tick n=$n prev=$prev disk=$disk date=$(date +%s) up=$up end"
  if [ $((n % 10)) -eq 0 ]; then
    read -r a _ </proc/uptime
    sleep 1
    read -r b _ </proc/uptime
    g "sleep1=$(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", b - a}') n=$n end"
  fi
  sleep 0.1
done
