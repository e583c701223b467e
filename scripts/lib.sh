# Shared by the scripts: where the cached tools live, and one-line progress and errors.
METAX_CACHE=${METAX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/metax-operator}
BIN=$METAX_CACHE/bin
export METAX_CACHE BIN
step() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
apt_install() {  # command package...: install the Debian packages unless `command` is on PATH
  local cmd=$1; shift
  command -v "$cmd" >/dev/null && return 0
  command -v apt-get >/dev/null || die "$cmd is missing and there is no apt-get here: install $* yourself, then run 'make setup'"
  local sudo=; [ "$(id -u)" -eq 0 ] || sudo=sudo
  local log; log=$(mktemp)
  { $sudo apt-get install -y -q --no-install-recommends "$@" || { $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends "$@"; }; } >"$log" 2>&1 \
    || die "apt-get install $* failed ($(grep -m1 '^E:' "$log" || tail -n1 "$log")): fix apt, then run 'make setup' again"
  rm -f "$log"
  command -v "$cmd" >/dev/null || die "apt-get installed $* but $cmd is not on PATH"
}
