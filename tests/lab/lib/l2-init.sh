#!/bin/busybox sh
# /init of the L2 guest (the Linux a VMM under test boots inside L1).
# Prints "LAB-GUEST init uptime=S" first (boot-to-init), loads the virtio
# modules listed in /modules.order, runs /guest.sh and powers off.
/bin/busybox mkdir -p /bin /proc /sys /dev /tmp
/bin/busybox mount -t proc proc /proc
read -r up _ </proc/uptime
/bin/busybox --install -s /bin
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1
echo "LAB-GUEST init uptime=$up"
# The boot's phases by the guest's own clock, for the lab's waterfall: the
# kernel log keeps every line whatever `quiet` hides from the console. Each
# is the first line that ends a phase.
dmesg | awk '
  function ts(l) { sub(/^\[ */, "", l); sub(/\].*/, "", l); return l }
  !p1 && /Linux version/ { print "LAB-GUEST phase 1-kernel-start=" ts($0); p1 = 1 }
  !p2 && /Calibrating delay loop|lpj=/ { print "LAB-GUEST phase 2-delay-calibrated=" ts($0); p2 = 1 }
  !p3 && /smp: Brought up/ { print "LAB-GUEST phase 3-smp-up=" ts($0); p3 = 1 }
  !p4 && /clocksource: Switched to clocksource/ { print "LAB-GUEST phase 4-clocksource-final=" ts($0); p4 = 1 }
  !p5 && /Freeing unused kernel image/ { print "LAB-GUEST phase 5-initcalls-done=" ts($0); p5 = 1 }
  !p6 && /Run \/init as init process/ { print "LAB-GUEST phase 6-init-started=" ts($0); p6 = 1 }'
# With initcall_debug on the command line: the slowest initcalls.
case " $(cat /proc/cmdline) " in
  *" initcall_debug "*)
    dmesg | sed -n 's/.*initcall \([^ ]*\) returned .* after \([0-9]*\) usecs.*/\2 \1/p' | sort -rn | head -n 15 |
      while read -r us fn; do echo "LAB-GUEST initcall ${us}us $fn"; done ;;
esac
mount -t sysfs sys /sys
mount -t tmpfs tmp /tmp
# Tools copied in with "# lab: l2-bins=" (at /usr/bin) come before busybox applets.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp
for m in $(cat /modules.order); do
  insmod "/modules/$m" || echo "LAB-GUEST insmod-failed $m"
done
# A heartbeat for L1's stall watchdog (lab_run_l2): a guest that runs and can
# print says so every 5 s, however long its script stays quiet.
(while sleep 5; do read -r up _ </proc/uptime; echo "LAB-GUEST hb uptime=$up"; done) &
hb=$!
echo "$hb" >/tmp/lab-hb.pid
sh /guest.sh
rc=$?
kill "$hb" 2>/dev/null
echo "LAB-GUEST end rc=$rc"
# lab.end=reboot on the kernel command line: end with a reboot instead.
case " $(cat /proc/cmdline) " in
  *" lab.end=reboot "*) echo "LAB-GUEST rebooting"; reboot -f ;;
esac
poweroff -f
sleep 10
