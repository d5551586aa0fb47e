#!/usr/bin/env bash
# Limit the bandwidth of an interface with a tc token bucket (tbf).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] RATE
       $PROG [options] --remove

Shape everything leaving an interface to RATE with a tc tbf qdisc (handle $FTTREE_QDISC_HANDLE, so
status.sh and reset.sh know it). RATE uses tc units: 100mbit, 1gbit, 500kbit, 10mbps (bytes).
Inside a namespace made by cluster.sh the interface is lo, which every local link shares,
so the limit is on the sum of all links' traffic.

Options:
  --dev DEV      the interface (default: lo with --netns; required otherwise)
  --burst SIZE   bucket size (default: 10 ms of RATE, at least two MTUs)
  --latency T    longest a packet may wait in the queue (default 50ms)
  --remove       remove the limit
$COMMON_HELP

Examples:
  $PROG --netns fttree 100mbit
  $PROG --dev eth0 1gbit
HELP
}

RATE="" REMOVE=0 BURST="" LATENCY=50ms
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --remove) REMOVE=1; shift ;;
        --dev) [[ $# -ge 2 ]] || die "--dev needs an interface"; DEV=$2; shift 2 ;;
        --burst) [[ $# -ge 2 ]] || die "--burst needs a size"; BURST=$2; shift 2 ;;
        --latency) [[ $# -ge 2 ]] || die "--latency needs a time"; LATENCY=$2; shift 2 ;;
        -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
        *) [[ -z $RATE ]] || die "one RATE, got '$RATE' and '$1'"; RATE=$1; shift ;;
    esac
done
[[ -n $RATE || $REMOVE -eq 1 ]] || { usage >&2; exit 2; }
need_root
check_netns
default_dev
if ((REMOVE)); then
    remove_fttree_qdisc
    exit 0
fi
BYTES_PER_S=$(awk -v r="$RATE" 'BEGIN {
    if (!match(tolower(r), /^[0-9]+(\.[0-9]+)?/)) exit 1
    n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
    m["bit"] = 1/8; m["kbit"] = 1e3/8; m["mbit"] = 1e6/8; m["gbit"] = 1e9/8
    m["bps"] = 1; m["kbps"] = 1e3; m["mbps"] = 1e6; m["gbps"] = 1e9
    if (!(u in m)) exit 1
    printf "%d", n * m[u] }') || die "RATE must look like 100mbit, 1gbit, 500kbit or 10mbps, got '$RATE'"
if [[ -z $BURST ]]; then
    MTU=$(in_ns cat "/sys/class/net/$DEV/mtu")
    BURST=$((BYTES_PER_S / 100))
    ((BURST >= 2 * MTU)) || BURST=$((2 * MTU))
fi
claim_root "$DEV"
in_ns tc qdisc replace dev "$DEV" root handle "$FTTREE_QDISC_HANDLE" tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
echo "limited $DEV${NETNS:+ in $NETNS} to $RATE (tbf burst $BURST latency $LATENCY)"
