#!/usr/bin/env bash
# Start a throw-away single-node SLURM cluster (munged + slurmctld + slurmd) for the integration
# test, with no systemd: every daemon is started by hand, keeps its pid file in the run directory,
# and tests/slurm/stop.sh kills exactly those pids.
#
#   tests/slurm/start.sh RUN_DIR
#
# Needs root and the Debian packages slurmctld slurmd slurm-client munge.
# The node has CPUs=2, one fake GPU (gres.conf: Name=gpu File=/dev/null), no accounting database
# (so job status must come from squeue; MinJobAge=300 keeps finished jobs visible there).
# Nested `srun` calls inside a job lose $SLURM_CONF (the jobstep executor strips SLURM_* variables),
# so the config is also installed at the compiled-in default /etc/slurm/slurm.conf, but only when no
# config is there yet; stop.sh removes it again only if it carries our marker.
set -euo pipefail

RUN_DIR=${1:?usage: start.sh RUN_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
MARKER="# tiersep-test-cluster"
SYSTEM_CONF=/etc/slurm/slurm.conf

for tool in munged slurmctld slurmd sbatch squeue scontrol sinfo; do
    command -v "$tool" >/dev/null || { echo "start.sh: '$tool' not found (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "start.sh: must run as root (slurmd runs jobs as root here)" >&2; exit 2; }
if [ -e "$SYSTEM_CONF" ] && ! grep -qF "$MARKER" "$SYSTEM_CONF"; then
    echo "start.sh: $SYSTEM_CONF exists and is not ours; refusing to replace a real cluster's config" >&2
    exit 2
fi

RUN_DIR=$(mkdir -p "$RUN_DIR" && cd "$RUN_DIR" && pwd)
mkdir -p "$RUN_DIR"/{munge,state,spool,log}
chmod 700 "$RUN_DIR/munge"

NODE=$(hostname -s)
CPUS=${TIERSEP_SLURM_CPUS:-2}
# Memory is bookkeeping only here (no cgroups enforce it); 16000 MB lets the pipeline's 8000 MB
# train/evaluate requests schedule on any CI machine (SlurmdParameters=config_overrides).
MEM_MB=${TIERSEP_SLURM_MEM_MB:-16000}

# Free ports, so a leftover test cluster or a system SLURM on the default ports does not interfere.
read -r CTLD_PORT SLURMD_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

# --- munge: private key and socket, so a system munged (if any) is left alone ---
dd if=/dev/urandom of="$RUN_DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$RUN_DIR/munge/munge.key"
SOCKET="$RUN_DIR/munge/munge.socket"
munged --force \
    --key-file="$RUN_DIR/munge/munge.key" --socket="$SOCKET" \
    --pid-file="$RUN_DIR/munge/munged.pid" --log-file="$RUN_DIR/log/munged.log" \
    --seed-file="$RUN_DIR/munge/munged.seed"

# --- slurm.conf / gres.conf ---
sed -e "s|@RUN_DIR@|$RUN_DIR|g" -e "s|@NODE@|$NODE|g" -e "s|@CPUS@|$CPUS|g" \
    -e "s|@MEM_MB@|$MEM_MB|g" -e "s|@SOCKET@|$SOCKET|g" -e "s|@MARKER@|$MARKER|g" \
    -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
    "$HERE/slurm.conf.in" > "$RUN_DIR/slurm.conf"
cp "$HERE/gres.conf" "$RUN_DIR/gres.conf"
mkdir -p /etc/slurm
cp "$RUN_DIR/slurm.conf" "$SYSTEM_CONF"
cp "$RUN_DIR/gres.conf" /etc/slurm/gres.conf.tiersep-test  # kept for inspection only
export SLURM_CONF="$RUN_DIR/slurm.conf"

# --- daemons (they fork; their pid files are what stop.sh kills) ---
slurmctld -c -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N "$NODE"

# --- wait until the node takes jobs ---
for _ in $(seq 1 60); do
    state=$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in
        idle*|mixed*|allocated*) echo "slurm up: node $NODE ($state), conf $SLURM_CONF"; exit 0 ;;
        drain*|down*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "start.sh: node $NODE never became idle (state '${state:-none}'); logs in $RUN_DIR/log" >&2
tail -n 20 "$RUN_DIR"/log/*.log >&2 || true
exit 1
