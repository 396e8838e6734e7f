#!/usr/bin/env bash
# A GlusterFS volume in loopback for measurements, with the steps of the test fixture
# (kvx-offload/tests/gluster/volume.rs): a glusterd of its own (state in one directory), a
# volume of two bricks on local directories, and one FUSE mount per kvx node.
#
#   sudo scripts/gluster-volume.sh up [NODES] [replica2|distributed]   # prints one mount a line
#   sudo scripts/gluster-volume.sh down                                # ends all of it
#
# KVX_GLUSTER_DIR: the state directory (default /tmp/kvx-gluster-volume): glusterd's working
# directory and log, the bricks, the mounts (mount0, mount1, ...) and the pids started.
# `down` unmounts every mount below it, ends the FUSE clients, stops and deletes the volume, ends
# the bricks, the self-heal daemon and glusterd (by the pids recorded), removes the directory,
# and exits 1 if a mount or a process it started is still there. A failed `up` runs `down`.
# Needs root, /dev/fuse, glusterfs-server and glusterfs-client, and port 24007 free.
set -euo pipefail

state="${KVX_GLUSTER_DIR:-/tmp/kvx-gluster-volume}"
volume=kvxvol
port=24007

die() { echo "gluster-volume.sh: $*" >&2; exit 1; }
cli() { gluster --mode=script --timeout=60 "$@"; }
# Pids whose command line holds every argument.
pids_with() {
    local pid cmd n
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        cmd="$({ tr '\0' ' ' < "/proc/$pid/cmdline"; } 2> /dev/null)" || continue
        for n in "$@"; do [[ "$cmd" == *"$n"* ]] || continue 2; done
        echo "$pid"
    done
}
alive() { [ -e "/proc/$1" ] && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
record() { echo "$1" >> "$state/pids"; }
# TERM, then KILL after two seconds.
end_pid() {
    local pid=$1 i
    alive "$pid" || return 0
    kill -CONT "$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do alive "$pid" || return 0; sleep 0.02; done
    kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 100); do alive "$pid" || return 0; sleep 0.05; done
}
mounts_below() { awk -v d="$state/" 'index($2, d) == 1 { print $2 }' /proc/mounts; }

down() {
    [ -d "$state" ] || { echo "gluster-volume.sh: nothing up at $state"; return 0; }
    local m pid
    for m in $(mounts_below); do umount "$m" 2>/dev/null || umount -l "$m" || true; done
    # Bricks continued first (a stopped one would hold the volume's stop).
    if [ -f "$state/pids" ]; then
        for pid in $(cat "$state/pids"); do kill -CONT "$pid" 2>/dev/null || true; done
    fi
    if [ -f "$state/glusterd.pid" ] && alive "$(cat "$state/glusterd.pid")"; then
        cli volume stop "$volume" force > /dev/null 2>&1 || true
        cli volume delete "$volume" > /dev/null 2>&1 || true
        end_pid "$(cat "$state/glusterd.pid")"
    fi
    if [ -f "$state/pids" ]; then
        for pid in $(cat "$state/pids"); do end_pid "$pid"; done
    fi
    local left=""
    for m in $(mounts_below); do left+=" mount $m;"; done
    for pid in $(cat "$state/pids" "$state/glusterd.pid" 2>/dev/null); do
        alive "$pid" && left+=" process $pid;"
    done
    [ -z "$left" ] || die "left behind:$left"
    rm -rf "$state"
    echo "gluster-volume.sh: down (no mount or process left)"
}

up() {
    local nodes="${1:-3}" layout="${2:-replica2}"
    [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive number, not $nodes"
    [ "$layout" = replica2 ] || [ "$layout" = distributed ] || die "layout: replica2 or distributed"
    [ "$(id -u)" = 0 ] || die "needs root (glusterd, mount)"
    [ -e /dev/fuse ] || die "no /dev/fuse"
    for tool in glusterd gluster mount.glusterfs; do
        command -v "$tool" > /dev/null || [ -x "/usr/sbin/$tool" ] || [ -x "/sbin/$tool" ] ||
            die "$tool missing: apt-get install glusterfs-server glusterfs-client"
    done
    [ ! -e "$state" ] || die "$state exists: run down first"
    if (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then
        die "port $port is taken: another glusterd runs on this machine"
    fi
    mkdir -p "$state/glusterd"
    trap 'echo "gluster-volume.sh: up failed, tearing down" >&2; down' ERR
    cat > "$state/glusterd.vol" <<EOF
volume management
    type mgmt/glusterd
    option working-directory $state/glusterd
    option transport-type socket
    option transport.socket.listen-port $port
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
EOF
    setsid glusterd -N -f "$state/glusterd.vol" -l "$state/glusterd.log" < /dev/null > /dev/null 2>&1 &
    echo $! > "$state/glusterd.pid"
    local i
    for i in $(seq 300); do cli pool list > /dev/null 2>&1 && break; sleep 0.1; done
    cli pool list > /dev/null
    local host bricks=()
    host="$(hostname)"
    for i in 0 1; do mkdir -p "$state/brick$i"; bricks+=("$host:$state/brick$i"); done
    if [ "$layout" = replica2 ]; then
        cli volume create "$volume" replica 2 "${bricks[@]}" force > /dev/null
    else
        cli volume create "$volume" "${bricks[@]}" force > /dev/null
    fi
    cli volume start "$volume" > /dev/null
    for i in 0 1; do
        local pid=""
        for _ in $(seq 300); do
            pid="$(pids_with glusterfsd "--brick-name $state/brick$i ")"
            [ -n "$pid" ] && break
            sleep 0.1
        done
        [ -n "$pid" ] || false
        record "$pid"
        echo "$pid" > "$state/brick$i.pid"
    done
    for pid in $(pids_with glusterfs "shd/$volume "); do record "$pid"; done
    for ((i = 0; i < nodes; i++)); do
        mkdir -p "$state/mount$i"
        mount -t glusterfs "$host:/$volume" "$state/mount$i"
        pid="$(pids_with glusterfs "$volume" "$state/mount$i")"
        [ -n "$pid" ] || false
        record "$pid"
        echo "$state/mount$i"
    done
    trap - ERR
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    *) die "usage: $0 up [NODES] [replica2|distributed] | down" ;;
esac
