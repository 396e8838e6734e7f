#!/usr/bin/env bash
# compare-posix: kvx's file tier next to fio and NVIDIA NIXL's POSIX backend on the same disk,
# run alternately round by round (these disks swing 2x between back-to-back runs), printing
# medians (GiB/s), the ratios kvx/peer-best, kvx/fio and kvx/fio-huge of those medians, and the
# median of the per-round ratios kvx/peer-best (each round's kvx run against the peer's better
# engine of the same round), then one JSON line.
#
# Each round runs, in an order rotated by one each round (so no tool always goes first):
#   kvx-uring   kvx bench posix --engine uring   (one file per block, header, checksum, rename)
#   kvx-psync   kvx bench posix --engine psync
#   fio         fio io_uring, O_DIRECT, one file of blocks*bs, write then read, same bs and QD
#   fio-huge    the same fio run with its buffers in huge pages (--iomem=shmhuge)
#   nixl-aio    ../shared/peers/nixl_posix.py --engine aio   --layout per-block
#   nixl-uring  ../shared/peers/nixl_posix.py --engine uring --layout per-block
# all in a fresh subfolder of --dir with the same block size, block count and queue depth.
#
# With --after-evictions every tool writes into space written before, as a full tier does once
# it evicts to make room: kvx bench posix --after-evictions stores and evicts as many blocks
# before its clock (its timed stores write into the recycled files of evicted blocks), fio
# writes its file once before its timed write, and the peer's block files are written once
# before its run (it opens them without O_TRUNC, so it overwrites them). On a file system
# mounted with discard on a thin-provisioned virtual disk, writes into freshly freed space pay
# for the host's allocation underneath; the default (fresh space for every tool) measures that.
#
# Why fio twice: fio's own buffers are 4 KiB pages scattered in memory, and a disk that takes at
# most max_segments pieces per request (254 on a virtio disk) splits a 1 MiB I/O from them into
# two requests or more. On a disk that costs per request (a virtual one) that halves fio's reads.
# kvx's buffers sit in huge pages, as NIXL users' registered buffers usually do, so fio-huge is
# the physical path to hold kvx against. It needs huge pages: when fewer are free than fio's
# buffers need and /proc/sys/vm/nr_hugepages is writable (root), the script raises it for the
# run and puts it back at exit; otherwise the fio-huge row is skipped with a line saying so.
#
# Usage:
#   scripts/compare-posix.sh --dir DIR [--bs "256KiB 1MiB 4MiB"] [--blocks N] [--qd 32]
#                            [--rounds 3] [--after-evictions] [--kvx PATH] [--nixl-venv DIR]
#                            [--peer PATH]
#   --bs       block sizes (KiB/MiB suffixes), space- or comma-separated; default 256KiB 1MiB 4MiB
#   --blocks   blocks per run; default: 1 GiB worth per block size (4096, 1024, 256)
#   --after-evictions  every tool writes into space written before (see above)
#   --kvx      the kvx binary; default target/release/kvx (cargo build --release -p kvx-cli)
#   --nixl-venv  a venv with nixl-cu12 and numpy; default $NIXL_VENV or ~/nixl-venv. Without it
#              the peer rows are skipped (with the one-line setup) and kvx and fio still run.
#   --peer     the peer script; default ../shared/peers/nixl_posix.py next to the repository
#
# What is timed: every tool makes its files before its clock starts (fio lays out its file, the
# peer opens one empty file per block, kvx makes one spare file per block, preallocated to the
# block's file as its file tier does, and its 256 fan-out directories when the store opens);
# kvx's timed store still writes a header and checksum, renames each block into place and
# verifies every load. Queue depth is I/Os in flight for every tool (fio's iodepth, the peer's
# descriptors per request, kvx's store queue depth); kvx bench posix also keeps as many ops
# again waiting in the store (its --backlog), as an engine's step of blocks does. On ext4
# without a journal a create skips the inodes deleted in the last minutes one by one, so the
# cleanup of one run slows the file making of the next: the rotation spreads that over all tools.
#
# Needs bash, python3 (stdlib only, for JSON and medians) and fio. The per-run figures go to
# stderr as they come; stdout gets the table and, last, one JSON line. Exit status: 0 when every
# run succeeded, 1 when any failed (its figures are left out of the medians), 2 on bad usage.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=""
sizes="256KiB 1MiB 4MiB"
blocks=""
qd=32
rounds=3
evicted=0
kvx="$repo/target/release/kvx"
venv="${NIXL_VENV:-$HOME/nixl-venv}"
peer="$repo/../shared/peers/nixl_posix.py"

usage() { sed -n '/^# Usage:/,/^#   --peer /p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir=${2:?--dir needs a value}; shift 2 ;;
    --bs) sizes=${2:?--bs needs a value}; shift 2 ;;
    --blocks) blocks=${2:?--blocks needs a value}; shift 2 ;;
    --qd) qd=${2:?--qd needs a value}; shift 2 ;;
    --rounds) rounds=${2:?--rounds needs a value}; shift 2 ;;
    --after-evictions) evicted=1; shift ;;
    --kvx) kvx=${2:?--kvx needs a value}; shift 2 ;;
    --nixl-venv) venv=${2:?--nixl-venv needs a value}; shift 2 ;;
    --peer) peer=${2:?--peer needs a value}; shift 2 ;;
    -h|--help) usage ;;
    *) echo "compare-posix: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n "$dir" ]] || { echo "compare-posix: --dir is required" >&2; usage; }
for n in "$qd" "$rounds" ${blocks:+"$blocks"}; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "compare-posix: $n is not a positive integer" >&2; exit 2; }
done
[[ -x "$kvx" ]] || { echo "compare-posix: no kvx binary at $kvx (cargo build --release -p kvx-cli)" >&2; exit 2; }
command -v fio >/dev/null || { echo "compare-posix: fio not found (apt-get install fio)" >&2; exit 2; }
mkdir -p "$dir"

py=""
if [[ -x "$venv/bin/python" && -f "$peer" ]] && "$venv/bin/python" -c 'import numpy, nixl_cu12' 2>/dev/null; then
  py="$venv/bin/python"
else
  echo "compare-posix: NIXL peer skipped; set it up with: python3 -m venv $venv && $venv/bin/pip install --no-deps nixl-cu12 numpy (peer script: $peer)" >&2
fi

# bytes of a size like 1MiB, 256KiB, 4M, 4096
to_bytes() {
  local s=$1 num unit
  num=${s%%[!0-9]*}
  unit=${s#"$num"}
  [[ -n "$num" ]] || { echo "compare-posix: bad block size $s" >&2; exit 2; }
  case "${unit,,}" in
    ""|b) echo "$num" ;;
    k|kb|kib) echo $((num << 10)) ;;
    m|mb|mib) echo $((num << 20)) ;;
    g|gb|gib) echo $((num << 30)) ;;
    *) echo "compare-posix: bad block size unit in $s" >&2; exit 2 ;;
  esac
}

results=$(mktemp "${TMPDIR:-/tmp}/compare-posix.XXXXXX")
loadlog=$(mktemp "${TMPDIR:-/tmp}/compare-posix-load.XXXXXX")
work="$dir/compare-posix-$$"
hp_old=""
# shellcheck disable=SC2329  # run by the EXIT trap
cleanup() {
  rm -rf -- "$work"; rm -f -- "$results" "$loadlog"
  [[ -z "$hp_old" ]] || echo "$hp_old" >/proc/sys/vm/nr_hugepages || true
}
trap cleanup EXIT
failed=0

# fio-huge: huge pages for fio's buffers, QD x the largest block size, reserved for the run
huge=0
hp_kib=$(awk '/^Hugepagesize:/ {print $2}' /proc/meminfo 2>/dev/null || true)
hp_free() { awk '/^HugePages_Free:/ {f=$2} /^HugePages_Rsvd:/ {r=$2} END {print f-r}' /proc/meminfo; }
if [[ -n "$hp_kib" ]]; then
  max_bytes=0
  read -ra size_list <<<"${sizes//,/ }"
  for bs in "${size_list[@]}"; do b=$(to_bytes "$bs"); (( b > max_bytes )) && max_bytes=$b; done
  hp_need=$(( (qd * max_bytes + hp_kib * 1024 - 1) / (hp_kib * 1024) + 2 ))  # fio asks for two more
  free_pages=$(hp_free)
  if (( free_pages < hp_need )) && [[ -w /proc/sys/vm/nr_hugepages ]]; then
    hp_old=$(cat /proc/sys/vm/nr_hugepages)
    echo $(( hp_old + hp_need - free_pages )) >/proc/sys/vm/nr_hugepages || true
    free_pages=$(hp_free)
    echo "compare-posix: vm.nr_hugepages $hp_old -> $(cat /proc/sys/vm/nr_hugepages) for fio-huge's buffers (put back at exit)" >&2
  fi
  # Enough pages, and fio may map them (without root that takes vm.hugetlb_shm_group or a
  # large memlock limit): a 1 MiB write through them tells.
  if (( free_pages >= hp_need )) && mkdir -p "$work" &&
    fio --name=probe --filename="$work/probe" --rw=write --bs=1M --size=1M --direct=1 \
      --iomem=shmhuge >/dev/null 2>&1; then
    huge=1
  fi
  rm -f -- "$work/probe"
fi
(( huge )) || echo "compare-posix: fio-huge skipped: it needs ${hp_need:-some} free huge pages it may map (as root: echo ${hp_need:-N} > /proc/sys/vm/nr_hugepages)" >&2

# record BS TOOL PHASE GIB_S (of the round under way)
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$round" >>"$results"; }
# the first field named $1 of the last JSON object line on stdin
json_field() { python3 -c '
import json, sys
lines = [l for l in sys.stdin.read().splitlines() if l.startswith("{")]
print(round(float(json.loads(lines[-1])[sys.argv[1]]), 3))' "$1"; }

run_kvx() { # BS BYTES BLOCKS ENGINE
  local out
  local more=()
  (( evicted )) && more=(--after-evictions)
  if out=$("$kvx" bench posix --dir "$work" --block-size "$2" --blocks "$3" \
      --queue-depth "$qd" --engine "$4" "${more[@]}" --json 2>&1); then
    local s l
    s=$(json_field store_gib_s <<<"$out") l=$(json_field load_gib_s <<<"$out")
    record "$1" "kvx-$4" store "$s"; record "$1" "kvx-$4" load "$l"
    echo "  kvx-$4: store $s load $l" >&2
  else
    echo "  kvx-$4 FAILED: $(tail -n 3 <<<"$out")" >&2; failed=1
  fi
}

fio_bw() { # RW BYTES SIZE [FIO OPTION] -> GiB/s
  fio --name="compare-$1" --filename="$work/fio.dat" --rw="$1" --bs="$2" --iodepth="$qd" \
    --size="$3" --direct=1 --ioengine=io_uring --output-format=json ${4:+"$4"} 2>&1 |
    python3 -c '
import json, sys
t = sys.stdin.read()
v = json.loads(t[t.index("{"):])
print(round(v["jobs"][0][sys.argv[1]]["bw_bytes"] / 2**30, 3))' "$1"
}

run_fio() { # BS BYTES BLOCKS TOOL [FIO OPTION]
  local size=$(($2 * $3)) w r
  if (( evicted )) && ! fio_bw write "$2" "$size" "${5:-}" >/dev/null; then
    echo "  $4 FAILED (writing its file before the clock)" >&2; failed=1; return
  fi
  if w=$(fio_bw write "$2" "$size" "${5:-}") && r=$(fio_bw read "$2" "$size" "${5:-}"); then
    record "$1" "$4" store "$w"; record "$1" "$4" load "$r"
    echo "  $4: write $w read $r" >&2
  else
    echo "  $4 FAILED" >&2; failed=1
  fi
  rm -f -- "$work/fio.dat"
}

prewrite() { # DIR BYTES BLOCKS: the peer's block files b0.blk.., each written once, synced
  python3 -c '
import os, sys
d, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d, exist_ok=True)
data = os.urandom(size)
for i in range(n):
    fd = os.open(os.path.join(d, f"b{i}.blk"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.close(fd)
os.sync()' "$1" "$2" "$3"
}

run_nixl() { # BS BYTES BLOCKS ENGINE
  [[ -n "$py" ]] || return 0
  local out w r
  # the peer removes every file in its --dir after a round: give it its own folder
  if (( evicted )) && ! prewrite "$work/nixl" "$2" "$3"; then
    echo "  nixl-$4 FAILED (writing its files before the clock)" >&2; failed=1; return
  fi
  if out=$("$py" "$peer" --dir "$work/nixl" --block-size "$2" --blocks "$3" --qd "$qd" \
      --engine "$4" --layout per-block --rounds 1 2>&1); then
    w=$(json_field write_gib_s <<<"$out") r=$(json_field read_gib_s <<<"$out")
    record "$1" "nixl-$4" store "$w"; record "$1" "nixl-$4" load "$r"
    echo "  nixl-$4: write $w read $r" >&2
  else
    echo "  nixl-$4 FAILED: $(tail -n 3 <<<"$out")" >&2; failed=1
  fi
  rm -rf -- "$work/nixl"
}

tools=(kvx-uring kvx-psync fio nixl-aio nixl-uring)
(( huge )) && tools+=(fio-huge)
read -ra size_list <<<"${sizes//,/ }"
for bs in "${size_list[@]}"; do
  bytes=$(to_bytes "$bs")
  n=${blocks:-$(( (1 << 30) / bytes ))}
  (( n >= 1 )) || n=1
  for ((round = 0; round < rounds; round++)); do
    echo "[$(date +%T)] $bs x $n blocks, QD $qd, round $((round + 1))/$rounds, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    cut -d' ' -f1 /proc/loadavg >>"$loadlog"
    for ((k = 0; k < ${#tools[@]}; k++)); do
      tool=${tools[$(( (k + round) % ${#tools[@]} ))]}
      mkdir -p "$work"
      sync
      case "$tool" in
        kvx-*) run_kvx "$bs" "$bytes" "$n" "${tool#kvx-}" ;;
        fio) run_fio "$bs" "$bytes" "$n" fio ;;
        fio-huge) run_fio "$bs" "$bytes" "$n" fio-huge --iomem=shmhuge ;;
        nixl-*) run_nixl "$bs" "$bytes" "$n" "${tool#nixl-}" ;;
      esac
    done
  done
done
cut -d' ' -f1 /proc/loadavg >>"$loadlog"

python3 - "$results" "$loadlog" "$qd" "$rounds" "$dir" "$evicted" <<'EOF'
import json, statistics, sys
from collections import defaultdict

results, loadlog, qd, rounds, where, evicted = sys.argv[1:7]
space = "space written before (--after-evictions)" if evicted == "1" else "fresh space"
runs = defaultdict(list)  # (bs, tool, phase) -> GiB/s per round
by_round = {}  # (bs, tool, phase, round) -> GiB/s
order = []
for line in open(results):
    bs, tool, phase, v, rnd = line.rstrip("\n").split("\t")
    runs[(bs, tool, phase)].append(float(v))
    by_round[(bs, tool, phase, rnd)] = float(v)
    if bs not in order:
        order.append(bs)
loads = [float(x) for x in open(loadlog).read().split()]

def med(bs, tool, phase):
    v = runs.get((bs, tool, phase))
    return round(statistics.median(v), 3) if v else None

def fmt(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"

def ratio(a, b):
    return None if a is None or not b else round(a / b, 3)

tools = ["kvx-uring", "kvx-psync", "fio", "fio-huge", "nixl-aio", "nixl-uring"]
out = {"dir": where, "qd": int(qd), "rounds": int(rounds), "after_evictions": evicted == "1",
       "loadavg_1m": {"min": min(loads, default=None), "max": max(loads, default=None)},
       "sizes": {}}
print(f"medians of {rounds} alternating rounds, GiB/s, QD {qd}, writes into {space}, in {where}; "
      f"1-min load average {min(loads, default=0):.2f}-{max(loads, default=0):.2f}")
for bs in order:
    print(f"\n{bs}")
    print(f"  {'':22} {'store':>7} {'load':>7}   {'store range':>13} {'load range':>13}")
    entry = {}
    for t in tools:
        s, l = med(bs, t, "store"), med(bs, t, "load")
        if s is None and l is None:
            continue
        rs, rl = runs.get((bs, t, "store"), []), runs.get((bs, t, "load"), [])
        rng = lambda v: f"{min(v):.2f}-{max(v):.2f}" if v else "-"
        print(f"  {t:22} {fmt(s):>7} {fmt(l):>7}   {rng(rs):>13} {rng(rl):>13}")
        entry[t] = {"store_gib_s": s, "load_gib_s": l, "store_runs": rs, "load_runs": rl}
    peer = {}
    for ph in ("store", "load"):
        vals = [med(bs, t, ph) for t in ("nixl-aio", "nixl-uring")]
        vals = [v for v in vals if v is not None]
        peer[ph] = max(vals) if vals else None
    fio = {ph: med(bs, "fio", ph) for ph in ("store", "load")}
    fio_huge = {ph: med(bs, "fio-huge", ph) for ph in ("store", "load")}
    print(f"  {'ratio':22} {'store':>7} {'load':>7}")
    for t in ("kvx-uring", "kvx-psync"):
        for name, base in (("peer-best", peer), ("fio", fio), ("fio-huge", fio_huge)):
            if name == "fio-huge" and base["store"] is None and base["load"] is None:
                continue
            rs, rl = ratio(med(bs, t, "store"), base["store"]), ratio(med(bs, t, "load"), base["load"])
            print(f"  {t + '/' + name:22} {fmt(rs):>7} {fmt(rl):>7}")
            entry[f"{t}_vs_{name}"] = {"store": rs, "load": rl}
    # Paired: kvx against the peer's better engine of the same round (minutes apart, not
    # tens of minutes), then the median of those ratios; rounds missing a figure are skipped.
    print(f"  {'paired, median':22} {'store':>7} {'load':>7}")
    for t in ("kvx-uring", "kvx-psync"):
        med_pair = {}
        for ph in ("store", "load"):
            pairs = []
            for r in range(int(rounds)):
                k = by_round.get((bs, t, ph, str(r)))
                p = [by_round.get((bs, e, ph, str(r))) for e in ("nixl-aio", "nixl-uring")]
                p = [x for x in p if x]
                if k is not None and p:
                    pairs.append(k / max(p))
            med_pair[ph] = round(statistics.median(pairs), 3) if pairs else None
        print(f"  {t + '/peer-best':22} {fmt(med_pair['store']):>7} {fmt(med_pair['load']):>7}")
        entry[f"{t}_vs_peer-best_paired"] = med_pair
    out["sizes"][bs] = entry
print(json.dumps(out, separators=(",", ":")))
EOF
exit "$failed"
