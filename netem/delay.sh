#!/usr/bin/env bash
# Delay and jitter on an interface with tc netem, where the kernel has the netem qdisc.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] DELAY [JITTER]
       $PROG [options] --remove
       $PROG [options] --check

Add DELAY (and +-JITTER) to every packet leaving an interface with a tc netem qdisc (handle
$FTTREE_QDISC_HANDLE). Times use tc units: 50ms, 2ms, 0.5s. On lo inside a namespace every local
link is delayed (a packet between two ranks crosses lo once).

Many kernels (this project's CI machine among them) are built without the netem qdisc
(sch_netem). Then this script says so and exits with status 3; use fttree's in-process
delay instead, which delays one link in the transport's fault layer:
  fttree launch -n 7 --faults "delay 2-0 50ms @5..10"

Options:
  --dev DEV      the interface (default: lo with --netns; required otherwise)
  --remove       remove the delay
  --check        only say whether netem is available (exit 0 yes, 3 no)
$COMMON_HELP

Examples:
  $PROG --netns fttree 50ms 10ms
  $PROG --dev eth0 --remove
HELP
}

ARGS=() REMOVE=0 CHECK=0
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --remove) REMOVE=1; shift ;;
        --check) CHECK=1; shift ;;
        --dev) [[ $# -ge 2 ]] || die "--dev needs an interface"; DEV=$2; shift 2 ;;
        -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
if ((REMOVE || CHECK)); then
    [[ ${#ARGS[@]} -eq 0 ]] || die "--remove and --check take no DELAY"
else
    [[ ${#ARGS[@]} -ge 1 && ${#ARGS[@]} -le 2 ]] || { usage >&2; exit 2; }
fi
need_root
check_netns
default_dev
if ((REMOVE)); then
    remove_fttree_qdisc
    exit 0
fi

no_netem() {
    cat >&2 <<MSG
$PROG: this kernel ($(uname -r)) has no netem qdisc (sch_netem is neither built in nor loadable),
so tc cannot delay packets here. tc said: $1
Use fttree's in-process delay instead; it delays one link in the transport's fault layer:
  fttree launch -n 7 --faults "delay 2-0 50ms"            (whole run)
  fttree launch -n 7 --faults "delay 2-0 50ms @5..10"     (steps 5 to 10)
MSG
    exit 3
}

# Ask the kernel in a throwaway namespace (gone when tc exits), so the check never touches DEV.
netem_error() {
    if command -v unshare >/dev/null 2>&1; then
        # shellcheck disable=SC2069  # keep tc's stderr, drop its stdout
        unshare --net tc qdisc add dev lo root netem delay 1ms 2>&1 >/dev/null || true
    fi  # no unshare, or it failed for another reason: the real command below finds out
}
if err=$(netem_error); [[ $err == *"qdisc kind is unknown"* ]]; then
    no_netem "$err"
fi
if ((CHECK)); then
    echo "netem is available (kernel $(uname -r))"
    exit 0
fi
claim_root "$DEV"
JITTER=()
if [[ ${#ARGS[@]} -eq 2 ]]; then
    JITTER=("${ARGS[1]}")
fi
if ! err=$(in_ns tc qdisc replace dev "$DEV" root handle "$FTTREE_QDISC_HANDLE" netem delay "${ARGS[0]}" "${JITTER[@]}" 2>&1); then
    [[ $err == *"qdisc kind is unknown"* ]] && no_netem "$err"
    die "tc could not add netem delay ${ARGS[*]} on $DEV: $err"
fi
echo "delayed $DEV${NETNS:+ in $NETNS} by ${ARGS[0]}${JITTER:+ +- ${ARGS[1]}} (netem)"
