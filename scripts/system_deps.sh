#!/usr/bin/env bash
# The Debian packages hicache's wheels and tests need, installed when missing.
#   libibverbs1, libnuma1  the Mooncake Store wheel (mooncake_master and its client) links them,
#                          even without RDMA hardware
#   graphviz               renders `hicache inspect --format dot` in the tests that check it
#   gcc, libc6-dev         build the native host copy loop on first use (engine/cache/hostcopy.py;
#                          without them host-to-host copies fall back to a slower Python loop)
# As root with apt-get (containers, CI) they are installed quietly; otherwise one line names the
# command to run and the tests that need them are skipped with that reason. Never fails the build.
set -u
pkgs="libibverbs1 libnuma1 graphviz gcc libc6-dev"
need=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need="$need $p"
done
need="${need# }"
[ -z "$need" ] && exit 0
if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "hicache: not a Debian system; install the equivalents of: $need (Mooncake/graphviz tests will be skipped; without a C compiler host copies use the Python loop)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "hicache: missing system packages; run: sudo apt-get install -y $need (until then the tests that need them are skipped)"
  exit 0
fi
echo "system packages: installing $need"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $need >/dev/null 2>&1; }; then
  echo "hicache: apt-get could not install $need (the tests that need them are skipped)"
fi
exit 0
