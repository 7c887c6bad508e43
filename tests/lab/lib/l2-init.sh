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
sh /guest.sh
echo "LAB-GUEST end rc=$?"
# lab.end=reboot on the kernel command line: end with a reboot instead.
case " $(cat /proc/cmdline) " in
  *" lab.end=reboot "*) echo "LAB-GUEST rebooting"; reboot -f ;;
esac
poweroff -f
sleep 10
