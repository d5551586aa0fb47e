#!/usr/bin/env bash
# Heal a link cut by cut.sh (and drop any loss rule on it with --loss too).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$(readlink -f "$0")")/lib.sh"

usage() {
    cat <<HELP
Usage: $PROG [options] LINK
       $PROG [options] --all

Remove the DROP rules cut.sh installed for LINK (same LINK syntax as cut.sh: A-B, HOST1-HOST2,
R or HOST; 1-0 and 0-1 are the same link). --all heals every cut link. Loss rules are left
alone (loss.sh --remove, or reset.sh removes everything).

Options:
  --all          heal every link cut.sh cut
$COMMON_HELP
HELP
}

SPEC="" ALL=0
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --all) ALL=1; shift ;;
        -*) common_option "$@"; [[ $SHIFTED -gt 0 ]] || die "unknown option '$1' (see --help)"; shift "$SHIFTED" ;;
        *) [[ -z $SPEC ]] || die "one LINK at a time, got '$SPEC' and '$1'"; SPEC=$1; shift ;;
    esac
done
[[ -n $SPEC || $ALL -eq 1 ]] || { usage >&2; exit 2; }
need_root
check_netns
if ((ALL)); then
    PATTERN="^$FTTREE_TAG cut "
    WHAT="every cut link"
else
    parse_target "$SPEC"
    PATTERN="^$(regex_quote "$FTTREE_TAG cut $TARGET")\$"
    WHAT=$TARGET
fi
removed=$(delete_tagged "$PATTERN")
if [[ $removed -eq 0 ]]; then
    echo "$PROG: $WHAT was not cut${NETNS:+ in $NETNS} (nothing to heal)"
else
    echo "healed $WHAT${NETNS:+ in $NETNS} ($removed rules removed)"
fi
