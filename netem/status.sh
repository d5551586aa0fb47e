#!/usr/bin/env bash
# List the fault rules fttree scripts installed (iptables rules tagged "fttree", tc qdiscs f7:).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [--netns NAME | --all]

List the iptables rules (comment "$FTTREE_TAG ...") and tc qdiscs (handle $FTTREE_QDISC_HANDLE) that the fttree
netem scripts installed, in the current namespace, in --netns NAME, or with --all in the
current namespace and every named one (ip netns list). Nothing else is shown or touched.
Exit status 0 either way; the last line says how many were found.

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
    where=${NETNS:-"current namespace"}
    [[ -n $NETNS ]] && where="namespace $NETNS"
    lines=()
    nfound=0
    for backend in $(iptables_backends); do
        while IFS= read -r rule; do
            lines+=("  $backend: $rule")
            nfound=$((nfound + 1))
        done < <(in_ns "$backend" -w 5 -S 2>/dev/null | grep -E -- "--comment \"?$FTTREE_TAG( |\"|$)" || true)
    done
    while read -r dev; do
        read -r kind handle <<<"$(root_qdisc "$dev")"
        if [[ $handle == "$FTTREE_QDISC_HANDLE" ]]; then
            lines+=("  tc $dev: $(in_ns tc qdisc show dev "$dev" | awk '/ root/ { $1 = ""; print substr($0, 2); exit }')")
            nfound=$((nfound + 1))
            if [[ $kind == htb && $dev == "$FTTREE_IFB" ]]; then  # downlink.sh: one class per rank
                while read -r rank addr rate bytes _; do
                    lines+=("    downlink of rank $rank $addr $rate, received $bytes bytes")
                done < <(uplink_lines "$dev" 16)
            elif [[ $kind == htb ]]; then  # uplink.sh: one class per rank (details, not counted)
                while read -r rank addr rate bytes _; do
                    lines+=("    uplink of rank $rank $addr $rate, sent $bytes bytes")
                done < <(uplink_lines "$dev")
            fi
        fi
    done < <(in_ns ls /sys/class/net)
    if [[ ${#lines[@]} -gt 0 ]]; then
        echo "$where:"
        printf '%s\n' "${lines[@]}"
    fi
    total=$((total + nfound))
done
if ((ALL)); then
    echo "$total fttree rules in ${#namespaces[@]} namespaces"
else
    echo "$total fttree rules in ${NETNS:+namespace }${NETNS:-the current namespace}"
fi
