# boot-clock's L2 script: the guest's clock over 10 s after init, as two
# lines L1 stamps on arrival (/proc/uptime: CLOCK_BOOTTIME, which is
# CLOCK_MONOTONIC in a guest that never suspends).
read -r a _ </proc/uptime
echo "LAB-GUEST clock a=$a"
sleep 10
read -r b _ </proc/uptime
echo "LAB-GUEST clock b=$b"
