#!/usr/bin/env bash
# Give every rank its own incoming (downlink) bandwidth: an htb class per rank address, on an
# ifb device that the interface's ingress redirects to.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] RATE
       $PROG [options] --remove
       $PROG [options] --counters

Limit what each rank receives to RATE, every rank separately, like machines that each sit
behind their own downlink: a rank pulling from six peers at once gets RATE in all, not six
times it. Pairs with uplink.sh (what each rank sends); set both for an edge device.

How: an ifb device $FTTREE_IFB, an ingress qdisc on the interface whose filter redirects every
IP packet to it, and on $FTTREE_IFB one htb qdisc (handle $FTTREE_QDISC_HANDLE, so status.sh and
reset.sh know it) with one class per rank: class ${FTTREE_QDISC_HANDLE}(r+1) holds everything whose
DESTINATION address is rank r's (a u32 filter on the destination). A separate script from
uplink.sh because these are separate kernel objects (an ingress qdisc and a device, not a root
qdisc): each script sets and removes its own, in either order.

Not limited: what a rank sends to its own address, and traffic to addresses that are no
rank's. ACKs count against the downlink of the rank they go to. RATE uses tc units: 100mbit,
1gbit, 500kbit, 10mbps (bytes). Running it again replaces the limits (and zeroes the counters).

Options:
  --ranks N      ranks 0..N-1 get a limit (default 7)
  --rank R=RATE  rank R's downlink is RATE instead (repeat for several ranks)
  --dev DEV      the interface whose incoming traffic is limited (default: lo with --netns;
                 required otherwise)
  --burst SIZE   bytes a rank may receive at once after being idle (default: 10 ms of RATE,
                 at least one MTU of DEV)
  --remove       remove the limits, the ingress redirect and $FTTREE_IFB
  --counters     print what each rank has received since the limits were set, one line per rank:
                 RANK ADDRESS RATE RECEIVED_BYTES RECEIVED_PACKETS DROPPED OVERLIMITS
                 (bytes with IP headers; OVERLIMITS: how often the limit held it back)
$(grep -v -- '--port' <<<"$COMMON_HELP")

Examples:
  $PROG --netns fttree 100mbit              # 7 ranks, 100 Mbit/s down each
  $PROG --netns fttree --ranks 8 100mbit && uplink.sh --netns fttree --ranks 8 100mbit
  $PROG --netns fttree --counters
  $PROG --netns fttree --remove
HELP
}

declare -A RANK_RATE=()
parse_rank_limits receives "$@"
need_root
check_netns
default_dev
[[ $DEV != "$FTTREE_IFB" ]] || die "--dev $DEV is the device the limits live on; name the interface the traffic arrives on"
WHERE="$DEV${NETNS:+ in $NETNS}"

case $MODE in
    remove)
        if [[ $(drop_downlink) -gt 0 ]]; then
            echo "removed the fttree downlinks${NETNS:+ in $NETNS}"
        else
            echo "$PROG: ${NETNS:-this namespace} has no fttree downlinks (nothing to remove)"
        fi
        exit 0 ;;
    counters)
        in_ns ip link show dev "$FTTREE_IFB" >/dev/null 2>&1 || die "${NETNS:-this namespace} has no downlink limits (set them with $PROG RATE)"
        uplink_lines "$FTTREE_IFB" 16
        exit 0 ;;
esac

last=$(rank_addr $((RANKS - 1)))  # dies on a bad --base or too many ranks, before touching tc
for r in "${!RANK_RATE[@]}"; do
    ((r < RANKS)) || die "--rank $r=${RANK_RATE[$r]}: rank $r is not below --ranks $RANKS"
done
# Somebody else's ingress qdisc on DEV is left alone.
if in_ns tc qdisc show dev "$DEV" ingress | grep -q . && ! has_downlink_ingress "$DEV"; then
    die "$WHERE already has an ingress qdisc that fttree did not install; remove it first (tc qdisc del dev $DEV ingress)"
fi
MTU=$(in_ns cat "/sys/class/net/$DEV/mtu")
# burst_of RATE: --burst, or 10 ms of RATE and at least one MTU
burst_of() {
    local b
    [[ -z $BURST ]] || { echo "$BURST"; return; }
    b=$(($(rate_bytes_per_s "$1") / 100))
    ((b >= MTU)) || b=$MTU
    echo "$b"
}
QUANTUM=$MTU
((QUANTUM <= 200000)) || QUANTUM=200000

# Start from scratch, so that a smaller --ranks leaves no stale class behind.
drop_downlink >/dev/null
in_ns ip link add "$FTTREE_IFB" type ifb 2>/dev/null ||
    die "cannot create the ifb device $FTTREE_IFB${NETNS:+ in $NETNS} (is the ifb kernel module available? modprobe ifb)"
# The queue of DEV (an ifb's default is 32 packets, which drops bursts from several senders
# at once that DEV itself would have queued).
in_ns ip link set dev "$FTTREE_IFB" mtu "$MTU" txqueuelen "$(in_ns cat "/sys/class/net/$DEV/tx_queue_len")" up
{
    # default 0: traffic no filter classifies goes on unshaped (htb's direct queue).
    echo "qdisc add dev $FTTREE_IFB root handle $FTTREE_QDISC_HANDLE htb default 0"
    for ((r = 0; r < RANKS; r++)); do
        addr=$(rank_addr "$r")
        cls=$(printf '%s%x' "$FTTREE_QDISC_HANDLE" $((r + 1)))
        rate=${RANK_RATE[$r]:-$RATE}
        burst=$(burst_of "$rate")
        echo "class add dev $FTTREE_IFB parent $FTTREE_QDISC_HANDLE classid $cls htb rate $rate ceil $rate burst $burst cburst $burst quantum $QUANTUM"
        # A rank's packets to itself: flowid = the qdisc's own handle, which htb sends unshaped.
        echo "filter add dev $FTTREE_IFB parent $FTTREE_QDISC_HANDLE protocol ip prio 1 u32 match ip src $addr/32 match ip dst $addr/32 flowid $FTTREE_QDISC_HANDLE"
        echo "filter add dev $FTTREE_IFB parent $FTTREE_QDISC_HANDLE protocol ip prio 2 u32 match ip dst $addr/32 flowid $cls"
    done
    # Last, so that nothing is redirected before the classes are there.
    echo "qdisc add dev $DEV handle ffff: ingress"
    echo "filter add dev $DEV parent ffff: protocol ip prio 1 u32 match u32 0 0 action mirred egress redirect dev $FTTREE_IFB"
} | in_ns tc -batch - || {
    drop_downlink >/dev/null
    die "tc refused the downlink classes on $WHERE (nothing is left installed)"
}
others=""
for r in "${!RANK_RATE[@]}"; do others+=", rank $r ${RANK_RATE[$r]}"; done
echo "downlinks on $WHERE: ranks 0..$((RANKS - 1)) ($(rank_addr 0) .. $last) receive at most $RATE each$others (htb on $FTTREE_IFB, burst $(burst_of "$RATE"))"
