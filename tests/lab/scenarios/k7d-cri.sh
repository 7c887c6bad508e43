# lab: description=containerd 1.6 in L1 with its CRI plugin and CNI (bridge): one two-container pod driven by k7d-cri (the kubelet's calls) under the runtime handler runc (the reference), then k7d (one pod VM for the pod), then two pods that talk (ping, 4 MiB over TCP) under runc and under k7d (a fork-started and a warm-pool pod VM, NICs on the direct datapath), then the pod again forked from the node's template and claimed from the warm pool; step and pod start/delete times side by side; nothing left after
# lab: default=yes
# lab: timeout=1200
# lab: bin=required
# lab: cri-bin=required
# lab: pod-initramfs=required
# lab: prepare=k7d-shim k7d-cri
# lab: l1-bins=containerd ctr containerd-shim-runc-v2 runc mkfs.erofs
# lab: l1-debs=containernetworking-plugins:usr/lib/cni/bridge containernetworking-plugins:usr/lib/cni/host-local containernetworking-plugins:usr/lib/cni/loopback
# lab: l1-modules=overlay bridge veth tun sch_ingress cls_bpf act_mirred
#
# containerd (Debian's 1.6) runs in L1 with the CRI plugin on, as a node of
# a Kubernetes cluster runs it, with two runtime handlers:
#   runc  io.containerd.runc.v2 (the reference; NoPivotRoot: L1's root is the
#         initramfs, which pivot_root cannot leave)
#   k7d   io.containerd.k7d.v2 (the k7d binary as containerd-shim-k7d-v2, the
#         k7d daemon, the pod VM booted from $LAB_KERNEL and the pod initramfs)
# CNI: Debian's containernetworking-plugins (bridge, host-local; loopback for
# the pod's lo, which containerd adds itself), fetched into the lab cache and
# copied to /usr/lib/cni (l1-debs); one conflist, a bridge cni0 on
# 10.88.0.0/16. No registry: the sandbox image (k7d-cri.prepare.sh's
# busybox "pause") and the containers' image (k7d-shim.prepare.sh's busybox)
# are imported into the k8s.io namespace; sandbox_image names the first.
# k7d-cri (tests/cri, --cri-bin) is the kubelet: for each pod it runs
# RunPodSandbox, CreateContainer x2 (A: a-started then a tick a second; B:
# b-started then sleep), StartContainer x2, A's first CRI log line, ExecSync
# in A (the image's marker file; uname -r: L1's kernel under runc, the L2
# kernel under k7d), ContainerStatus (both RUNNING), the log lines, then
# StopPodSandbox, RemovePodSandbox and the lists (the pod and its containers
# gone), each step timed. Both containers must see one kernel boot id: L1's
# under runc; under k7d one that is not L1's, a new one per pod, with one VM
# listed by the daemon while the pod lives (its app containers joined the
# sandbox's VM). Pods: runc, k7d.
# The pod network (k7d-cri net): a server pod (4 MiB of random data behind
# busybox httpd) and a client pod at once, under runc, then under k7d: the
# client pings the server's pod address 3/3 and fetches the file, sums
# equal. Under k7d each pod VM's NIC sits on its pod's CNI eth0 through
# k7d's datapath (shim.toml's default, auto) and the daemon must report
# "datapath: direct" for both VMs while they live.
# Pods started by fork (io.k7d.pod-start=fork) and from the warm pool
# (io.k7d.pod-start=pool, pool_size = 1, filled by `k7d pool-fill`): the
# net pair under k7d (the server boots the node's template and is forked
# from it, the client claims the pool's member; each pod's address,
# hostname, MAC, 16 bytes of /dev/urandom, boot id and machine-id differ;
# the pool refills itself), the net pair again with both pods forked from
# the one template (the same identity checks, fork against fork), then
# the two-container pod again, forked from the paused
# template (listed among its fork children), then claimed from the pool.
# Metrics: each pod's steps (ms), pod start (RunPodSandbox until A's first
# log line) and pod delete (Stop + Remove) in s, k7d's over runc's, and the
# fork-started and pool pods' over runc's and over the cold k7d pod's.
# Afterwards: no pod sandbox, no container, no task, no shim process, no k7d
# VM, no network namespace, no pod address left in host-local.
# By hand: cargo build --release -p k7d-vmm -p k7d-agent -p k7d-cri, then
#   tests/lab/run.sh --bin target/release/k7d --agent target/release/k7d-agent --cri-bin target/release/k7d-cri k7d-cri
# LAB_CRI_HANDLERS="runc" runs the reference pod only (the harness's own check).
. /lab/lib.sh

IMG=docker.io/library/k7d-busybox:1
PAUSE=docker.io/library/k7d-pause:1
SOCK=/run/k7d/k7d.sock STATE=/run/k7d/state
CLOG=/tmp/containerd.log DLOG=/tmp/k7d-daemon.log
STEP_LIMIT=${LAB_CRI_STEP_TIMEOUT:-120}  # per CRI step, seconds
HANDLERS=${LAB_CRI_HANDLERS:-runc k7d}
# LAB_CRI_JAIL is the k7d daemon's --jail: on (the default, k7d's), every
# pod VM (cold, pool, fork-started) and the template in a jailed VM process
# of its own (issue 36); off (by hand), every pod VM inside the daemon.
JAIL=${LAB_CRI_JAIL:-on}
CRI=$LAB_CRI_BIN

# cri_live LABEL OUT CMD...: runs CMD with its output kept in OUT and
# printed as it comes ("lab: LABEL: ..."), so a step that hangs shows on
# the console where it hangs (a run that printed nothing for 180 s is
# stopped by the host's silence watchdog with no trace: CI on d799449);
# returns CMD's status.
cri_live() {
  _ll=$1 _lo=$2
  shift 2
  rm -f "$_lo.rc"
  { "$@" 2>&1; echo $? >"$_lo.rc"; } | tee "$_lo" | while IFS= read -r _line; do echo "lab: $_ll: $_line"; done
  return "$(cat "$_lo.rc" 2>/dev/null || echo 125)"
}

# fail REASON: what containerd, CRI and the daemon say, the tails of their
# logs and of the pod VMs' consoles, then LAB-FAIL.
fail() {
  for _p in /proc/[0-9]*; do  # every shim left: where it waits
    case $(cat "$_p/cmdline" 2>/dev/null | tr '\0' ' ') in
      *containerd-shim*)
        echo "lab: pid ${_p#/proc/} ($(cat "$_p/wchan" 2>/dev/null), $(sed -n 's/^State:\t//p' "$_p/status")): $(tr '\0' ' ' <"$_p/cmdline" | cut -c1-200)" ;;
    esac
  done
  [ ! -S /run/containerd/containerd.sock ] || timeout -s KILL 20 "$CRI" list 2>&1 | sed 's/^/lab: /'
  for _f in "$CLOG" "$DLOG" "$STATE"/vms/*/serial.log; do
    [ -s "$_f" ] || continue
    echo "lab: $_f (tail):"
    tail -n 40 "$_f" | sed 's/^/lab:   /'
  done
  lab_fail "$*"
}

[ -x "${LAB_BIN:-}" ] || fail "no binary under test (run.sh --bin PATH)"
[ -x "${CRI:-}" ] || fail "no CRI client (run.sh --cri-bin PATH: target/release/k7d-cri)"
[ -s /lab/files/busybox-oci.tar ] || fail "no /lab/files/busybox-oci.tar (prepare=k7d-shim)"
[ -s /lab/files/pause-oci.tar ] || fail "no /lab/files/pause-oci.tar (prepare=k7d-cri)"
[ -s "${LAB_POD_INITRD:-}" ] || fail "no pod initramfs at '${LAB_POD_INITRD:-}' (pod-initramfs=required, run.sh --agent PATH)"
for _p in bridge host-local loopback; do
  [ -x "/usr/lib/cni/$_p" ] || fail "no CNI plugin /usr/lib/cni/$_p (l1-debs)"
done

# --- containerd with CRI --------------------------------------------------------
lab_cgroup2
mkdir -p /etc/containerd /var/lib/containerd /run/containerd /usr/local/bin /etc/k7d /run/k7d /etc/cni/net.d /var/log/pods
# containerd copies the node's /etc/hosts into each pod; the initramfs has none.
[ -e /etc/hosts ] || printf '127.0.0.1 localhost\n' >/etc/hosts
[ -e /etc/resolv.conf ] || : >/etc/resolv.conf
# One network (containerd reads the first file of conf_dir only): a bridge,
# the node's gateway on it, addresses from host-local; no masquerade (no
# iptables in L1). The pod's lo comes from the loopback plugin, which
# containerd runs itself.
cat >/etc/cni/net.d/10-k7d-lab.conflist <<'EOF'
{
  "cniVersion": "0.4.0",
  "name": "k7d-lab",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "10.88.0.0/16"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF
cat >/etc/containerd/config.toml <<EOF
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE"
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        NoPivotRoot = true
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.k7d]
      runtime_type = "io.containerd.k7d.v2"
      privileged_without_host_devices = true
      pod_annotations = ["io.k7d.*"]
      container_annotations = ["io.k7d.*"]
    # A RuntimeClass whose pods are fork-started: the same shim with its
    # own config (runtimeoptions ConfigPath, as Kata's entries name theirs).
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.k7d-fork]
      runtime_type = "io.containerd.k7d.v2"
      privileged_without_host_devices = true
      pod_annotations = ["io.k7d.*"]
      container_annotations = ["io.k7d.*"]
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.k7d-fork.options]
        ConfigPath = "/etc/k7d/fork.toml"
EOF
# containerd finds shims on its PATH: containerd-shim-k7d-v2 is in /usr/local/bin.
ln -sf "$LAB_BIN" /usr/local/bin/containerd-shim-k7d-v2
t0=$(lab_now)
PATH=/usr/local/bin:$PATH /usr/bin/containerd --config /etc/containerd/config.toml >"$CLOG" 2>&1 &
cpid=$!
i=0
# Ready: ctr answers and the CRI plugin serves its runtime service.
until [ -S /run/containerd/containerd.sock ] && ctr version >/dev/null 2>&1 && "$CRI" list >/tmp/cri-list.out 2>&1; do
  kill -0 "$cpid" 2>/dev/null || fail "containerd exited at start"
  i=$((i + 1))
  [ "$i" -lt 120 ] || fail "containerd's CRI did not answer within 60 s: $(tail -n 2 /tmp/cri-list.out | tr '\n' ' ')"
  sleep 0.5
done
lab_metric containerd.start_s "$(lab_sub "$(lab_now)" "$t0")" s
ctr plugins ls | grep -E '^io\.containerd\.grpc\.v1 +cri .* ok' >/dev/null ||
  fail "containerd's CRI plugin is not ok: $(ctr plugins ls | grep cri)"
ctr plugins ls | grep -E '^io\.containerd\.snapshotter\.v1 +overlayfs .* ok' >/dev/null ||
  fail "containerd's overlayfs snapshotter is not ok: $(ctr plugins ls | grep overlayfs)"
# import FILE BASE: an OCI archive into k8s.io, where CRI finds its images.
import() {
  /usr/bin/ctr -n k8s.io images import --base-name "$2" "/lab/files/$1" >/tmp/import.log 2>&1 ||
    fail "ctr -n k8s.io images import $1 failed: $(tail -n 3 /tmp/import.log | tr '\n' ' ')"
}
import busybox-oci.tar docker.io/library/k7d-busybox
import pause-oci.tar docker.io/library/k7d-pause
for _r in "$IMG" "$PAUSE"; do
  ctr -n k8s.io images ls -q | grep -qx "$_r" || fail "$_r is not listed after the import: $(ctr -n k8s.io images ls -q | tr '\n' ' ')"
done
lab_note "containerd $(ctr version 2>/dev/null | sed -n 's/^ *Version: *//p' | tail -n1) with CRI: $IMG and the sandbox image $PAUSE imported into k8s.io; CNI bridge + host-local (Debian's containernetworking-plugins in /usr/lib/cni)"

# --- pods ---------------------------------------------------------------------------
# cri_pod LABEL HANDLER KERNEL: k7d-cri pod under HANDLER (the pod and its
# log directory named after LABEL); its output on the console; KERNEL: the
# uname -r the exec must print. Metrics per step (ms) and the pod's start
# and delete (s); sets START_<label> and DELETE_<label> (s), BOOT_ID (the
# kernel boot id both containers saw) and, for k7d, VMS_MAX (the most k7d
# VMs the daemon listed while the pod lived, polled every second).
# The cold k7d pod also goes through the kubelet's stats calls (k7d-cri pod
# --stats: container B writes 64 MiB, its ContainerStats working set must
# show it, from the pod VM's guest cgroup; the same check passes under runc,
# left out of CI for time: 4.5 s of L1).
# Limits as under runc (issue 38): in the runc pod and the cold k7d pod,
# container B runs as uid 65534 and reports ulimit -a and the kernel's
# process and file limits it reads (k7d-cri pod --limits-out under runc,
# --limits-like under k7d: equal line by line), then starts 1 000 processes.
cri_pod() {
  _l=$1 _h=$2 _k=$3 _ps=${4:-}
  case $_l in k7d) _st=--stats ;; *) _st= ;; esac
  case $_l in
    runc) _lim="--limits-out /tmp/limits.runc" ;;
    k7d) _lim="--limits-like /tmp/limits.runc" ;;
    *) _lim= ;;
  esac
  echo "lab: $_l: k7d-cri pod --runtime-handler $_h${_ps:+ --pod-start $_ps}"
  rm -f /tmp/vms.max /tmp/forked.seen "/tmp/ids-$_l.seen" "/tmp/ram-$_l.seen" "/tmp/ram-$_l.why" "/tmp/ram-$_l.released"
  _clines=$(wc -l <"$CLOG")
  _hold=
  if [ "${_h%%-*}" = k7d ]; then
    # k7d-cri holds the idle pod after its exec until the poll below has
    # taken its guest RAM (or tried 5 times): a pod whose life after the
    # exec is shorter than a poll is measured all the same.
    _hold="--hold-until /tmp/ram-$_l.released"
    ( _m=0 _tries=0
      while :; do
        _n=$("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | tail -n +2 | grep -c .)
        [ "$_n" -le "$_m" ] || { _m=$_n; echo "$_m" >/tmp/vms.max; }
        # A fork template's live children (k7d info: "fork children: ...").
        for _t in $("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | awk '$1 ~ /^tmpl-/ {print $1}'); do
          "$LAB_BIN" --socket "$SOCK" info "$_t" 2>/dev/null | sed -n "s/^ *fork children: /$_t /p" >>/tmp/forked.seen
        done
        # Each VM's machine-id, as in cri_net (ids.seen).
        for _v in $("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | tail -n +2 | awk '{print $1}'); do
          grep -ho 'identity: entropy [0-9]* bytes, machine-id [0-9a-f]*' "$STATE/vms/$_v/serial.log" 2>/dev/null |
            sed "s/^.*machine-id /$_v /" >>"/tmp/ids-$_l.seen"
        done
        # The pod VM's guest RAM once, idle: after the exec that follows
        # the pod's start (A ticking, B asleep), before anything else.
        if [ ! -e "/tmp/ram-$_l.released" ] && grep -q '^cri: exec uname -r' "/tmp/cri-$_l.out" 2>/dev/null; then
          _tries=$((_tries + 1))
          # (Each poll's answers, for the failure: bounded by the pod's life.)
          for _v in $("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | tail -n +2 | awk '$1 !~ /^tmpl-/ {print $1}'); do
            "$LAB_BIN" --socket "$SOCK" --json info "$_v" >/tmp/ram-info.json 2>&1 ||
              { echo " $_v: info failed: $(head -c 200 /tmp/ram-info.json | tr '\n' ' ')" >>"/tmp/ram-$_l.why"; continue; }
            grep -q "\"pod_name\": *\"$_l\"" /tmp/ram-info.json ||
              { echo " $_v: $(grep -o '"pod_[a-z]*": *[^,]*' /tmp/ram-info.json | tr '\n' ' ')" >>"/tmp/ram-$_l.why"; continue; }
            "$LAB_BIN" --socket "$SOCK" --json guest-ram "$_v" >/tmp/ram.json 2>&1 ||
              { echo " $_v: guest-ram failed: $(head -c 200 /tmp/ram.json | tr '\n' ' ')" >>"/tmp/ram-$_l.why"; continue; }
            echo "$_v $(for _k in resident copied pss; do sed -n "s/.*\"$_k\": *\([0-9]*\).*/\1/p" /tmp/ram.json | head -n1; done | tr '\n' ' ')" >"/tmp/ram-$_l.seen"
          done
          { [ -s "/tmp/ram-$_l.seen" ] || [ "$_tries" -ge 5 ]; } && touch "/tmp/ram-$_l.released"
        fi
        sleep 1
      done ) &
    _vpoll=$!
    # LAB_CRI_RAM_TIMELINE=1 (by hand): a fork-started pod's copies over
    # its start (issue 38: where the copy-on-write storm comes from): its
    # VM's guest RAM copied, every ~0.2 s, with the last CRI step done at
    # that moment. By hand only: each sample is a k7d process and an smaps
    # walk of the daemon on L1's emulated CPU, which slows the very start
    # it watches (k7d_fork.pod_start_vs_cold 1.24 with it, against 0.5-0.9).
    if [ "$_l" = k7d-fork ] && [ "${LAB_CRI_RAM_TIMELINE:-}" = 1 ]; then
      rm -f "/tmp/ramtl-$_l"
      ( while :; do
          for _v in $("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | awk '$1 ~ /^pod-/ {print $1}'); do
            _c=$("$LAB_BIN" --socket "$SOCK" --json guest-ram "$_v" 2>/dev/null | sed -n 's/.*"copied": *\([0-9]*\).*/\1/p' | head -n1)
            [ -n "$_c" ] || continue
            echo "$(cut -d' ' -f1 /proc/uptime) $_c $(grep '^cri: step ' "/tmp/cri-$_l.out" 2>/dev/null | tail -n1 | cut -d' ' -f3)" >>"/tmp/ramtl-$_l"
          done
          sleep 0.2
        done ) &
      _rpoll=$!
    fi
  fi
  cri_live "$_l" "/tmp/cri-$_l.out" timeout -s KILL $((STEP_LIMIT * 16)) "$CRI" pod --runtime-handler "$_h" --image "$IMG" --name "$_l" \
    --log-dir "/var/log/pods/k7d-lab_$_l" --timeout-s "$STEP_LIMIT" ${_ps:+--pod-start "$_ps"} $_st $_lim $_hold
  _rc=$?
  [ -z "${_vpoll:-}" ] || { kill "$_vpoll"; wait "$_vpoll" 2>/dev/null; _vpoll=; }
  [ -z "${_rpoll:-}" ] || { kill "$_rpoll"; wait "$_rpoll" 2>/dev/null; _rpoll=; }
  VMS_MAX=$(cat /tmp/vms.max 2>/dev/null || echo 0)
  [ "$_rc" = 0 ] || fail "$_l: k7d-cri pod (handler $_h) exited $_rc: $(grep -v '^cri: step ' "/tmp/cri-$_l.out" | tail -n 2 | tr '\n' ' ')"
  _got=$(sed -n 's/^cri: exec uname -r: //p' "/tmp/cri-$_l.out")
  [ "$_got" = "$_k" ] || fail "$_l: uname -r in the pod's container is '$_got', expected $_k"
  BOOT_ID=$(sed -n 's/^cri: exec boot id (A and B): //p' "/tmp/cri-$_l.out")
  [ -n "$BOOT_ID" ] || fail "$_l: k7d-cri printed no boot id"
  _ipc=$(sed -n 's/^cri: exec IPC namespace (A and B): //p' "/tmp/cri-$_l.out")
  [ -n "$_ipc" ] || fail "$_l: k7d-cri printed no shared IPC namespace"
  sed -n 's/^cri: step \([a-z_]*\) \([0-9]*\) ms$/\1 \2/p' "/tmp/cri-$_l.out" >"/tmp/cri-$_l.steps"
  while read -r _s _ms; do lab_metric "$_l.$_s" "$_ms" ms; done <"/tmp/cri-$_l.steps"
  _start=$(sed -n 's/^cri: pod start \([0-9]*\) ms, pod delete \([0-9]*\) ms.*/\1/p' "/tmp/cri-$_l.out")
  _del=$(sed -n 's/^cri: pod start \([0-9]*\) ms, pod delete \([0-9]*\) ms.*/\2/p' "/tmp/cri-$_l.out")
  [ -n "$_start" ] && [ -n "$_del" ] || fail "$_l: k7d-cri printed no pod start/delete line"
  _start=$(awk -v m="$_start" 'BEGIN {printf "%.2f", m / 1000}')
  _del=$(awk -v m="$_del" 'BEGIN {printf "%.2f", m / 1000}')
  lab_metric "$_l.pod_start" "$_start" s
  lab_metric "$_l.pod_delete" "$_del" s
  eval "START_$(echo "$_l" | tr - _)=\$_start DELETE_$(echo "$_l" | tr - _)=\$_del"
  if [ -n "$_st" ]; then
    _stats=$(sed -n 's/^cri: stats: //p' "/tmp/cri-$_l.out" | tr '\n' ';')
    [ -n "$_stats" ] || fail "$_l: k7d-cri pod --stats printed no stats"
    lab_note "$_l: the kubelet's stats calls (B wrote 64 MiB): $_stats"
  fi
  if [ -n "$_lim" ]; then
    _np=$(sed -n 's/^cri: limits: uid 65534 ran \([0-9]*\) processes at once.*/\1/p' "/tmp/cri-$_l.out")
    [ -n "$_np" ] || fail "$_l: k7d-cri pod printed no process count"
    lab_note "$_l: B (uid 65534): $(sed -n 's/^cri: limits: \(.*\(process\|files\|threads-max\).*\)/\1/p' "/tmp/cri-$_l.out" | tr -s ' ' | tr '\n' ';')$(grep -q '^cri: limits: all [0-9]* lines as in' "/tmp/cri-$_l.out" && echo '; every line equal to runc'\''s')"
  fi
  lab_note "$_l (handler $_h): pod sandbox, 2 containers started, A's first log line, ExecSync (the image's marker; uname -r $_got; A and B in IPC namespace $_ipc), both RUNNING, the logs, stopped and removed: pod start ${_start} s, pod delete ${_del} s"
  # Where a k7d pod's sandbox create went (the shim's phase lines).
  _ph=$(tail -n +"$((_clines + 1))" "$CLOG" | grep -oE '(pod VM of [0-9a-f]+ created|pod-[0-9a-f]+ forked from|pool-[0-9a-f]+-[0-9]+ claimed)[^"]*' | sed 's/^pod VM of [0-9a-f]* //' | tr '\n' ';')
  [ -z "$_ph" ] || lab_note "$_l: the sandbox's pod VM: $_ph"
  # The pod VM's own part of the pod start: the shim's top-level phases of the
  # sandbox's create summed (prepare, vm, agent, setup, container; not the
  # parenthesised parts of a phase). What a fork or a pool claim changes, where
  # the whole pod start also holds containerd, CNI and each app container's
  # create in the guest (noisy on an emulated machine; issue 38's copy-on-write
  # first touch in a fork child).
  if [ "${_h%%-*}" = k7d ]; then
    _vc=$(printf '%s' "$_ph" | sed -n 's/.*created ([a-z]*): \([^;]*\).*/\1/p' | sed 's/([^)]*)//g' |
      awk '{s = 0; n = 0; for (i = 1; i < NF; i++) if ($(i + 1) ~ /^ms,?$/) {s += $i; n++}} END {if (n >= 5) printf "%.2f", s / 1000}')
    [ -n "$_vc" ] || fail "$_l: no 'created (...): prepare .. ms, vm .. ms, agent .. ms, setup .. ms, container .. ms' line from the shim for the sandbox's pod VM: '$_ph'"
    lab_metric "$_l.pod_vm_create" "$_vc" s
  fi
  # And each app container's create in it (image, medium changes, the agent's create).
  _ph=$(tail -n +"$((_clines + 1))" "$CLOG" | grep -oE 'joined the pod VM [^:]*: [^"]*' | sed 's/^joined the pod VM [^:]*: //' | tr '\n' ';')
  [ -z "$_ph" ] || lab_note "$_l: its app containers' creates: $_ph"
  [ "${_h%%-*}" != k7d ] || stop_phases "$_l"
  [ "${_h%%-*}" != k7d ] || guest_ram "$_l"
  # The copy timeline: seconds since the first sample, MiB copied, the
  # last CRI step done by then (one entry per change of either).
  [ ! -s "/tmp/ramtl-$_l" ] || lab_note "$_l: its pod VM's guest RAM copied over the pod's start (s since the VM's first sample: MiB copied, after the CRI step): $(awk 'NR == 1 {t0 = $1} {m = sprintf("%.1f", $2 / 1048576); k = m " " $3} k != last {printf "%.1f: %s MiB after %s; ", $1 - t0, m, ($3 == "" ? "-" : $3); last = k}' "/tmp/ramtl-$_l")"
}

# guest_ram LABEL: what the idle pod VM's guest RAM cost L1 (issue 38,
# density; k7d guest-ram, from the daemon's smaps): resident, its
# own copies (a fork-started pod's pages written since the fork; the rest
# of what it maps is shared with its template) and PSS, in MiB; sets
# RAMPSS_<label> (MiB). The VMM's own per-VM memory (threads, device
# buffers) is not in it: the cold pod's daemon growth in k7d-shim has both.
guest_ram() {
  # (Cleared first: a read from a missing file leaves the last pod's figures.)
  _rv= _rr= _rc= _rp=
  read -r _rv _rr _rc _rp <"/tmp/ram-$1.seen" 2>/dev/null
  [ -n "${_rp:-}" ] || fail "$1: no guest RAM figures of its pod VM while the pod lived (k7d --json guest-ram): $(head -n 5 "/tmp/ram-$1.why" 2>/dev/null | tr '\n' '|') ($(cat "/tmp/ram-$1.seen" 2>/dev/null))"
  _mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
  lab_metric "$1.guest_ram_resident_mib" "$(_mib "$_rr")" MiB
  lab_metric "$1.guest_ram_copied_mib" "$(_mib "$_rc")" MiB
  lab_metric "$1.guest_ram_pss_mib" "$(_mib "$_rp")" MiB
  # (Only a fork child shares pages with a base; a cold or pool VM's RAM
  # is its own memfd's.)
  case $1 in
    *fork*) _sh=" ($(awk -v r="$_rr" -v c="$_rc" 'BEGIN {printf "%.0f", (r > 0 ? (r - c) * 100 / r : 0)}') % shared with its template)" ;;
    *) _sh= ;;
  esac
  lab_note "$1: its idle pod VM $_rv's guest RAM: $(_mib "$_rr") MiB resident, $(_mib "$_rc") MiB of them its own copies$_sh, PSS $(_mib "$_rp") MiB"
  eval "RAMPSS_$(echo "$1" | tr - _)=\$(_mib \"\$_rp\")"
}

# _ctime TEXT: the time of day (s) of the first containerd log line since
# this pod's start that contains TEXT; empty if none.
# The line's first well-formed stamp: containerd's log has two writers (its
# own logger and the shims' log copier), and a line may start with the
# other's torn bytes ('time="time="2026-...', seen in a CI run).
_ctime() {
  tail -n +"$((_clines + 1))" "$CLOG" | grep -F -m1 -- "$1" |
    grep -o 'time="[0-9-]*T[0-9]*:[0-9]*:[0-9.]*' | head -n1 |
    sed -n 's/^time="[0-9-]*T\([0-9]*\):\([0-9]*\):\([0-9.]*\)$/\1 \2 \3/p' |
    awk '{printf "%.3f\n", $1 * 3600 + $2 * 60 + $3}'
}

# stop_phases LABEL: where a k7d pod's StopPodSandbox went, from containerd's
# log: its app containers' stops (containerd kills each and waits for its
# exit and delete), then k7d's own part (from the shim's "the sandbox is
# killed", where the daemon removes the pod VM with no guest call, to
# containerd seeing the shim gone), then containerd's network teardown.
stop_phases() {
  _id=$(tail -n +"$((_clines + 1))" "$CLOG" | sed -n 's/.*StopPodSandbox for \\"\([0-9a-f]*\)\\".*/\1/p' | head -n1)
  [ -n "$_id" ] || fail "$1: no StopPodSandbox in containerd's log"
  _t0=$(_ctime "StopPodSandbox for \\\"$_id")
  _tk=$(_ctime "$_id: the sandbox is killed")
  _tg=$(_ctime "shim disconnected\" id=$_id")
  _t1=$(_ctime "StopPodSandbox for \\\"$_id\\\" returns")
  [ -n "$_t0" ] && [ -n "$_tk" ] && [ -n "$_tg" ] && [ -n "$_t1" ] ||
    fail "$1: StopPodSandbox's steps not all in containerd's log (start '$_t0', the sandbox killed '$_tk', its shim gone '$_tg', returned '$_t1')"
  # Differences of times of day: a run across midnight adds a day.
  _phases=$(awk -v a="$_t0" -v k="$_tk" -v g="$_tg" -v b="$_t1" 'function d(x, y) {return (y < x ? y + 86400 - x : y - x)}
    BEGIN {printf "%.2f %.2f %.2f %.2f", d(a, k), d(k, g), d(g, b), d(a, b)}')
  set -- "$1" $_phases
  lab_metric "$1.pod_vm_stop" "$3" s
  eval "VMSTOP_$(echo "$1" | tr - _)=\$3"
  lab_note "$1: StopPodSandbox $5 s: the app containers' stops $2 s, k7d's own (the sandbox's SIGKILL to its shim gone: the daemon removes the pod VM, no guest call) $3 s, containerd's network teardown $4 s"
}

# nothing_left NAME: no pod sandbox or container (CRI), no task or container
# (k8s.io), no shim process and no network namespace (bounded: a shim
# exits once containerd has deleted its task), no address left in host-local.
nothing_left() {
  _out=$(timeout -s KILL 30 "$CRI" list 2>&1) || fail "$1: k7d-cri list failed: $_out"
  printf '%s\n' "$_out" | grep -qx 'cri: 0 pod sandboxes, 0 containers' ||
    fail "$1: CRI objects left: $(printf '%s' "$_out" | tr '\n' '|')"
  [ -z "$(ctr -n k8s.io tasks ls -q)" ] || fail "$1: tasks left: $(ctr -n k8s.io tasks ls -q | tr '\n' ' ')"
  [ -z "$(ctr -n k8s.io containers ls -q)" ] || fail "$1: containers left: $(ctr -n k8s.io containers ls -q | tr '\n' ' ')"
  _i=0
  while :; do
    _left=
    for _p in /proc/[0-9]*; do
      case $(cat "$_p/cmdline" 2>/dev/null | tr '\0' ' ') in *containerd-shim*) _left="$_left ${_p#/proc/}" ;; esac
    done
    [ -n "$_left" ] || break
    _i=$((_i + 1))
    [ "$_i" -lt 20 ] || fail "$1: shim processes left after 10 s:$_left"
    sleep 0.5
  done
  _ns=$(ls /var/run/netns 2>/dev/null)
  [ -z "$_ns" ] || fail "$1: network namespaces left: $(printf '%s' "$_ns" | tr '\n' ' ')"
  _ips=$(ls /var/lib/cni/networks/k7d-lab 2>/dev/null | grep -E '^[0-9.]+$')
  [ -z "$_ips" ] || fail "$1: pod addresses left in host-local: $(printf '%s' "$_ips" | tr '\n' ' ')"
}

# steps_side_by_side LABEL...: one note per step, each pod's ms side by side.
steps_side_by_side() {
  lab_note "CRI steps in ms ($*):"
  while read -r _s _; do
    _row=
    for _l in "$@"; do _row="$_row $_l $(awk -v s="$_s" '$1 == s {print $2}' "/tmp/cri-$_l.steps")"; done
    lab_note "  $_s:$_row"
  done <"/tmp/cri-$1.steps"
}

# LAB_CRI_DUMP_SPECS=1: what a runtime v2 shim is given for a CRI pod, as
# runc's shim gets it: each bundle's OCI annotations, namespaces and mounts.
specs_watch() {
  mkdir -p /tmp/specs
  while :; do
    for _f in /run/containerd/io.containerd.runtime.v2.task/k8s.io/*/config.json; do
      [ -s "$_f" ] || continue
      _id=${_f%/config.json}; _id=${_id##*/}
      [ -e "/tmp/specs/$_id" ] || cp "$_f" "/tmp/specs/$_id" 2>/dev/null
    done
    sleep 0.2
  done
}
specs_print() {
  for _f in /tmp/specs/*; do
    [ -s "$_f" ] || continue
    echo "lab: spec ${_f##*/}: annotations: $(sed -n 's/.*"annotations":{\([^}]*\)}.*/\1/p' "$_f")"
    echo "lab: spec ${_f##*/}: namespaces: $(sed -n 's/.*"namespaces":\[\([^]]*\)\].*/\1/p' "$_f")"
    echo "lab: spec ${_f##*/}: mounts: $(grep -o '"destination":"[^"]*","type":"[^"]*","source":"[^"]*"' "$_f" | tr '\n' ' ')"
    echo "lab: spec ${_f##*/}: args: $(sed -n 's/.*"args":\[\([^]]*\)\].*/\1/p' "$_f" | cut -c1-200)"
  done
}
[ -z "${LAB_CRI_DUMP_SPECS:-}" ] || { specs_watch & swatch=$!; }
L1_BOOT_ID=$(cat /proc/sys/kernel/random/boot_id)
cri_pod runc runc "$(uname -r)"
[ "$BOOT_ID" = "$L1_BOOT_ID" ] || fail "runc: the pod's containers report boot id $BOOT_ID, not L1's $L1_BOOT_ID: the check proves nothing"
[ -z "${LAB_CRI_DUMP_SPECS:-}" ] || { kill "$swatch"; specs_print; }
nothing_left runc
case " $HANDLERS " in
  *" k7d "*) ;;
  *)
    steps_side_by_side runc
    lab_note "timings of an emulated machine (L1 is QEMU TCG): compare runc and k7d within one run only"
    lab_pass "containerd CRI: a two-container pod under runc (LAB_CRI_HANDLERS=$HANDLERS: k7d not run), nothing left" ;;
esac

# --- k7d ----------------------------------------------------------------------------
cat >/etc/k7d/shim.toml <<EOF
kernel = "$LAB_KERNEL"
initramfs = "$LAB_POD_INITRD"
daemon_socket = "$SOCK"
vcpus = 1
memory_mib = 256
pool_size = 1
EOF
# The k7d-fork runtime class's config: the node's, fork-started.
{ cat /etc/k7d/shim.toml; echo 'pod_start = "fork"'; } >/etc/k7d/fork.toml
: >"$DLOG"
# Appending (O_APPEND): the CLI calls below append their logs to it too.
# --metrics-listen: the policy hook reads the datapath's drops in a scrape too.
"$LAB_BIN" daemon --jail "$JAIL" --state-dir "$STATE" --socket "$SOCK" --metrics-listen 127.0.0.1:9477 >>"$DLOG" 2>&1 &
dpid=$!
i=0
until [ -S "$SOCK" ]; do
  kill -0 "$dpid" 2>/dev/null || fail "the k7d daemon exited at start"
  i=$((i + 1))
  [ "$i" -lt 60 ] || fail "the k7d daemon made no socket within 30 s"
  sleep 0.5
done
[ "$LAB_L2_KERNEL_RELEASE" != "$(uname -r)" ] || fail "L1 and L2 run the same kernel release: the uname -r check would prove nothing"
# pod_vm LABEL: the pod's two containers ran on one kernel that is not L1's
# (the pod VM's), and the daemon never listed more than one VM for the pod
# (its sandbox and app containers share it).
pod_vm() {
  _want=${2:-1}
  [ "$BOOT_ID" != "$L1_BOOT_ID" ] || fail "$1: the pod's containers run on L1's kernel (boot id $BOOT_ID)"
  [ "$VMS_MAX" = "$_want" ] || fail "$1: the daemon listed $VMS_MAX VMs while the pod lived, expected $_want (the sandbox's, shared by its containers${3:+, and $3})"
  lab_note "$1: both containers on the pod VM's kernel (boot id $BOOT_ID, L1's $L1_BOOT_ID); $_want VM(s) listed while the pod lived"
}
cri_pod k7d k7d "$LAB_L2_KERNEL_RELEASE"
pod_vm k7d
lab_metric k7d.pod_start_vs_runc "$(awk -v k="$START_k7d" -v r="$START_runc" 'BEGIN {printf "%.2f", (r > 0 ? k / r : 0)}')" x
lab_metric k7d.pod_delete_vs_runc "$(awk -v k="$DELETE_k7d" -v r="$DELETE_runc" 'BEGIN {printf "%.2f", (r > 0 ? k / r : 0)}')" x

# --- the pod network --------------------------------------------------------------
# cri_net LABEL HANDLER [HOOK]: k7d-cri net (a server and a client pod:
# ping, then 4 MiB over TCP with matching sums; with HOOK, the server pod's
# default-deny policy blocks the ping and clearing it lets it through). For
# k7d, each pod VM's NIC is on its pod's CNI interface through k7d's
# datapath (auto: direct when it can); the paths the daemon reported while
# the pods lived are in /tmp/dp.seen ("VM datapath: MODE[ (why)]").
cri_net() {
  _l=$1 _h=$2 _hook=${3:-} _ps=${4:-}
  # The server pod's eth0 counts what it sends except on k7d's direct
  # datapath (bpf_redirect_peer skips eth0's transmit: docs/datapath.md).
  case $_l in net-runc | net-k7d-bridge) _tx=--expect-tx ;; *) _tx= ;; esac
  rm -f /tmp/dp.seen /tmp/ids.seen
  if [ "${_h%%-*}" = k7d ]; then
    ( while :; do
        for _v in $("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | tail -n +2 | awk '{print $1}'); do
          "$LAB_BIN" --socket "$SOCK" info "$_v" 2>/dev/null | grep -o 'datapath: [a-z]*[^;]*' | sed "s/^/$_v /" >>/tmp/dp.seen
          # The machine-id the agent was given at a fork or a claim
          # ("VM machine-id", from its console), which no container sees.
          grep -ho 'identity: entropy [0-9]* bytes, machine-id [0-9a-f]*' "$STATE/vms/$_v/serial.log" 2>/dev/null |
            sed "s/^.*machine-id /$_v /" >>/tmp/ids.seen
        done
        sleep 1
      done ) &
    _dpoll=$!
  fi
  cri_live "$_l" "/tmp/cri-$_l.out" timeout -s KILL $((STEP_LIMIT * 16)) "$CRI" net --runtime-handler "$_h" --image "$IMG" --name "$_l" \
    --log-dir "/var/log/pods/k7d-lab_$_l" --timeout-s "$STEP_LIMIT" ${_hook:+--hook "$_hook"} ${_ps:+--pod-start "$_ps"} $_tx
  _rc=$?
  [ -z "${_dpoll:-}" ] || { kill "$_dpoll"; wait "$_dpoll" 2>/dev/null; _dpoll=; }
  [ ! -e /tmp/ids.seen ] || cp /tmp/ids.seen "/tmp/ids-$_l.seen"
  [ "$_rc" = 0 ] || fail "$_l: k7d-cri net (handler $_h) exited $_rc: $(grep -v '^cri: step ' "/tmp/cri-$_l.out" | tail -n 2 | tr '\n' ' ')"
  _mibs=$(sed -n 's/^cri: net tcp 4 MiB .*(\([0-9.]*\) MiB\/s)$/\1/p' "/tmp/cri-$_l.out")
  [ -z "$_mibs" ] || lab_metric "$_l.tcp_mib_s" "$_mibs" MiB/s
  lab_note "$_l (handler $_h): $(sed -n 's/^cri: net ping [^:]*: //p' "/tmp/cri-$_l.out"); $(sed -n 's/^cri: net tcp //p' "/tmp/cri-$_l.out"); $(sed -n 's/^cri: net stats: //p' "/tmp/cri-$_l.out")"
}
# machine_ids LABEL: the two pod VMs of LABEL's net pair were each given a
# machine-id of their own (ids.seen, from their consoles while they lived).
machine_ids() {
  _ids=$(sort -u /tmp/ids.seen 2>/dev/null)
  [ "$(printf '%s\n' "$_ids" | awk 'NF == 2 {print $1}' | sort -u | grep -c .)" -ge 2 ] ||
    fail "$1: fewer than two pod VMs were given a machine-id (saw: $(printf '%s' "$_ids" | tr '\n' ';'))"
  [ "$(printf '%s\n' "$_ids" | awk 'NF == 2 {print $2}' | sort -u | grep -c .)" = "$(printf '%s\n' "$_ids" | awk 'NF == 2 {print $1}' | sort -u | grep -c .)" ] ||
    fail "$1: two pod VMs share a machine-id: $(printf '%s' "$_ids" | tr '\n' ';')"
  lab_note "$1: each pod VM's machine-id: $(printf '%s' "$_ids" | tr '\n' ';')"
}
cri_net net-runc runc
nothing_left net-runc
# The policy hook (k7d-cri net --hook): the server pod's VM is the shim's
# pod-<first 16 hex of sha256("k8s.io" NUL sandbox id)> (shim/src/names.rs);
# `k7d net policy` and `k7d net drops` work on its NIC's pins.
cat >/tmp/policy.sh <<EOF
#!/bin/sh
vm=pod-\$(env printf 'k8s.io\\000%s' "\$2" | sha256sum | cut -c1-16)
case \$1 in
  deny) exec "$LAB_BIN" net policy "\$vm" --default-deny ;;
  clear) exec "$LAB_BIN" net policy "\$vm" --clear ;;
  drops)
    out=\$("$LAB_BIN" net drops "\$vm") || exit 1
    printf '%s\\n' "\$out" | grep -q 'pod-policy-default-deny' || { echo "no default-deny drops on \$vm: \$out"; exit 1; }
    # The same drops in the daemon's Prometheus scrape (docs/observability.md).
    m=\$(busybox wget -q -O - http://127.0.0.1:9477/metrics) || { echo "cannot scrape the daemon's metrics"; exit 1; }
    scraped=\$(printf '%s\\n' "\$m" | grep "^k7d_datapath_drops_total{vm=\"\$vm\",reason=\"pod-policy-default-deny\"")
    printf '%s\\n' "\$scraped" | grep -qE '} [1-9][0-9]*\$' || { echo "no default-deny drops of \$vm in the scrape: \$(printf '%s' "\$m" | grep datapath_drops | tr '\\n' ' ')"; exit 1; }
    # The VM is labelled with its pod (the shim's sandbox annotations).
    pod=\$(printf '%s\\n' "\$m" | grep "^k7d_vm_pod_info{vm=\"\$vm\",namespace=\"k7d-lab\",name=\"net-k7d-server\",uid=\"net-k7d-server-[0-9]*\"} 1\$") ||
      { echo "the scrape does not name \$vm's pod: \$(printf '%s' "\$m" | grep '^k7d_vm_pod_info' | tr '\\n' ' ')"; exit 1; }
    # The 4 MiB it sent, in its NIC's own counters (which eth0's sent bytes
    # miss on the direct datapath: docs/observability.md). A scrape never
    # waits on a VM busy with a request (this scenario's poller asks each
    # VM's info every second): that VM's live counters are missing from
    # that scrape, so up to 10 scrapes are read until one has them.
    for _try in 1 2 3 4 5 6 7 8 9 10; do
      tx=\$(printf '%s\\n' "\$m" | sed -n "s/^k7d_vm_net_bytes_total{vm=\"\$vm\",device=\"net0\",direction=\"tx\"} \\([0-9]*\\)\$/\\1/p")
      [ -z "\$tx" ] || break
      sleep 0.3
      m=\$(busybox wget -q -O - http://127.0.0.1:9477/metrics) || { echo "cannot scrape the daemon's metrics"; exit 1; }
    done
    [ "\${tx:-0}" -ge 4194304 ] || { echo "the scrape shows \$vm sending \${tx:-no} bytes, under the 4 MiB it served: \$(printf '%s' "\$m" | grep '^k7d_vm_net' | tr '\\n' ' ')"; exit 1; }
    # And in the datapath's own counters (the tc programs' k7d_fwd map):
    # egress, what the guest sent through the direct datapath.
    fwd=\$("$LAB_BIN" net forwarded "\$vm") || exit 1
    dtx=\$(printf '%s\\n' "\$m" | sed -n "s/^k7d_datapath_forwarded_bytes_total{vm=\"\$vm\",direction=\"egress\"} \\([0-9]*\\)\$/\\1/p")
    [ "\${dtx:-0}" -ge 4194304 ] || { echo "the scrape shows the datapath passing \${dtx:-no} bytes from \$vm, under the 4 MiB it served ('k7d net forwarded': \$(printf '%s' "\$fwd" | tr '\\n' ' ')): \$(printf '%s' "\$m" | grep '^k7d_datapath_forwarded' | tr '\\n' ' ')"; exit 1; }
    # Its drives' reads (the pod's images and root, read while it started), live.
    blk=\$(printf '%s\\n' "\$m" | sed -n "s/^k7d_vm_blk_bytes_total{vm=\"\$vm\",device=\"blk[0-9]*\",op=\"read\"} \\([0-9]*\\)\$/\\1/p" | awk '{s += \$1} END {print s + 0}')
    [ "\$blk" -gt 0 ] || { echo "the scrape shows no bytes read by \$vm's drives: \$(printf '%s' "\$m" | grep '^k7d_vm_blk' | tr '\\n' ' ')"; exit 1; }
    # The guest's queue notifications to its drives (each read was kicked).
    kicks=\$(printf '%s\\n' "\$m" | sed -n "s/^k7d_vm_device_notifications_total{vm=\"\$vm\",device=\"blk[0-9]*\"} \\([0-9]*\\)\$/\\1/p" | awk '{s += \$1} END {print s + 0}')
    [ "\$kicks" -gt 0 ] || { echo "the scrape shows no queue notifications to \$vm's drives: \$(printf '%s' "\$m" | grep '^k7d_vm_device_notifications' | tr '\\n' ' ')"; exit 1; }
    nkicks=\$(printf '%s\\n' "\$m" | sed -n "s/^k7d_vm_device_notifications_total{vm=\"\$vm\",device=\"net0\"} \\([0-9]*\\)\$/\\1/p")
    scraped="\$scraped \$pod; net0 sent \$tx bytes (\${nkicks:-no} queue notifications), its drives read \$blk bytes (\$kicks notifications), the datapath passed on \$dtx bytes from it (k7d net forwarded: \$(printf '%s' "\$fwd" | tr '\\n' ' '))"
    printf '%s' "\$out" | tr '\\n' ' '
    printf '; scraped: %s' "\$scraped" | tr '\\n' ' ' ;;
  *) exit 2 ;;
esac
EOF
chmod +x /tmp/policy.sh
# dp_seen LABEL MODE: both pod VMs reported MODE while they lived.
dp_seen() {
  _dp=$(sort -u /tmp/dp.seen 2>/dev/null | tr '\n' ' ')
  [ "$(awk -v m="$2" '$3 == m {print $1}' /tmp/dp.seen 2>/dev/null | sort -u | grep -c .)" -ge 2 ] ||
    fail "$1: the daemon did not report the $2 datapath for both pod VMs (saw: ${_dp:-nothing})"
  lab_note "$1: the pod VMs' NICs: $_dp"
}
# Both pods are started by fork: the first boots the node's template. Each
# child's NIC is attached to its own pod's eth0 at the fork, and each has
# its own MAC, address, hostname and RNG (k7d-cri net checks the last three).
# --- the warm pool -------------------------------------------------------------------
# pool_size = 1: `k7d pool-fill` (what a node service runs before pods
# arrive) boots one pod VM of the shim config's shape (empty drives, a NIC
# on a bare tap, a vsock) and pauses it once its agent answers.
t0=$(lab_now)
_fill=$(timeout -s KILL 300 "$LAB_BIN" pool-fill 2>>"$DLOG") || fail "k7d pool-fill failed: $(tail -n 3 "$DLOG" | tr '\n' ' ')"
case $_fill in *": 1 member(s) booted, 1 ready") ;; *) fail "k7d pool-fill: '$_fill', expected one member booted and ready" ;; esac
lab_metric pool.fill_s "$(lab_sub "$(lab_now)" "$t0")" s
# The daemon's scrape counts the member ready (docs/observability.md).
_pm=$(busybox wget -q -O - http://127.0.0.1:9477/metrics | grep '^k7d_pool_members{') ||
  fail "warm pool: the daemon's scrape has no k7d_pool_members"
printf '%s\n' "$_pm" | grep -qE '^k7d_pool_members\{pool="[0-9a-f]{16}",state="ready"\} 1$' ||
  fail "warm pool: the scrape does not count one member ready: $(printf '%s' "$_pm" | tr '\n' ' ')"
lab_note "warm pool: $_fill; scraped: $_pm"
# refills: the pids of the k7d pool-fill processes that shims started
# (L1 has no pkill).
refills() {
  for _p in /proc/[0-9]*; do
    case $(cat "$_p/cmdline" 2>/dev/null | tr '\0' ' ') in *"pool-fill --after-s"*) echo "${_p#/proc/}" ;; esac
  done
}
# pool_ready LABEL: the pool's member is booted and paused again (its
# refill is a detached k7d pool-fill of the claiming shim's), within 300 s.
pool_ready() {
  _i=0
  until "$LAB_BIN" --socket "$SOCK" list 2>/dev/null | awk '$1 ~ /^pool-/ && $NF == "paused" {f = 1} END {exit !f}'; do
    _i=$((_i + 1))
    [ "$_i" -lt 600 ] || fail "$1: the warm pool was not refilled within 300 s: $(cat /run/k7d/shim/pools/*/fill.log 2>/dev/null | tail -n 3 | tr '\n' ' ')"
    [ $((_i % 60)) != 0 ] || echo "lab: $1: waiting for the warm pool's refill ($((_i / 2)) s)"
    sleep 0.5
  done
}

# The server pod is started by fork (it boots the node's template), the
# client by claiming the pool's member: the fork child's NIC is attached
# to its pod's eth0 at the fork, the member's tap moves into its pod's
# netns while it is paused (nic_attach). Each has its own MAC, address,
# hostname, RNG and boot id (k7d-cri net checks the last four).
cri_net net-k7d k7d /tmp/policy.sh fork,pool
dp_seen net-k7d direct
grep -q '^pool-[^ ]* datapath: direct' /tmp/dp.seen || fail "net-k7d: the client pod's VM was not the pool's member on the direct datapath: $(sort -u /tmp/dp.seen | tr '\n' ' ')"
grep -q '^cri: net identity: every pod' /tmp/cri-net-k7d.out || fail "net-k7d: the identity check did not run"
lab_note "net-k7d (a fork-started server, a pool-claimed client): $(sed -n 's/^cri: net identity: pod at //p' /tmp/cri-net-k7d.out | tr '\n' ';')"

machine_ids net-k7d

grep -q '^cri: net policy: cleared' /tmp/cri-net-k7d.out || fail "net-k7d: the policy check did not run"
lab_note "net-k7d: $(sed -n 's/^cri: net policy: default-deny/default-deny/p' /tmp/cri-net-k7d.out); cleared: the ping passes again"
nothing_left net-k7d
pool_ready net-k7d

# Two pods forked from the one template: the fork against the fork (a
# fork child against a cold-booted pool member would differ even if k7d
# gave a child nothing of its own). Address, hostname, MAC, 16 bytes of
# /dev/urandom and boot id (k7d-cri net), and machine-id all differ.
cri_net net-k7d-forks k7d "" fork,fork
grep -q '^cri: net identity: every pod' /tmp/cri-net-k7d-forks.out || fail "net-k7d-forks: the identity check did not run"
dp_seen net-k7d-forks direct
lab_note "net-k7d-forks (two children of one template): $(sed -n 's/^cri: net identity: pod at //p' /tmp/cri-net-k7d-forks.out | tr '\n' ';')"
machine_ids net-k7d-forks
nothing_left net-k7d-forks
lab_note "warm pool: refilled after net-k7d's claim: $("$LAB_BIN" --socket "$SOCK" list | awk '$1 ~ /^pool-/ {print $1 " " $NF}')"

# --- a pod started by fork ---------------------------------------------------------
# io.k7d.pod-start=fork: the pod VM is a copy-on-write fork of the node's
# template of its shape (shim/src/template.rs), booted once by the first
# fork-started pod (net-k7d's server above) and paused since: this pod's
# start is what a fork-started pod costs. While it lives the daemon lists
# the template and the pod's VM, the latter among the template's children.
# forked LABEL: the daemon listed the pod's VM as a live fork child of a
# template while the pod lived.
forked() {
  grep -q ' pod-' /tmp/forked.seen 2>/dev/null ||
    fail "$1: no template listed a pod VM among its fork children while the pod lived: $(sort -u /tmp/forked.seen 2>/dev/null | tr '\n' '|')"
  lab_note "$1: forked from the template: $(sort -u /tmp/forked.seen | head -n 1)"
}
tmpl=$("$LAB_BIN" --socket "$SOCK" list | awk '$1 ~ /^tmpl-/ {print $1 " " $NF}')
case $tmpl in *" paused") ;; *) fail "net-k7d's fork-started pods left no paused template: '$tmpl'" ;; esac
# The node service's call (k7d template-make) finds that same template.
_tm=$(timeout -s KILL 120 "$LAB_BIN" template-make --config /etc/k7d/fork.toml 2>>"$DLOG") ||
  fail "k7d template-make failed: $(tail -n 2 "$DLOG" | tr '\n' ' ')"
[ "$_tm" = "fork template ${tmpl%% *}: already paused" ] ||
  fail "k7d template-make did not find the node's paused template ${tmpl%% *}: '$_tm'"
# Under the k7d-fork runtime handler (its containerd entry names
# /etc/k7d/fork.toml: pod_start = "fork"), without the annotation.
cri_pod k7d-fork k7d-fork "$LAB_L2_KERNEL_RELEASE"
pod_vm k7d-fork 3 "the node's fork template and the warm pool's member"
forked k7d-fork
lab_metric k7d_fork.pod_start_vs_runc "$(awk -v k="$START_k7d_fork" -v r="$START_runc" 'BEGIN {printf "%.2f", (r > 0 ? k / r : 0)}')" x
lab_metric k7d_fork.pod_start_vs_cold "$(awk -v k="$START_k7d_fork" -v c="$START_k7d" 'BEGIN {printf "%.2f", (c > 0 ? k / c : 0)}')" x
lab_metric k7d_fork.pod_delete_vs_runc "$(awk -v k="$DELETE_k7d_fork" -v r="$DELETE_runc" 'BEGIN {printf "%.2f", (r > 0 ? k / r : 0)}')" x
nothing_left k7d-fork

# An edited shim config (another command line): its next `k7d pool-fill`
# retires the pool the earlier version made (the member the refill booted
# after net-k7d's claim is deleted from the daemon) and fills the new one.
_old=$("$LAB_BIN" --socket "$SOCK" list | awk '$1 ~ /^pool-/ {print $1}')
case $_old in pool-*-*) ;; *) fail "before the config edit: expected one pool member, the daemon lists '$_old'" ;; esac
echo 'cmdline = "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check k7d.lab_edit=1"' >>/etc/k7d/shim.toml
# (Its log to a file of its own: the daemon writes $DLOG at its own offset.)
_fill=$(timeout -s KILL 300 "$LAB_BIN" pool-fill 2>/tmp/pool-fill-edit.log) || fail "k7d pool-fill after the config edit failed: $(tail -n 3 /tmp/pool-fill-edit.log | tr '\n' ' ')"
case $_fill in *": 1 member(s) booted, 1 ready") ;; *) fail "k7d pool-fill after the config edit: '$_fill'" ;; esac
_new=$("$LAB_BIN" --socket "$SOCK" list | awk '$1 ~ /^pool-/ {print $1}')
case $_new in "${_old%-*}"-*) fail "after the config edit the pool's member $_new is still of the earlier pool (${_old%-*})" ;; pool-*-*) ;; *) fail "after the config edit: expected one new pool member, the daemon lists '$_new'" ;; esac
grep "earlier version of the config drained" /tmp/pool-fill-edit.log | grep -q "${_old%-*}" || fail "k7d pool-fill did not say it retired ${_old%-*}: $(tr '\n' ' ' </tmp/pool-fill-edit.log | cut -c1-600)"
lab_note "warm pool: the config edited, pool-fill retired ${_old%-*} (its member $_old deleted) and filled ${_new%-*} ($_new)"

# --- a pod from the warm pool ----------------------------------------------------------
# io.k7d.pod-start=pool: the pod claims the pool's paused member (its NIC
# attached, resumed, its images in by medium change). Its shim's refill
# waits 600 s here, so the start measured is the claim's alone (stopped
# after the pod). While the pod lives the daemon lists the template and the
# pod's VM, the member; after it, no pool member is left: the pod had it.
echo 'pool_refill_delay_s = 600' >>/etc/k7d/shim.toml
cri_pod k7d-pool k7d "$LAB_L2_KERNEL_RELEASE" pool
pod_vm k7d-pool 2 "the node's fork template"
_r=$(refills)
[ -n "$_r" ] || fail "k7d-pool: no refill was waiting after the claim"
kill $_r
_left=$("$LAB_BIN" --socket "$SOCK" list | awk '$1 ~ /^pool-/ {print $1}')
[ -z "$_left" ] || fail "k7d-pool: the pool's member $_left is still there: the pod did not claim it"
# Two pool members, net-k7d's client and this pod's (each booted by its
# own pool-fill): each VM its own machine-id and boot id.
_p1=$(awk '$1 ~ /^pool-/' /tmp/ids-net-k7d.seen 2>/dev/null | sort -u | head -n1)
_p2=$(awk '$1 ~ /^pool-/' /tmp/ids-k7d-pool.seen 2>/dev/null | sort -u | head -n1)
_b1=$(sed -n 's/^cri: net identity: pod at [^:]*: hostname net-k7d-client, .*, boot id //p' /tmp/cri-net-k7d.out)
[ -n "$_p1" ] && [ -n "$_p2" ] || fail "k7d-pool: no machine-id seen for a pool member (net-k7d: '$_p1', k7d-pool: '$_p2')"
[ "${_p1%% *}" != "${_p2%% *}" ] && [ "${_p1#* }" != "${_p2#* }" ] ||
  fail "k7d-pool: two pool members share a VM or a machine-id: $_p1 / $_p2"
[ -n "$_b1" ] && [ "$_b1" != "$BOOT_ID" ] || fail "k7d-pool: two pool members share a boot id ('$_b1', '$BOOT_ID')"
lab_note "two pool members: $_p1 (boot id $_b1, net-k7d's client) and $_p2 (boot id $BOOT_ID, k7d-pool): their own machine-ids and boot ids"
lab_metric k7d_pool.pod_start_vs_runc "$(awk -v k="$START_k7d_pool" -v r="$START_runc" 'BEGIN {printf "%.2f", (r > 0 ? k / r : 0)}')" x
lab_metric k7d_pool.pod_start_vs_cold "$(awk -v k="$START_k7d_pool" -v c="$START_k7d" 'BEGIN {printf "%.2f", (c > 0 ? k / c : 0)}')" x
lab_metric k7d_pool.pod_delete_vs_runc "$(awk -v k="$DELETE_k7d_pool" -v r="$DELETE_runc" 'BEGIN {printf "%.2f", (r > 0 ? k / r : 0)}')" x
steps_side_by_side runc k7d k7d-pool k7d-fork
# Density (issue 38): the fork-started pod's guest RAM PSS against the cold
# pod's and the pool member's (a cold-booted VM with the same pod in it),
# each taken idle, right after the exec. Goal <= 0.25x (Kata's templating:
# 0.28x); printed, not yet met. Bounded at 0.9x of the cold pod's (measured
# 0.58-0.62x): a fork-started pod that copied most of its RAM fails. The
# template's own pages that no VM maps are in no PSS (they stay in its memfd).
awk -v f="$RAMPSS_k7d_fork" -v c="$RAMPSS_k7d" 'BEGIN {exit !(c > 0 && f / c <= 0.9)}' ||
  fail "k7d-fork: its idle pod VM's guest RAM PSS ($RAMPSS_k7d_fork MiB) is not below 0.9x the cold pod's ($RAMPSS_k7d MiB): the fork-started pod copied most of its RAM"
lab_metric k7d_fork.guest_ram_pss_vs_cold "$(awk -v f="$RAMPSS_k7d_fork" -v p="$RAMPSS_k7d" 'BEGIN {printf "%.2f", (p > 0 ? f / p : 0)}')" x
lab_metric k7d_fork.guest_ram_pss_vs_pool "$(awk -v f="$RAMPSS_k7d_fork" -v p="$RAMPSS_k7d_pool" 'BEGIN {printf "%.2f", (p > 0 ? f / p : 0)}')" x
lab_note "idle pod VMs' guest RAM PSS (MiB): cold $RAMPSS_k7d, warm pool $RAMPSS_k7d_pool, fork-started $RAMPSS_k7d_fork; fork-started over cold $(awk -v f="$RAMPSS_k7d_fork" -v p="$RAMPSS_k7d" 'BEGIN {printf "%.2f", (p > 0 ? f / p : 0)}')x, over pool $(awk -v f="$RAMPSS_k7d_fork" -v p="$RAMPSS_k7d_pool" 'BEGIN {printf "%.2f", (p > 0 ? f / p : 0)}')x (goal <= 0.25x)"
lab_note "pod start (s): runc $START_runc, k7d cold $START_k7d, k7d warm pool $START_k7d_pool, k7d fork-started $START_k7d_fork; pod delete (s): runc $DELETE_runc, k7d cold $DELETE_k7d, k7d warm pool $DELETE_k7d_pool, k7d fork-started $DELETE_k7d_fork"
lab_note "goals: fork-started <= 2x runc ($(awk -v k="$START_k7d_fork" -v r="$START_runc" 'BEGIN {printf "%.2f", k / r}')x) and <= 0.1x cold ($(awk -v k="$START_k7d_fork" -v c="$START_k7d" 'BEGIN {printf "%.2f", k / c}')x); delete <= 1 s (k7d's own part of StopPodSandbox, the sandbox's SIGKILL to its shim gone: cold ${VMSTOP_k7d:-?} s, fork-started ${VMSTOP_k7d_fork:-?} s, pool ${VMSTOP_k7d_pool:-?} s; the rest is containerd's, as under runc)"
nothing_left k7d-pool
# And the fork template goes the same way (k7d template-remove).
_tr=$(timeout -s KILL 120 "$LAB_BIN" template-remove --config /etc/k7d/fork.toml 2>>"$DLOG") ||
  fail "k7d template-remove failed: $(tail -n 2 "$DLOG" | tr '\n' ' ')"
[ "$_tr" = "fork template ${tmpl%% *}: removed" ] || fail "k7d template-remove: '$_tr', expected ${tmpl%% *} removed"
"$LAB_BIN" --socket "$SOCK" list | awk '$1 ~ /^tmpl-/ {f = 1} END {exit f}' || fail "k7d template-remove left the template in the daemon"
_th=${tmpl%% *}
[ ! -e "/run/k7d/shim/templates/${_th#tmpl-}" ] || fail "k7d template-remove left the template's directory /run/k7d/shim/templates/${_th#tmpl-}"
lab_note "fork template: $_tr"

# LAB_CRI_MANY=N (by hand; CI leaves it out for time): N pods created at
# once under k7d, their start modes taken in turn from LAB_CRI_MANY_MODES
# (default cold,fork,pool; the warm pool is booted first with a member for
# each pool pod, and not refilled during the run): all must start (0
# failures), then all are removed at once and nothing is left.
if [ -n "${LAB_CRI_MANY:-}" ]; then
  # Ten cold pod VMs booting at once on L1's one emulated vCPU take minutes:
  # a boot deadline for this machine, not the 60 s default.
  cp /etc/k7d/shim.toml /tmp/shim.toml.saved
  echo 'boot_timeout_s = 1500' >>/etc/k7d/shim.toml
  # The pool pods' refills must not boot more VMs into the run (it once
  # outlasted the 600 s set for k7d-pool, and five refills joined in).
  sed -i 's/^pool_refill_delay_s = .*/pool_refill_delay_s = 3600/' /etc/k7d/shim.toml
  # Twenty pod VMs on one emulated CPU: a runc create in each took past
  # the agent's 60 s default; the node's runc limit, as a busy node sets it.
  sed -i '/^cmdline = /d' /etc/k7d/shim.toml
  echo 'cmdline = "console=ttyS0 quiet panic=-1 cryptomgr.notests no_timer_check k7d.runc_timeout_s=900"' >>/etc/k7d/shim.toml
  # L1 has 3 GiB unless K7D_LAB_L1_MIB says more: pod VMs of 128 MiB for
  # this run (LAB_CRI_MANY_MIB).
  sed -i "s/^memory_mib = .*/memory_mib = ${LAB_CRI_MANY_MIB:-128}/" /etc/k7d/shim.toml
  # Progress on the console every 30 s (the L1 watchdog stops a scenario
  # that stays silent for 180 s), each failure as it comes.
  ( _seen=0
    while sleep 30; do
      echo "lab: many: $(grep -c ' ready in ' /tmp/cri-many.out 2>/dev/null) ready, $(grep -c ' FAILED: ' /tmp/cri-many.out 2>/dev/null) failed, $("$LAB_BIN" --socket "$SOCK" list 2>/dev/null | tail -n +2 | grep -c .) VMs, L1 $(awk '/^MemAvailable/ {print int($2 / 1024)}' /proc/meminfo) MiB available"
      _n=$(grep -c ' FAILED: ' /tmp/cri-many.out 2>/dev/null)
      [ "${_n:-0}" -le "$_seen" ] || { grep ' FAILED: ' /tmp/cri-many.out | tail -n +$((_seen + 1)) | cut -c1-400 | sed 's/^/lab: many: /'; _seen=$_n; }
    done ) &
  _mprog=$!
  _modes=${LAB_CRI_MANY_MODES:-cold,fork,pool}
  _npool=$(awk -v n="$LAB_CRI_MANY" -v m="$_modes" 'BEGIN {k = split(m, a, ","); c = 0; for (i = 0; i < n; i++) if (a[i % k + 1] == "pool") c++; print (c > 16 ? 16 : c)}')
  # The node's template of this shape, booted before the pods come (as
  # the pool is): k7d template-make, as a node service runs it.
  case ",$_modes," in
    *,fork,*)
      _t0=$(lab_now)
      _tm=$(timeout -s KILL 1200 "$LAB_BIN" template-make 2>>"$DLOG") || fail "many: k7d template-make failed: $(tail -n 3 "$DLOG" | tr '\n' ' ')"
      lab_note "many: $_tm in $(lab_sub "$(lab_now)" "$_t0") s" ;;
  esac
  if [ "$_npool" -gt 0 ]; then
    sed -i "s/^pool_size = .*/pool_size = $_npool/" /etc/k7d/shim.toml
    _fill=$(timeout -s KILL 1200 "$LAB_BIN" pool-fill 2>>"$DLOG") || fail "many: k7d pool-fill failed: $(tail -n 3 "$DLOG" | tr '\n' ' ')"
    lab_note "many: warm pool for $_npool pool pods: $_fill"
  fi
  # Each pod's limit (LAB_CRI_MANY_TIMEOUT_S): twenty pod VMs on one
  # emulated CPU took past 900 s for the cold ones, which boot last.
  _mt=${LAB_CRI_MANY_TIMEOUT_S:-1500}
  timeout -s KILL $((_mt * 2)) "$CRI" many --runtime-handler k7d --image "$IMG" --name many --count "$LAB_CRI_MANY" \
    --log-dir /var/log/pods/k7d-lab_many --timeout-s "$_mt" --pod-start "$_modes" >/tmp/cri-many.out 2>&1
  _rc=$?
  grep -v '^cri: step ' /tmp/cri-many.out | sed 's/^/lab: many: /'
  kill "$_mprog" 2>/dev/null; wait "$_mprog" 2>/dev/null
  # The pool pods' refills wait 3600 s (set above): not in this run.
  _r=$(refills)
  [ -z "$_r" ] || kill $_r
  cp /tmp/shim.toml.saved /etc/k7d/shim.toml
  [ "$_rc" = 0 ] || fail "many: k7d-cri many exited $_rc: $(tail -n 2 /tmp/cri-many.out | tr '\n' ' ')"
  lab_note "many: $(sed -n 's/^cri: many: \([0-9]* pods at once\)/\1/p' /tmp/cri-many.out); $(sed -n 's/^cri: many: \([a-z]*: [0-9]* pods, start\)/\1/p' /tmp/cri-many.out | tr '\n' ';')"
  nothing_left many
fi

# The fallback: a node whose tc object cannot be loaded (node config
# tc_object names a missing file): auto NICs take the bridge chain, the
# daemon says why, and the pods still talk.
kill "$dpid"; wait "$dpid" 2>/dev/null
echo '{"tc_object": "/nonexistent/k7d_tc.o"}' >/tmp/node-no-tc.json
"$LAB_BIN" daemon --jail "$JAIL" --state-dir "$STATE" --socket "$SOCK" --node-config /tmp/node-no-tc.json --metrics-listen 127.0.0.1:9477 >>"$DLOG" 2>&1 &
dpid=$!
i=0
until "$LAB_BIN" --socket "$SOCK" list >/dev/null 2>&1; do
  kill -0 "$dpid" 2>/dev/null || fail "the k7d daemon (tc_object missing) exited at start"
  i=$((i + 1))
  [ "$i" -lt 60 ] || fail "the k7d daemon (tc_object missing) did not answer within 30 s"
  sleep 0.5
done
cri_net net-k7d-bridge k7d
dp_seen net-k7d-bridge bridge
grep -q 'nonexistent/k7d_tc.o' /tmp/dp.seen || fail "net-k7d-bridge: the bridge fallback does not say why (the missing tc object): $(sort -u /tmp/dp.seen | tr '\n' ' ')"
# And the node's scrape counts both pod VMs' NICs under the reason's class.
_fb=$(busybox wget -q -O - http://127.0.0.1:9477/metrics | sed -n 's/^k7d_datapath_fallbacks_total{reason="no_object"} \([0-9]*\)$/\1/p')
[ "${_fb:-0}" -ge 2 ] || fail "net-k7d-bridge: the scrape counts ${_fb:-no} fallbacks for the missing tc object, expected both pod VMs' NICs: $(busybox wget -q -O - http://127.0.0.1:9477/metrics | grep '^k7d_datapath_fallbacks' | tr '\n' ' ')"
lab_note "net-k7d-bridge: k7d_datapath_fallbacks_total{reason=\"no_object\"} $_fb in the scrape"

# The scenario's teardown: nothing for k7d-cri cleanup to do.
_c=$(timeout -s KILL 120 "$CRI" cleanup --timeout-s 60 2>&1) || fail "k7d-cri cleanup failed: $(printf '%s' "$_c" | tail -n 2 | tr '\n' ' ')"
printf '%s\n' "$_c" | grep -q 'cleanup: 0 pod sandboxes' || fail "k7d-cri cleanup found pods left: $(printf '%s' "$_c" | tr '\n' '|')"
nothing_left k7d
vms=$("$LAB_BIN" --socket "$SOCK" list 2>&1) || fail "k7d list failed: $vms"
[ -z "$(printf '%s\n' "$vms" | tail -n +2)" ] || fail "k7d VMs left after every pod was removed: $(printf '%s' "$vms" | tr '\n' '|')"
kill -0 "$dpid" 2>/dev/null || fail "the k7d daemon died"
# The node's fork template went with the daemon it lived in (restarted
# above); its directory and lock file are the node's, kept for the next,
# as are the warm pool's lock, counter and fill log.
left=$(find /run/k7d/shim -mindepth 1 -not -path '/run/k7d/shim/templates*' -not -path '/run/k7d/shim/pools*' 2>/dev/null; find /run/k7d/shim/templates /run/k7d/shim/pools "$STATE" -name '*.sock' 2>/dev/null; grep -E ' /run/k7d| /var/lib/k7d' /proc/mounts)
[ -z "$left" ] || fail "k7d: left behind: $(printf '%s' "$left" | tr '\n' ' ')"
lab_note "k7d: nothing left: no pod sandbox, container, task, shim process, VM, network namespace, pod address, pod socket dir, vsock socket or mount"
lab_note "timings of an emulated machine (L1 is QEMU TCG): compare runc and k7d within one run only"
lab_pass "containerd CRI: the same two-container pod under runc, k7d cold, k7d fork-started and k7d from the warm pool (pod VMs on kernel $LAB_L2_KERNEL_RELEASE), a fork-started and a pool-claimed k7d pod with their own identities talking over the direct datapath (a pod policy blocks and clears) and two cold ones over the bridge fallback, nothing left"
