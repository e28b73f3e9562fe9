# Shared by the scripts that build tools from the Go wrapper modules in tests/cluster/
# (one module per upstream). Source it; it defines:
#   CACHE                        the pdserve cache (XDG_CACHE_HOME or ~/.cache, /pdserve)
#   module_version DIR MODULE    the version of MODULE required by DIR/go.mod
#   go_setup [NAME]              GO and the build environment: the module cache under
#                                $CACHE/go/mod (shared: go locks it), and a build cache of
#                                NAME's own under $CACHE/go/build-NAME (unless GOMODCACHE or
#                                GOCACHE are set)
#   module_field DIR MODULE FMT  `go list -m -f FMT MODULE` in DIR (module proxy metadata)
#   go_build BIN_DIR NAME DIR PACKAGE LDFLAGS   build one binary, atomically
#   go_clean_private_cache       remove NAME's build cache (unless KEEP_GOCACHE=1)

CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve

module_version() {
    local version
    version=$(sed -nE "s#^(require)?[[:space:]]*$2 (v[^ ]+).*#\2#p" "$1/go.mod" | head -n1)
    [[ -n $version ]] || { echo "no version of $2 in $1/go.mod" >&2; exit 1; }
    echo "$version"
}

go_setup() {
    GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
    [[ -x $GO ]] || { echo "go not found: install Go >= 1.26 or set GO=/path/to/go" >&2; exit 1; }
    PRIVATE_GOCACHE=${GOCACHE:+no}
    export GOMODCACHE=${GOMODCACHE:-$CACHE/go/mod}
    # A build cache per build: Helm's and the cluster's builds run side by side (make
    # -j2), and one emptying a shared cache when it ends breaks the other mid-build.
    export GOCACHE=${GOCACHE:-$CACHE/go/build-${1:-default}}
    # -modcacherw: a plain `rm -rf` can clear the cache. -buildvcs=false: the wrapper
    # modules live inside this checkout, whose state says nothing about the upstreams.
    export GOFLAGS="-modcacherw -buildvcs=false"
    export GOTOOLCHAIN=local CGO_ENABLED=0
}

module_field() {
    (cd "$1" && "$GO" list -m -f "$3" "$2")
}

# go_build BIN_DIR NAME MODULE_DIR PACKAGE LDFLAGS: builds into a temporary file and
# renames it, so an interrupted build never leaves a binary that looks complete; the
# time taken goes to BIN_DIR/../build-times.txt.
go_build() {
    local bin_dir=$1 name=$2 module_dir=$3 package=$4 ldflags=$5 start seconds
    [[ -x $bin_dir/$name ]] && return 0
    echo "building $name ($package)" >&2
    start=$(date +%s)
    (cd "$module_dir" &&
        nice -n 10 "$GO" build -trimpath -ldflags "$ldflags" -o "$bin_dir/.$name.tmp" "$package")
    mv -f "$bin_dir/.$name.tmp" "$bin_dir/$name"
    seconds=$(($(date +%s) - start))
    echo "built $name in ${seconds}s" >&2
    echo "$name ${seconds}s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$bin_dir/../build-times.txt"
}

go_clean_private_cache() {
    if [[ ${PRIVATE_GOCACHE:-yes} == yes && ${KEEP_GOCACHE:-0} != 1 ]]; then
        rm -rf "$GOCACHE"  # the build's own cache: nothing else uses it
    fi
}
