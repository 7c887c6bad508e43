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
