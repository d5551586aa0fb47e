# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables here are used by the scripts that source this file
# Shared helpers for the fttree netem scripts. Sourced, never run.
#
# Every iptables rule these scripts install carries the comment "fttree ..." and every tc
# qdisc they install has the handle f7: so that status.sh and reset.sh find exactly the
# rules fttree made and never touch anything else.

FTTREE_TAG="fttree"
FTTREE_QDISC_HANDLE="f7:"
PROG="$(basename "$0")"

NETNS="${FTTREE_NETNS:-}"   # --netns NAME: run iptables/tc inside this namespace
BASE="127.0.0.1"            # --base ADDR: rank r has the address BASE + r
PORT=""                     # --port P: only TCP traffic to or from this port

die() {
    echo "$PROG: $*" >&2
    exit 1
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "needs root (iptables, tc and ip netns change the kernel's network state): run it with sudo"
}

# Run a command inside --netns when one was given, else in the current namespace.
in_ns() {
    if [[ -n $NETNS ]]; then
        ip netns exec "$NETNS" "$@"
    else
        "$@"
    fi
}

check_netns() {
    [[ -z $NETNS ]] && return 0
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$NETNS" \
        || die "network namespace '$NETNS' does not exist (create it with netem/cluster.sh up $NETNS)"
}

# The iptables binaries to look at: FTTREE_IPTABLES if set; else iptables (nft or legacy,
# whatever the system picked) when it works, and iptables-legacy when iptables is not legacy
# itself and either iptables does not work or legacy tables already exist here (reading
# them with iptables-legacy would create them, and then iptables-nft warns on every call).
iptables_backends() {
    if [[ -n ${FTTREE_IPTABLES:-} ]]; then
        echo "$FTTREE_IPTABLES"
        return 0
    fi
    local nft_ok=0
    if command -v iptables >/dev/null 2>&1 && in_ns iptables -w 5 -S INPUT >/dev/null 2>&1; then
        echo iptables
        nft_ok=1
        iptables -V 2>/dev/null | grep -q legacy && return 0
    fi
    command -v iptables-legacy >/dev/null 2>&1 || return 0
    if ((!nft_ok)) || [[ -n $(in_ns cat /proc/net/ip_tables_names 2>/dev/null) ]]; then
        if in_ns iptables-legacy -w 5 -S INPUT >/dev/null 2>&1; then
            echo iptables-legacy
        fi
    fi
    return 0
}

# The backend new rules go to: the first that works.
IPT=""
pick_iptables() {
    local -a found
    mapfile -t found < <(iptables_backends)
    IPT="${found[0]:-}"
    [[ -n $IPT ]] || die "no working iptables here (apt-get install iptables); tried iptables and iptables-legacy${NETNS:+ inside namespace $NETNS}"
}

ipt() {
    in_ns "$IPT" -w 5 "$@"
}

is_ipv4() {
    [[ $1 =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || return 1
    local o
    for o in "${BASH_REMATCH[@]:1}"; do
        ((10#$o <= 255)) || return 1
    done
}

# rank_addr R: the address of rank R (BASE + R in the last octet).
rank_addr() {
    local rank=$1 prefix last
    is_ipv4 "$BASE" || die "--base must be an IPv4 address like 127.0.0.1, got '$BASE'"
    prefix="${BASE%.*}"
    last="${BASE##*.}"
    ((10#$last + rank <= 254)) || die "rank $rank from base $BASE runs past .254"
    echo "$prefix.$((10#$last + rank))"
}

# endpoint X: X is a rank (digits) or an IPv4 address; prints the address.
endpoint() {
    if [[ $1 =~ ^[0-9]+$ ]]; then
        rank_addr "$1"
    elif is_ipv4 "$1"; then
        echo "$1"
    else
        die "'$1' is neither a rank nor an IPv4 address"
    fi
}

# parse_target SPEC: SPEC is A-B (a link: two ranks or two addresses) or X (every link of one
# rank or host). Sets ADDR_A, ADDR_B (empty for X) and TARGET, a normalized name for the tag
# (ranks sorted, so 1-0 and 0-1 name the same link).
ADDR_A="" ADDR_B="" TARGET=""
parse_target() {
    local spec=$1 a b
    if [[ $spec == *-* ]]; then
        a="${spec%%-*}"
        b="${spec#*-}"
        [[ -n $a && -n $b && $b != *-* ]] || die "bad link '$spec': use A-B with two ranks (1-0) or two IPv4 addresses"
        [[ $a != "$b" ]] || die "link '$spec' goes from $a to itself"
        local swap=0
        if [[ $a =~ ^[0-9]+$ && $b =~ ^[0-9]+$ ]]; then
            ((10#$a > 10#$b)) && swap=1
        elif [[ $a > $b ]]; then
            swap=1
        fi
        if ((swap)); then
            local t=$a; a=$b; b=$t
        fi
        ADDR_A="$(endpoint "$a")"
        ADDR_B="$(endpoint "$b")"
        TARGET="$a-$b"
    else
        ADDR_A="$(endpoint "$spec")"
        ADDR_B=""
        TARGET="$spec"
    fi
}

# The match for traffic to or from --port, if one was given.
port_match() {
    if [[ -n $PORT ]]; then
        echo "-p tcp -m multiport --ports $PORT"
    fi
}

# add_drop_rules TAG [statistic args...]: DROP in INPUT, both directions of the parsed target.
# Only INPUT: a DROP in OUTPUT makes the sender's own syscalls fail with EPERM, which is not
# silent. Dropping on input loses the data one way and its ACKs the other, so a TCP link is
# cut both ways even when only one of two machines runs the script.
add_drop_rules() {
    local tag=$1
    shift
    local -a extra=("$@") pm
    read -r -a pm <<<"$(port_match)"
    if [[ -n $ADDR_B ]]; then
        ipt -I INPUT 1 -s "$ADDR_A" -d "$ADDR_B" "${pm[@]}" "${extra[@]}" -m comment --comment "$tag" -j DROP
        ipt -I INPUT 1 -s "$ADDR_B" -d "$ADDR_A" "${pm[@]}" "${extra[@]}" -m comment --comment "$tag" -j DROP
    else
        ipt -I INPUT 1 -s "$ADDR_A" "${pm[@]}" "${extra[@]}" -m comment --comment "$tag" -j DROP
        ipt -I INPUT 1 -d "$ADDR_A" "${pm[@]}" "${extra[@]}" -m comment --comment "$tag" -j DROP
    fi
}

# tagged_rule_numbers BACKEND CHAIN PATTERN: line numbers (highest first) of rules whose
# comment matches the awk regex PATTERN.
tagged_rule_numbers() {
    local backend=$1 chain=$2 pattern=$3
    in_ns "$backend" -w 5 -L "$chain" -n --line-numbers 2>/dev/null | awk -v pat="$pattern" '
        $1 ~ /^[0-9]+$/ && match($0, /\/\* [^*]* \*\//) {
            c = substr($0, RSTART + 3, RLENGTH - 6)
            if (c ~ pat) print $1
        }' | sort -rn
}

# delete_tagged PATTERN: remove every rule (INPUT, OUTPUT, FORWARD, every backend) whose
# comment matches PATTERN; prints how many it removed.
delete_tagged() {
    local pattern=$1 backend chain n count=0
    for backend in $(iptables_backends); do
        for chain in INPUT OUTPUT FORWARD; do
            for n in $(tagged_rule_numbers "$backend" "$chain" "$pattern"); do
                in_ns "$backend" -w 5 -D "$chain" "$n"
                count=$((count + 1))
            done
        done
    done
    echo "$count"
}

has_tag() {
    local tag=$1
    [[ -n $(tagged_rule_numbers "$IPT" INPUT "^$(regex_quote "$tag")\$") ]]
}

regex_quote() {
    # shellcheck disable=SC2001,SC2016  # a regex-escaping sed; the $ is a regex character
    sed 's/[][\.|$(){}?+*^]/\\&/g' <<<"$1"
}

# Common options; sets SHIFTED to how many words it consumed (0 when the word is not one).
SHIFTED=0
common_option() {
    SHIFTED=0
    case $1 in
        --netns) [[ $# -ge 2 ]] || die "--netns needs a namespace name"; NETNS=$2; SHIFTED=2 ;;
        --base) [[ $# -ge 2 ]] || die "--base needs an address"; BASE=$2; SHIFTED=2 ;;
        --port)
            [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--port needs a port number"
            PORT=$2; SHIFTED=2 ;;
    esac
}

COMMON_HELP="  --netns NAME   act inside this network namespace (default: the current one; or set FTTREE_NETNS)
  --base ADDR    rank r has the address ADDR + r (default 127.0.0.1, as fttree launch uses)
  --port P       only touch TCP traffic to or from port P (keeps ssh alive on real machines)
  -h, --help     this help"

# ---- tc (bandwidth.sh, delay.sh) ----------------------------------------------------------

DEV=""
# default_dev: lo inside a namespace (every local link goes through it); required otherwise.
default_dev() {
    if [[ -z $DEV ]]; then
        [[ -n $NETNS ]] || die "name the interface with --dev (for example --dev eth0), or use --netns NAME for lo inside it"
        DEV=lo
    fi
    in_ns ip link show dev "$DEV" >/dev/null 2>&1 || die "no interface '$DEV'${NETNS:+ in namespace $NETNS}"
}

# root_qdisc DEV: "KIND HANDLE" of the root qdisc of DEV.
root_qdisc() {
    in_ns tc qdisc show dev "$1" | awk '$0 ~ / root/ { print $2, $3; exit }'
}

# claim_root DEV: fail unless the root qdisc of DEV is the default one or ours, so that
# bandwidth.sh / delay.sh never replace a qdisc somebody else configured.
claim_root() {
    local kind handle
    read -r kind handle <<<"$(root_qdisc "$1")"
    if [[ $handle == "$FTTREE_QDISC_HANDLE" ]]; then
        return 0
    fi
    case $kind in
        ""|noqueue|pfifo_fast|fq_codel|mq|fq|pfifo) return 0 ;;
    esac
    die "$1 already has a root qdisc '$kind $handle' that fttree did not install; remove it first (tc qdisc del dev $1 root)"
}

# drop_root DEV: remove our root qdisc from DEV (prints 1 if it removed one, else 0).
drop_root() {
    local kind handle
    read -r kind handle <<<"$(root_qdisc "$1")"
    if [[ $handle == "$FTTREE_QDISC_HANDLE" ]]; then
        in_ns tc qdisc del dev "$1" root
        echo 1
    else
        echo 0
    fi
}

# The namespaces a status or reset run covers, one per line ("" is the current one):
# --netns NAME (or the current namespace), or with --all the current one and every named one.
selected_namespaces() {
    if (($1)); then
        echo ""
        local ns
        ip netns list 2>/dev/null | while read -r ns _; do
            if [[ -n $ns ]]; then echo "$ns"; fi
        done
    else
        echo "$NETNS"
    fi
}

# Options of status.sh and reset.sh: --all (sets ALL=1), -h/--help (the script's usage), and
# the options every script takes.
parse_all_options() {
    ALL=0
    while [[ $# -gt 0 ]]; do
        case $1 in
            -h|--help) usage; exit 0 ;;
            --all) ALL=1; shift ;;
            -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
            *) die "unexpected argument '$1' (see --help)" ;;
        esac
    done
}

# --remove of bandwidth.sh and delay.sh: drop fttree's root qdisc from $DEV, saying what happened.
remove_fttree_qdisc() {
    if [[ $(drop_root "$DEV") -eq 1 ]]; then
        echo "removed the fttree qdisc from $DEV${NETNS:+ in $NETNS}"
    else
        echo "$PROG: $DEV${NETNS:+ in $NETNS} has no fttree qdisc (nothing to remove)"
    fi
}

# ---- per-rank uplinks (uplink.sh; shown by status.sh) ----------------------------------------

# rate_bytes_per_s RATE: RATE in tc units (100mbit, 1gbit, 500kbit, 10mbps) as bytes per
# second; fails on anything else.
rate_bytes_per_s() {
    awk -v r="$1" 'BEGIN {
        if (!match(tolower(r), /^[0-9]+(\.[0-9]+)?/)) exit 1
        n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
        m["bit"] = 1/8; m["kbit"] = 1e3/8; m["mbit"] = 1e6/8; m["gbit"] = 1e9/8
        m["bps"] = 1; m["kbps"] = 1e3; m["mbps"] = 1e6; m["gbps"] = 1e9
        if (!(u in m) || n * m[u] < 1) exit 1
        printf "%d", n * m[u] }'
}

# uplink_lines DEV [AT]: one line per rank limited by uplink.sh (or downlink.sh) on DEV:
#   RANK ADDRESS RATE BYTES PACKETS DROPPED OVERLIMITS
# (OVERLIMITS: how often the class had a packet to send and no tokens, that is how often the
# limit held the rank back; 0 when it never had to)
# Rank r is class f7:(r+1) (minor in hex); its address is the one its u32 filter matches at
# byte AT of the IP header: 12, the source (uplink.sh, the default), or 16, the destination
# (downlink.sh).
uplink_lines() {
    local dev=$1 at=${2:-12}
    {
        in_ns tc filter show dev "$dev" parent "$FTTREE_QDISC_HANDLE"
        echo "--classes--"
        in_ns tc -s class show dev "$dev" parent "$FTTREE_QDISC_HANDLE"
    } | awk -v major="${FTTREE_QDISC_HANDLE%:}" -v at="$at" '
        function hex(h,    i, n) {  # mawk has no strtonum
            n = 0
            for (i = 1; i <= length(h); i++) n = n * 16 + index("0123456789abcdef", substr(tolower(h), i, 1)) - 1
            return n
        }
        function dotted(h) {
            return hex(substr(h, 1, 2)) "." hex(substr(h, 3, 2)) "." hex(substr(h, 5, 2)) "." hex(substr(h, 7, 2))
        }
        /^--classes--$/ { classes = 1; next }
        !classes && /flowid/ {
            flow = ""
            for (i = 1; i < NF; i++) if ($i ~ /^\*?flowid$/) flow = $(i + 1)  # "*flowid": terminal
            next
        }
        !classes && $1 == "match" && $4 == at && flow ~ ("^" major ":[0-9a-f]+$") {
            split($2, m, "/"); addr[flow] = dotted(m[1]); next
        }
        classes && $1 == "class" && $2 == "htb" {
            cls = $3; rate = ""
            for (i = 4; i < NF; i++) if ($i == "rate") rate = $(i + 1)
            next
        }
        classes && $1 == "Sent" && cls != "" {
            split(cls, c, ":"); dropped = $7; sub(/,$/, "", dropped)
            printf "%d %s %s %s %s %s %s\n", hex(c[2]) - 1, (cls in addr) ? addr[cls] : "?", rate, $2, $4, dropped, $9
            cls = ""
        }' | sort -n
}

# ---- per-rank downlinks (downlink.sh) -------------------------------------------------------

# What a rank receives is shaped on this ifb device: an ingress filter on DEV redirects every
# IP packet to it, and an htb there (handle f7:, like uplink.sh's) has a class per destination.
FTTREE_IFB="fttree-dl"

# has_downlink_ingress DEV: DEV's ingress redirects to fttree's ifb device.
has_downlink_ingress() {
    in_ns tc filter show dev "$1" ingress 2>/dev/null | grep -qF "to device $FTTREE_IFB)"
}

# drop_downlink: remove downlink.sh's ingress redirects and its ifb device; prints 1 when it
# removed something (one setting, as status.sh counts it: the htb on the ifb device), else 0.
drop_downlink() {
    local dev n=0
    while read -r dev; do
        if [[ $dev != "$FTTREE_IFB" ]] && has_downlink_ingress "$dev"; then
            in_ns tc qdisc del dev "$dev" ingress
            n=$((n + 1))
        fi
    done < <(in_ns ls /sys/class/net)
    if in_ns ip link show dev "$FTTREE_IFB" >/dev/null 2>&1; then
        in_ns ip link del dev "$FTTREE_IFB"
        n=$((n + 1))
    fi
    echo $((n > 0 ? 1 : 0))
}

# The options uplink.sh and downlink.sh share (RATE, --ranks, --rank R=RATE, --burst, --dev,
# --remove, --counters and the common ones): sets RATE, MODE, RANKS, BURST and the caller's
# `declare -A RANK_RATE`. $1 says what the limit applies to ("sends", "receives").
parse_rank_limits() {
    local verb=$1
    shift
    RATE="" MODE=apply RANKS=7 BURST=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            -h|--help) usage; exit 0 ;;
            --remove) MODE=remove; shift ;;
            --counters) MODE=counters; shift ;;
            --ranks)
                if [[ $# -lt 2 || ! $2 =~ ^[0-9]+$ ]] || ((10#$2 < 1)); then
                    die "--ranks needs a number of ranks (1 or more)"
                fi
                RANKS=$((10#$2)); shift 2 ;;
            --dev) [[ $# -ge 2 ]] || die "--dev needs an interface"; DEV=$2; shift 2 ;;
            --burst) [[ $# -ge 2 ]] || die "--burst needs a size"; BURST=$2; shift 2 ;;
            --rank)
                if [[ $# -lt 2 || ! $2 =~ ^([0-9]+)=(.+)$ ]]; then
                    die "--rank needs RANK=RATE, like 3=10mbit"
                fi
                rate_bytes_per_s "${BASH_REMATCH[2]}" >/dev/null ||
                    die "--rank $2: RATE must look like 100mbit, 1gbit, 500kbit or 10mbps"
                # shellcheck disable=SC2321  # RANK_RATE is the caller's associative array: a string index
                RANK_RATE[$((10#${BASH_REMATCH[1]}))]=${BASH_REMATCH[2]}; shift 2 ;;
            -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
            *) [[ -z $RATE ]] || die "one RATE, got '$RATE' and '$1'"; RATE=$1; shift ;;
        esac
    done
    [[ -z $PORT ]] || die "--port is not supported: this limit applies to everything a rank $verb"
    if [[ $MODE == apply ]]; then
        [[ -n $RATE ]] || { usage >&2; exit 2; }
        rate_bytes_per_s "$RATE" >/dev/null || die "RATE must look like 100mbit, 1gbit, 500kbit or 10mbps, got '$RATE'"
    else
        [[ -z $RATE ]] || die "--$MODE takes no RATE (got '$RATE')"
    fi
}
