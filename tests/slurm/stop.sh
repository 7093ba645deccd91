#!/usr/bin/env bash
# Stop the cluster started by tests/slurm/start.sh RUN_DIR: kill slurmd, slurmctld and munged by
# the pids in their pid files (nothing else), then remove /etc/slurm/slurm.conf if it is ours.
set -u
RUN_DIR=${1:?usage: stop.sh RUN_DIR}
MARKER="# tiersep-test-cluster"

stop_pid_file() {
    local pid_file=$1 pid
    [ -s "$pid_file" ] || return 0
    pid=$(cat "$pid_file")
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
}

# Cancel what is still queued so slurmd has no job steps left behind.
if [ -s "$RUN_DIR/slurmctld.pid" ] && command -v scancel >/dev/null; then
    SLURM_CONF="$RUN_DIR/slurm.conf" timeout 10 scancel --user=root 2>/dev/null || true
fi
stop_pid_file "$RUN_DIR/slurmd.pid"
stop_pid_file "$RUN_DIR/slurmctld.pid"
stop_pid_file "$RUN_DIR/munge/munged.pid"
if [ -f /etc/slurm/slurm.conf ] && grep -qF "$MARKER" /etc/slurm/slurm.conf; then
    rm -f /etc/slurm/slurm.conf /etc/slurm/gres.conf.tiersep-test
fi
echo "slurm stopped ($RUN_DIR)"
