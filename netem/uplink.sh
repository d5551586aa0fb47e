#!/usr/bin/env bash
# Give every rank its own outgoing (uplink) bandwidth: an htb class per rank address.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] RATE
       $PROG [options] --remove
       $PROG [options] --counters

Limit what each rank sends to RATE, every rank separately, like machines that each sit
behind their own uplink. One htb qdisc (handle $FTTREE_QDISC_HANDLE, so status.sh and reset.sh know it) on
the interface, with one class per rank: class ${FTTREE_QDISC_HANDLE}(r+1) holds everything whose source
address is rank r's (a u32 filter on the source). Ranks must send from their own address:
fttree binds its connections to it; gloo does with gloo_baseline.py --bind.

Not limited: what a rank sends to its own address (it would not leave the machine), and
traffic from addresses that are no rank's. ACKs count against the uplink of the rank that
sends them, as on a real link. RATE uses tc units: 100mbit, 1gbit, 500kbit, 10mbps (bytes).
Running it again replaces the limits (and zeroes the counters).

Options:
  --ranks N      ranks 0..N-1 get a limit (default 7)
  --rank R=RATE  rank R's uplink is RATE instead (repeat for several ranks): edges of
                 unequal speed
  --dev DEV      the interface (default: lo with --netns; required otherwise)
  --burst SIZE   bytes a rank may send at once after being idle (default: 10 ms of RATE,
                 at least one MTU of DEV)
  --remove       remove the limits
  --counters     print what each rank has sent since the limits were set, one line per rank:
                 RANK ADDRESS RATE SENT_BYTES SENT_PACKETS DROPPED OVERLIMITS (bytes with
                 IP headers; OVERLIMITS: how often the limit held the rank back)
$(grep -v -- '--port' <<<"$COMMON_HELP")

Examples:
  $PROG --netns fttree 100mbit              # 7 ranks, 100 Mbit/s up each
  $PROG --netns fttree --ranks 15 10mbit
  $PROG --netns fttree --rank 3=10mbit 100mbit   # rank 3 at 10 Mbit/s, the others at 100
  $PROG --netns fttree --counters
  $PROG --netns fttree --remove
HELP
}

declare -A RANK_RATE=()
parse_rank_limits sends "$@"
need_root
check_netns
default_dev

read -r KIND HANDLE <<<"$(root_qdisc "$DEV")"
WHERE="$DEV${NETNS:+ in $NETNS}"
# The root qdisc is fttree's but not an htb: bandwidth.sh's tbf or delay.sh's netem.
if [[ $HANDLE == "$FTTREE_QDISC_HANDLE" && $KIND != htb ]]; then
    die "$WHERE has fttree's $KIND qdisc (bandwidth.sh or delay.sh), not uplink limits; remove it first (bandwidth.sh --remove)"
fi

case $MODE in
    remove)
        remove_fttree_qdisc
        exit 0 ;;
    counters)
        [[ $HANDLE == "$FTTREE_QDISC_HANDLE" ]] || die "$WHERE has no uplink limits (set them with $PROG RATE)"
        uplink_lines "$DEV"
        exit 0 ;;
esac

last=$(rank_addr $((RANKS - 1)))  # dies on a bad --base or too many ranks, before touching tc
for r in "${!RANK_RATE[@]}"; do
    ((r < RANKS)) || die "--rank $r=${RANK_RATE[$r]}: rank $r is not below --ranks $RANKS"
done
MTU=$(in_ns cat "/sys/class/net/$DEV/mtu")
# burst_of RATE: --burst, or 10 ms of RATE and at least one MTU
burst_of() {
    local b
    [[ -z $BURST ]] || { echo "$BURST"; return; }
    b=$(($(rate_bytes_per_s "$1") / 100))
    ((b >= MTU)) || b=$MTU
    echo "$b"
}
# htb sends a class's packets in rounds of `quantum` bytes; at least one MTU, at most what
# htb accepts. With ceil = rate no class borrows, so it only sets the round size.
QUANTUM=$MTU
((QUANTUM <= 200000)) || QUANTUM=200000

claim_root "$DEV"
# Start from scratch, so that a smaller --ranks leaves no stale class behind.
[[ $HANDLE == "$FTTREE_QDISC_HANDLE" ]] && in_ns tc qdisc del dev "$DEV" root
# default 0: traffic no filter classifies goes out unshaped (htb's direct queue).
in_ns tc qdisc add dev "$DEV" root handle "$FTTREE_QDISC_HANDLE" htb default 0
{
    for ((r = 0; r < RANKS; r++)); do
        addr=$(rank_addr "$r")
        cls=$(printf '%s%x' "$FTTREE_QDISC_HANDLE" $((r + 1)))
        rate=${RANK_RATE[$r]:-$RATE}
        burst=$(burst_of "$rate")
        echo "class add dev $DEV parent $FTTREE_QDISC_HANDLE classid $cls htb rate $rate ceil $rate burst $burst cburst $burst quantum $QUANTUM"
        # A rank's packets to itself: flowid = the qdisc's own handle, which htb sends unshaped.
        echo "filter add dev $DEV parent $FTTREE_QDISC_HANDLE protocol ip prio 1 u32 match ip src $addr/32 match ip dst $addr/32 flowid $FTTREE_QDISC_HANDLE"
        echo "filter add dev $DEV parent $FTTREE_QDISC_HANDLE protocol ip prio 2 u32 match ip src $addr/32 flowid $cls"
    done
} | in_ns tc -batch - || {
    in_ns tc qdisc del dev "$DEV" root 2>/dev/null || true
    die "tc refused the uplink classes on $WHERE (nothing is left installed)"
}
others=""
for r in "${!RANK_RATE[@]}"; do others+=", rank $r ${RANK_RATE[$r]}"; done
echo "uplinks on $WHERE: ranks 0..$((RANKS - 1)) ($(rank_addr 0) .. $last) send at most $RATE each$others (htb burst $(burst_of "$RATE"))"
