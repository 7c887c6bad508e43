# The guest of lab-stall: says it is up, then goes silent on purpose (its
# /init's heartbeat stopped, no more output) while it keeps running, as a
# guest whose serial path or workload hangs would look from L1.
echo "LAB-GUEST going-silent"
kill "$(cat /tmp/lab-hb.pid)" 2>/dev/null
sleep 600
