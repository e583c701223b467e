# Shared by the scripts: where the cached tools live, and one-line progress and errors.
METAX_CACHE=${METAX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/metax-operator}
BIN=$METAX_CACHE/bin
export METAX_CACHE BIN
step() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
