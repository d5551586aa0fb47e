#!/usr/bin/env bash
# Remove every fault rule the fttree scripts installed, and nothing else.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [--netns NAME | --all]

Remove every iptables rule whose comment starts with "$FTTREE_TAG" (cuts and losses) and every tc
root qdisc with handle $FTTREE_QDISC_HANDLE (bandwidth limits, uplinks, delays), downlink.sh's ingress
redirects and its ifb device $FTTREE_IFB, in the current namespace,
in --netns NAME, or with --all in the current namespace and every named one. Rules and
qdiscs without the tag are never touched. Namespaces stay (cluster.sh down removes them).

Options:
  --all          every namespace
$COMMON_HELP
HELP
}

parse_all_options "$@"
need_root
check_netns

mapfile -t namespaces < <(selected_namespaces "$ALL")

total=0
for NETNS in "${namespaces[@]}"; do
    n=$(delete_tagged "^$FTTREE_TAG( |\$)")
    n=$((n + $(drop_downlink)))
    while read -r dev; do
        n=$((n + $(drop_root "$dev")))
    done < <(in_ns ls /sys/class/net)
    total=$((total + n))
    if ((n > 0)); then
        echo "removed $n fttree rules from ${NETNS:+namespace }${NETNS:-the current namespace}"
    fi
done
echo "reset done: $total fttree rules removed"
