#!/usr/bin/env bash
# A pretend LAN on one machine for trying multi-host topologies: N network namespaces
# PREFIX-h1..hN with addresses 10.77.0.1..N/24, each joined by a veth link to a bridge in
# PREFIX-sw. Needs root and iproute2 (apt-get install -y iproute2).
#
#   deploy/netns.sh up tdm 3        # then: ip netns exec tdm-h1 tandem launch deploy/netns.toml
#   deploy/netns.sh down tdm        # deletes the namespaces (stop what runs in them first)
set -euo pipefail

usage() { echo "usage: $0 up PREFIX N | down PREFIX" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
command -v ip >/dev/null || { echo "$0: iproute2 is missing: apt-get install -y iproute2" >&2; exit 1; }
action=$1 prefix=$2

case $action in
  up)
    [[ $# -eq 3 && $3 -ge 1 && $3 -le 250 ]] || usage
    sw=$prefix-sw
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for i in $(seq 1 "$3"); do
      host=$prefix-h$i
      ip netns add "$host"
      ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$host"
      ip -n "$sw" link set "p$i" master br0 up
      ip -n "$host" addr add "10.77.0.$i/24" dev eth0
      ip -n "$host" link set eth0 up
      ip -n "$host" link set lo up
    done
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$prefix-(sw|h[0-9]+)$" || true); do
      ip netns del "$ns"
    done
    ;;
  *) usage ;;
esac
