#!/usr/bin/env bash
# Cut one link (or every link of one worker or host) silently: iptables DROP, no RST.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] LINK

Cut LINK in both directions with iptables DROP rules (silent: no RST, no ICMP), so TCP
connections stall exactly as on a dead cable. Undo with heal.sh LINK, or reset.sh.

LINK is one of
  A-B            the link between ranks A and B (addresses BASE+A and BASE+B), e.g. 1-0
  HOST1-HOST2    the link between two IPv4 addresses, e.g. 10.0.0.1-10.0.0.2 (multi-machine:
                 run it on either machine, or both)
  R or HOST      every link of rank R or address HOST (the worker is isolated)

Options:
$COMMON_HELP

Examples:
  $PROG --netns fttree 1-0                # ranks 1 and 0 of a local cluster (netem/cluster.sh)
  $PROG --port 29500 10.0.0.1-10.0.0.2    # two machines, only fttree's port
HELP
}

SPEC=""
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
        *) [[ -z $SPEC ]] || die "one LINK at a time, got '$SPEC' and '$1'"; SPEC=$1; shift ;;
    esac
done
[[ -n $SPEC ]] || { usage >&2; exit 2; }
need_root
check_netns
parse_target "$SPEC"
pick_iptables
TAG="$FTTREE_TAG cut $TARGET"
if has_tag "$TAG"; then
    echo "$PROG: $TARGET is already cut${NETNS:+ in $NETNS}"
    exit 0
fi
add_drop_rules "$TAG"
echo "cut $TARGET${NETNS:+ in $NETNS} ($ADDR_A${ADDR_B:+ <-> $ADDR_B}${PORT:+, port $PORT}; $IPT)"
