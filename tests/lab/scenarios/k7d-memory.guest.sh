# The guest of k7d-memory (busybox sh, run by /init): says it is up, then
# stays idle (the scenario measures the daemon with it running, then deletes
# the VM).
echo "LAB-GUEST idle nproc=$(nproc)"
while :; do sleep 3600; done
