# The default L2 guest script (busybox sh, run by the guest's /init after its
# modules are loaded). A scenario overrides it with scenarios/<name>.guest.sh.
echo "LAB-GUEST nproc=$(nproc)"
echo "LAB-GUEST uname=$(uname -r)"
read -r up _ </proc/uptime
echo "LAB-GUEST uptime=$up"
devs=
for d in /sys/bus/virtio/devices/*; do
  [ -e "$d/device" ] && devs="$devs${devs:+,}$(basename "$d"):$(cat "$d/device")"
done
echo "LAB-GUEST virtio=${devs:-none}"
if [ -c /dev/hwrng ]; then
  echo "LAB-GUEST hwrng=$(cat /sys/class/misc/hw_random/rng_current) bytes=$(timeout 10 head -c 16 /dev/hwrng | wc -c)"
fi
