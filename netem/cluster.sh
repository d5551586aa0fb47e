#!/usr/bin/env bash
# A local cluster in a network namespace: every rank on its own loopback address.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG up   [NAME] [-n N] [--base ADDR]
       $PROG down [NAME] [--kill]
       $PROG exec [NAME] -- COMMAND [ARGS...]
       $PROG list

A network namespace is a private copy of the network stack: its own loopback, its own
firewall. Workers started inside it talk over that loopback, and the rules cut.sh and
loss.sh put there (with --netns NAME) touch nobody outside.

  up     create namespace NAME (default: fttree), bring its loopback up and make sure
         ranks 0..N-1 have the addresses ADDR+r (default base 127.0.0.1: rank r on
         127.0.0.(r+1), which the loopback's 127.0.0.0/8 already covers; another base is
         added to lo as /32 addresses). N defaults to 7.
  down   delete namespace NAME (with its rules). Processes still inside keep it alive:
         stop them first, or --kill sends them SIGTERM (then SIGKILL after 5 s).
  exec   run COMMAND inside NAME, e.g. the whole job:
           $PROG exec fttree -- fttree launch -n 7 --steps 20
  list   the namespaces on this machine

Options:
  -n N           number of ranks (up)
  --base ADDR    address of rank 0 (up; default 127.0.0.1)
  --kill         stop processes still inside the namespace (down)
  -h, --help     this help

A whole session (one shell runs the job, another cuts and heals while it runs):
  sudo $PROG up demo
  sudo $PROG exec demo -- fttree launch -n 7 --steps 200
  sudo netem/cut.sh --netns demo 1-0;  sudo netem/heal.sh --netns demo 1-0
  sudo $PROG down demo
HELP
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
CMD=$1
shift
case $CMD in
    -h|--help) usage; exit 0 ;;
    up|down|exec|list) ;;
    *) die "unknown command '$CMD': use up, down, exec or list (see --help)" ;;
esac

NAME="" WORLD=7 KILL=0 REST=()
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        -n) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "-n needs a number of ranks"; WORLD=$2; shift 2 ;;
        --base) [[ $# -ge 2 ]] || die "--base needs an address"; BASE=$2; shift 2 ;;
        --kill) KILL=1; shift ;;
        --) shift; REST=("$@"); break ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *) [[ -z $NAME ]] || die "one namespace name, got '$NAME' and '$1'"; NAME=$1; shift ;;
    esac
done
NAME=${NAME:-fttree}
[[ $NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "namespace names are letters, digits, '_', '.', '-': got '$NAME'"

exists() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$NAME"
}

case $CMD in
    list)
        ip netns list
        ;;
    up)
        need_root
        ((WORLD >= 1)) || die "-n must be at least 1"
        last=$(rank_addr $((WORLD - 1)))
        if exists; then
            echo "namespace $NAME exists already; checking it"
        else
            ip netns add "$NAME" || die "could not create namespace $NAME (is this a container without CAP_SYS_ADMIN?)"
        fi
        ip -n "$NAME" link set lo up
        if [[ $BASE != 127.* ]]; then
            for ((r = 0; r < WORLD; r++)); do
                addr=$(rank_addr "$r")
                ip -n "$NAME" -4 addr show dev lo | grep -q " $addr/" || ip -n "$NAME" addr add "$addr/32" dev lo
            done
        fi
        # Every rank's address must be local inside the namespace: ask the routing table.
        for ((r = 0; r < WORLD; r++)); do
            addr=$(rank_addr "$r")
            ip -n "$NAME" route get "$addr" 2>/dev/null | grep -q "^local $addr" \
                || die "address $addr of rank $r is not local in namespace $NAME"
        done
        echo "namespace $NAME up: lo up, ranks 0..$((WORLD - 1)) on $(rank_addr 0) .. $last"
        echo "run a job in it:  $0 exec $NAME -- fttree launch -n $WORLD"
        ;;
    down)
        need_root
        exists || { echo "$PROG: no namespace $NAME (nothing to do)"; exit 0; }
        pids=$(ip netns pids "$NAME" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            if ((KILL)); then
                # shellcheck disable=SC2086
                kill -TERM $pids 2>/dev/null || true
                for _ in $(seq 50); do
                    [[ -z $(ip netns pids "$NAME" 2>/dev/null || true) ]] && break
                    sleep 0.1
                done
                pids=$(ip netns pids "$NAME" 2>/dev/null || true)
                # shellcheck disable=SC2086
                [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
            else
                die "processes still run in $NAME (pids: ${pids//$'\n'/ }); stop them, or use --kill"
            fi
        fi
        ip netns del "$NAME"
        echo "namespace $NAME deleted (its firewall rules and qdiscs went with it)"
        ;;
    exec)
        need_root
        exists || die "no namespace $NAME (create it with $PROG up $NAME)"
        [[ ${#REST[@]} -gt 0 ]] || die "exec needs a command after --"
        exec ip netns exec "$NAME" "${REST[@]}"
        ;;
esac
