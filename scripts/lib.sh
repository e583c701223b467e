# Shared by the scripts: where the cached tools live, one-line progress and errors, and what the
# setup steps (scripts/setup.d) have in common: Debian packages, pinned Go modules, Go builds.
METAX_CACHE=${METAX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/metax-operator}
BIN=$METAX_CACHE/bin
export METAX_CACHE BIN
# What to run again after fixing a failed step: the make target or `scripts/setup PROFILE...` that
# ran it (scripts/setup exports it), else the step itself.
AGAIN=${METAX_SETUP:-$0}
step() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

run_step() {  # step [argument...]: one step of scripts/setup.d, never two copies of it at once (the cache would be corrupted)
  mkdir -p "$METAX_CACHE/locks"
  flock "$METAX_CACHE/locks/${1##*/}" "$@"
}

apt_install() {  # package...: install those of the Debian packages that are not installed
  local missing=() package log
  for package in "$@"; do
    [ "$(dpkg-query --show --showformat='${db:Status-Status}' "$package" 2>/dev/null)" = installed ] || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "apt-get is missing: install ${missing[*]} with your package manager (Debian 12 has them), then run '$AGAIN' again"
  [ "$(id -u)" -eq 0 ] || die "installing ${missing[*]} needs root: run 'sudo apt-get install ${missing[*]}', then '$AGAIN'"
  mkdir -p "$METAX_CACHE"
  log=$METAX_CACHE/apt.log
  # The lists are refreshed only when a package is not found; another setup's apt-get is waited for.
  local install=(apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}")
  { DEBIAN_FRONTEND=noninteractive "${install[@]}" \
      || { apt-get update -q -o DPkg::Lock::Timeout=600 && DEBIAN_FRONTEND=noninteractive "${install[@]}"; }; } >"$log" 2>&1 \
    || die "apt-get install ${missing[*]} failed ($(grep -m1 -E '^(E|W):' "$log" || tail -n1 "$log")): see $log"
  for package in "${missing[@]}"; do
    [ "$(dpkg-query --show --showformat='${db:Status-Status}' "$package" 2>/dev/null)" = installed ] \
      || die "apt-get install ${missing[*]} left $package uninstalled: see $log"
  done
}

use_go() {  # version: check that Go `version` or newer is on PATH, and configure it as every build here uses it
  command -v go >/dev/null \
    || die "the Go toolchain is not on PATH: install Go $1 or newer (Debian package golang or the official tarball), then run '$AGAIN' again"
  local have; have=$(go env GOVERSION)
  printf '%s\n' "go$1" "$have" | sort --version-sort --check=quiet \
    || die "$have is too old to build this: install Go $1 or newer, then run '$AGAIN' again"
  # The same flags for every build, so that the standard library and the modules the tools share
  # compile once into Go's build cache. No DWARF from the compiler: the link strips it anyway
  # (-ldflags -w, go_build), and leaving it out saves a sixth of the compile's CPU (kwok: 274
  # CPU-seconds instead of 330, the binary the same size).
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false -modcacherw -gcflags=all=-dwarf=false"
}

go_module() {  # module version h1-sum: print the module's directory, downloaded from the Go module proxy
  # (checked there against the Go checksum database) and checked here against the pinned hash
  local info sum
  info=$(go mod download -json "$1@$2") \
    || die "could not download $1 $2 from the Go module proxy: check the network, then run '$AGAIN' again"
  sum=$(json_field Sum <<<"$info")
  [ "$sum" = "$3" ] || die "$1 $2 has hash $sum, expected $3: do not trust it; update the pin in $0 knowingly"
  json_field Dir <<<"$info"
}

json_field() {  # name: that field of the JSON object on stdin
  python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"
}

go_build() {  # directory package output [ldflags]: build the package of the module in directory, stripped, into output
  local log; log=$METAX_CACHE/build-${3##*/}.log
  mkdir -p "${3%/*}"
  (cd "$1" && go build -ldflags "-s -w ${4:-}" -o "$3.tmp" "$2") >"$log" 2>&1 \
    || die "building ${3##*/} failed ($(grep -m1 -v '^go: downloading' "$log" || echo 'no output')): see $log"
  mv "$3.tmp" "$3"
}
