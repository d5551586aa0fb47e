#!/usr/bin/env bash
# Ranks behind NATs, in network namespaces: public ranks on one network, each site behind its
# own NAT router (iptables MASQUERADE, no port forwarding).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

PUBLIC_NET="10.77.0"   # public ranks are 10.77.0.(10+r), site k's router 10.77.0.(200+k)
SITE_NET="10.78"       # site k is 10.78.k.0/24: its router 10.78.k.1, its ranks 10.78.k.(10+r)
NAT_TAG="$FTTREE_TAG nat"

usage() {
    cat <<HELP
Usage: $PROG up    NAME --public RANKS [--site RANKS]... [--nat-ports keep|random|random-fully] [--routed]
       $PROG exec  NAME RANK -- COMMAND [ARGS...]
       $PROG peers NAME [--port P] [--site-local]
       $PROG down  NAME
       $PROG list

Builds a small internet in network namespaces, one namespace per rank (NAME-rR):

  public ranks   share one network (a bridge in NAME-hub): rank r is $PUBLIC_NET.(10+r);
                 any rank can dial them.
  --site RANKS   one site behind its own NAT router (namespace NAME-natK, K = 1, 2, ... in
                 the order given): its ranks are $SITE_NET.K.(10+r) on the site's own
                 network, and the router masquerades them to its public address
                 $PUBLIC_NET.(200+K). No port is forwarded and new connections from outside
                 are dropped: site ranks dial the public ranks and their site-mates, nobody
                 else can dial them, and two sites cannot dial each other.
  --nat-ports M  how the routers map source ports: keep (default: MASQUERADE keeps a
                 connection's source port where it is free, as most home routers do, so a
                 TCP hole punch can work), random (MASQUERADE --random) or random-fully
                 (--random-fully: a new port for every connection, as carrier NATs do)
  --routed       the control for measurements: the same namespaces and routers, but the
                 routers only route (no NAT, no firewall) and every rank can dial every
                 other, so a run here differs from an all-public one by the routers' hop
                 alone and from a NAT run by the NATs alone; peers lists every rank's
                 host:port

  up     create it all (fails, removing what it made, if any step fails)
  exec   run COMMAND as rank RANK (inside NAME-rRANK)
  peers  the peers file of the job, one line per rank: a public rank's host:port; a site
         rank's "-" (nobody dials it), or with --site-local "HOST:PORT behind siteK", which
         its site-mates dial. --port P: the port every rank listens on (default 29500)
  down   stop every process in NAME's namespaces and delete them with their interfaces and
         rules (nothing of NAME left: a no-op)
  list   the namespaces of every such network on this machine

Only namespaces and the interfaces inside them are made; the host's own interfaces, routes
and firewall are never touched. To limit each rank's uplink on its own interface (the same
for site ranks and public ones): fttree launch --shape-uplink RATE, or by hand
uplink.sh --netns NAME-rR --dev eth0 --base ADDRESS --ranks 1 RATE, with the rank's ADDRESS
from peers --site-local.

Example (ranks 0..2 public, 3 and 4 behind one NAT):
  sudo $PROG up demo --public 0,1,2 --site 3,4
  sudo $PROG peers demo --site-local > peers.txt
  sudo $PROG exec demo 3 -- fttree worker --rank 3 --peers peers.txt
  sudo $PROG down demo
HELP
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
CMD=$1
shift
case $CMD in
    -h|--help) usage; exit 0 ;;
    up|down|exec|peers|list) ;;
    *) die "unknown command '$CMD': use up, exec, peers, down or list (see --help)" ;;
esac

NAME="" PUBLIC="" SITES=() RANK="" REST=() NAT_PORT=29500 SITE_LOCAL=0 NAT_PORTS=keep ROUTED=0
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --public) [[ $# -ge 2 ]] || die "--public needs a list of ranks (0,1,2)"; PUBLIC=$2; shift 2 ;;
        --site) [[ $# -ge 2 ]] || die "--site needs a list of ranks (3,4)"; SITES+=("$2"); shift 2 ;;
        --port) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--port needs a port number"; NAT_PORT=$2; shift 2 ;;
        --site-local) SITE_LOCAL=1; shift ;;
        --routed) ROUTED=1; shift ;;
        --nat-ports)
            [[ $# -ge 2 && $2 =~ ^(keep|random|random-fully)$ ]] \
                || die "--nat-ports is keep, random or random-fully: got '${2:-}'"
            NAT_PORTS=$2; shift 2 ;;
        --) shift; REST=("$@"); break ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *)
            if [[ -z $NAME ]]; then
                NAME=$1
            elif [[ $CMD == exec && -z $RANK ]]; then
                RANK=$1
            else
                die "unexpected argument '$1' (see --help)"
            fi
            shift ;;
    esac
done
[[ $CMD == list || -n $NAME ]] || die "name the network: $PROG $CMD NAME ..."
[[ -z $NAME || $NAME =~ ^[A-Za-z0-9_.]+$ ]] || die "network names are letters, digits, '_', '.': got '$NAME'"

# The namespaces of network NAME, one per line (those of another network never match).
our_namespaces() {
    ip netns list 2>/dev/null | awk '{ print $1 }' \
        | grep -E "^${NAME//./\\.}-(hub|r[0-9]+|nat[0-9]+)\$" || true
}

exists() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$1"
}

# ranks LIST: the ranks of a comma-separated list, one per line; dies on anything else.
ranks() {
    [[ $1 =~ ^[0-9]+(,[0-9]+)*$ ]] || die "a list of ranks is digits and commas (0,1,2): got '$1'"
    tr , '\n' <<<"$1"
}

remove_all() {
    local ns pids
    for ns in $(our_namespaces); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        # shellcheck disable=SC2086  # one word per pid
        [[ -z $pids ]] || kill -TERM $pids 2>/dev/null || true
    done
    for _ in $(seq 50); do
        local left=0
        for ns in $(our_namespaces); do
            [[ -z $(ip netns pids "$ns" 2>/dev/null || true) ]] || left=1
        done
        ((left)) || break
        sleep 0.1
    done
    for ns in $(our_namespaces); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        # shellcheck disable=SC2086
        [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true  # its interfaces, veth peers and rules go with it
    done
}

# make_host NS ADDR/PREFIX GATEWAY HUB_NS HUB_END BRIDGE [DEV]: namespace NS with interface
# DEV (eth0) at ADDR, whose other end HUB_END in HUB_NS is a port of BRIDGE there, and a
# default route via GATEWAY (none if empty).
make_host() {
    local ns=$1 addr=$2 gateway=$3 hub=$4 end=$5 bridge=$6 dev=${7:-eth0}
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$hub" link add "$end" type veth peer name "$dev" netns "$ns"
    ip -n "$hub" link set "$end" master "$bridge" up
    ip -n "$ns" addr add "$addr" dev "$dev"
    ip -n "$ns" link set "$dev" up
    if [[ -n $gateway ]]; then
        ip -n "$ns" route add default via "$gateway"
    fi
}

up() {
    need_root
    [[ -n $PUBLIC ]] || die "up needs --public RANKS (at least one rank everybody can dial)"
    local -A seen=()
    local r k
    for r in $(ranks "$PUBLIC") $(for s in "${SITES[@]}"; do ranks "$s"; done); do
        [[ -z ${seen[$r]:-} ]] || die "rank $r is listed twice"
        ((10#$r <= 180)) || die "rank $r: at most rank 180 (addresses .10 to .190)"
        seen[$r]=1
    done
    ((${#SITES[@]} <= 50)) || die "at most 50 sites"
    [[ -z $(our_namespaces) ]] || die "network $NAME exists already (remove it with $PROG down $NAME)"
    trap 'echo "$PROG: up failed; removing what it made" >&2; remove_all' EXIT
    local hub="$NAME-hub"
    ip netns add "$hub" || die "could not create namespace $hub (is this a container without CAP_SYS_ADMIN?)"
    ip -n "$hub" link set lo up
    ip -n "$hub" link add br0 type bridge
    ip -n "$hub" link set br0 up
    for r in $(ranks "$PUBLIC"); do
        make_host "$NAME-r$r" "$PUBLIC_NET.$((10 + 10#$r))/24" "" "$hub" "r$r" br0
    done
    k=0
    for s in "${SITES[@]}"; do
        k=$((k + 1))
        local nat="$NAME-nat$k"
        make_host "$nat" "$PUBLIC_NET.$((200 + k))/24" "" "$hub" "nat$k" br0 wan
        ip -n "$nat" link add lan type bridge
        ip -n "$nat" addr add "$SITE_NET.$k.1/24" dev lan
        ip -n "$nat" link set lan up
        ip netns exec "$nat" sysctl -qw net.ipv4.ip_forward=1
        if ((!ROUTED)); then
            NETNS=$nat
            pick_iptables
            # masquerade what leaves for the public network; let in only what answers it
            local mapping=()
            [[ $NAT_PORTS == keep ]] || mapping=("--$NAT_PORTS")
            ipt -t nat -A POSTROUTING -o wan -m comment --comment "$NAT_TAG" -j MASQUERADE "${mapping[@]}"
            ipt -A FORWARD -i wan -o lan -m conntrack --ctstate ESTABLISHED,RELATED -m comment --comment "$NAT_TAG" -j ACCEPT
            ipt -A FORWARD -i wan -m comment --comment "$NAT_TAG" -j DROP
            ipt -A INPUT -i wan -p tcp --syn -m comment --comment "$NAT_TAG" -j DROP
        fi
        for r in $(ranks "$s"); do
            make_host "$NAME-r$r" "$SITE_NET.$k.$((10 + 10#$r))/24" "$SITE_NET.$k.1" "$nat" "r$r" lan
        done
    done
    if ((ROUTED)); then
        # plain routers: every public rank and every other router reaches site k through its router
        ip -n "$hub" link set br0 alias routed  # the mark `peers` reads
        local j
        for ((k = 1; k <= ${#SITES[@]}; k++)); do
            for r in $(ranks "$PUBLIC"); do
                ip -n "$NAME-r$r" route add "$SITE_NET.$k.0/24" via "$PUBLIC_NET.$((200 + k))"
            done
            for ((j = 1; j <= ${#SITES[@]}; j++)); do
                ((j == k)) || ip -n "$NAME-nat$j" route add "$SITE_NET.$k.0/24" via "$PUBLIC_NET.$((200 + k))"
            done
        done
    fi
    trap - EXIT
    echo "network $NAME up$( ((ROUTED)) && echo ' (routed: no NAT)'): public ranks $PUBLIC on $PUBLIC_NET.0/24;$(k=0; for s in "${SITES[@]}"; do
        k=$((k + 1)); printf ' site%d (ranks %s) behind %s.%d' "$k" "$s" "$PUBLIC_NET" $((200 + k)); done)"
    echo "peers file:  $0 peers $NAME [--site-local];  run a rank:  $0 exec $NAME RANK -- COMMAND"
}

# The peers file: one line per rank 0..max, from the addresses the namespaces hold.
peers() {
    local -a lines=()
    local ns r addr max=-1 routed=0
    [[ $(ip -n "$NAME-hub" -o link show br0 2>/dev/null) == *"alias routed"* ]] && routed=1
    for ns in $(our_namespaces); do
        [[ $ns =~ -r([0-9]+)$ ]] || continue
        r=${BASH_REMATCH[1]}
        addr=$(ip -n "$ns" -4 -o addr show dev eth0 | awk '{ split($4, a, "/"); print a[1]; exit }')
        [[ -n $addr ]] || die "rank $r's namespace $ns has no address on eth0"
        if [[ $addr == "$PUBLIC_NET".* ]] || ((routed)); then
            lines[r]="$addr:$NAT_PORT"
        elif ((SITE_LOCAL)); then
            local site=${addr#"$SITE_NET".}
            lines[r]="$addr:$NAT_PORT behind site${site%%.*}"
        else
            lines[r]="-"
        fi
        ((10#$r > max)) && max=$((10#$r))
    done
    ((max >= 0)) || die "no network $NAME (create it with $PROG up $NAME ...)"
    for ((r = 0; r <= max; r++)); do
        [[ -n ${lines[r]:-} ]] || die "rank $r has no namespace in network $NAME: ranks must be 0..$max"
        echo "${lines[r]}"
    done
}

case $CMD in
    list)
        ip netns list 2>/dev/null | awk '{ print $1 }' | grep -E -- '-hub$' | sed 's/-hub$//' || true
        ;;
    up)
        up
        ;;
    peers)
        peers
        ;;
    exec)
        need_root
        [[ $RANK =~ ^[0-9]+$ ]] || die "exec needs a rank: $PROG exec $NAME RANK -- COMMAND"
        exists "$NAME-r$RANK" || die "no rank $RANK in network $NAME (create it with $PROG up $NAME ...)"
        [[ ${#REST[@]} -gt 0 ]] || die "exec needs a command after --"
        exec ip netns exec "$NAME-r$RANK" "${REST[@]}"
        ;;
    down)
        need_root
        if [[ -z $(our_namespaces) ]]; then
            echo "$PROG: no network $NAME (nothing to do)"
            exit 0
        fi
        remove_all
        [[ -z $(our_namespaces) ]] || die "could not remove every namespace of $NAME: $(our_namespaces | tr '\n' ' ')"
        echo "network $NAME removed (its namespaces, interfaces and rules)"
        ;;
esac
