#!/usr/bin/env bash
# Random packet loss on one link or on every link of a worker (iptables statistic match).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] LINK PERCENT
       $PROG [options] --remove LINK

Drop each packet of LINK with probability PERCENT (iptables -m statistic --mode random),
in both directions. TCP retransmits what is lost, so loss shows up as latency spikes and
stalls rather than missing frames. A new PERCENT on the same LINK replaces the old one.

LINK is A-B (two ranks), HOST1-HOST2 (two IPv4 addresses), or R / HOST (every link of a
worker or host), as for cut.sh. PERCENT is 0-100, with or without '%' (20 or 20% or 2.5%).

Options:
  --remove       remove the loss rules on LINK
$COMMON_HELP

Examples:
  $PROG --netns fttree 3-1 20%     # link 3<->1 loses 20% of its packets
  $PROG --netns fttree 3 5%        # every link of rank 3 loses 5%
HELP
}

ARGS=() REMOVE=0
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --remove) REMOVE=1; shift ;;
        -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
want=$((2 - REMOVE))
[[ ${#ARGS[@]} -eq $want ]] || { usage >&2; exit 2; }
need_root
check_netns
parse_target "${ARGS[0]}"
pick_iptables
PATTERN="^$(regex_quote "$FTTREE_TAG loss $TARGET") "
removed=$(delete_tagged "$PATTERN")
if ((REMOVE)); then
    echo "removed loss on $TARGET${NETNS:+ in $NETNS} ($removed rules)"
    exit 0
fi
PCT="${ARGS[1]%\%}"
[[ $PCT =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "PERCENT must be a number like 20 or 2.5%, got '${ARGS[1]}'"
PROB=$(awk -v p="$PCT" 'BEGIN { if (p > 100) exit 1; printf "%.6f", p / 100 }') \
    || die "PERCENT must be at most 100, got '${ARGS[1]}'"
add_drop_rules "$FTTREE_TAG loss $TARGET $PCT%" -m statistic --mode random --probability "$PROB"
echo "loss $PCT% on $TARGET${NETNS:+ in $NETNS} ($ADDR_A${ADDR_B:+ <-> $ADDR_B}${PORT:+, port $PORT}; $IPT)"
