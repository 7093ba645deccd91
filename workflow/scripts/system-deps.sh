#!/bin/sh
# Make sure the system programs tiersep needs are on PATH; install them with apt-get when we are
# root on Debian/Ubuntu, otherwise stop with the command to run. Usage: system-deps.sh ffmpeg [chromium] [slurm] [postgresql]
set -e
missing=""
need() { # need <program...> -- <debian packages...>
    progs=""; while [ "$1" != "--" ]; do progs="$progs $1"; shift; done; shift
    for p in $progs; do command -v "$p" >/dev/null 2>&1 || { missing="$missing $*"; return; }; done
}
for what in "$@"; do
    case "$what" in
        ffmpeg)   need ffmpeg ffprobe -- ffmpeg ;;
        chromium) need chromium -- chromium ;;
        slurm)    need slurmctld slurmd sbatch munged -- slurmctld slurmd slurm-client munge ;;
        # the server binaries are off PATH, under /usr/lib/postgresql/<version>/bin
        postgresql) ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$missing postgresql" ;;
        *) echo "system-deps.sh: unknown component $what" >&2; exit 2 ;;
    esac
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null
else
    echo "tiersep needs these system packages:$missing" >&2
    echo "  Debian/Ubuntu: sudo apt-get install$missing" >&2
    echo "  conda:         conda install -c conda-forge ffmpeg   (ffmpeg/ffprobe for musdb and museval)" >&2
    exit 1
fi
