# Shared by the scripts that run tools from Debian's packages without installing
# them: the packages are downloaded with `apt-get download` (no root needed) and
# unpacked with `dpkg -x` into a cache keyed by their versions, never changed once made.
# Source it; it defines:
#   CACHE                          the pdserve cache (XDG_CACHE_HOME or ~/.cache, /pdserve)
#   deb_version PKG                the version apt would install
#   deb_tree NAME PKG=VERSION...   unpack the packages into $CACHE/NAME/root (once,
#                                  under a lock) and print $CACHE/NAME

CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve

candidate() {
    apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p'
}

deb_version() {
    local version
    version=$(candidate "$1")
    # A fresh machine (a CI container) has no package lists yet: root can fetch them.
    if [[ (-z $version || $version == "(none)") && $EUID -eq 0 ]]; then
        apt-get update -qq >&2
        version=$(candidate "$1")
    fi
    if [[ -z $version || $version == "(none)" ]]; then
        echo "apt knows no package $1: run \`apt-get update\` (Debian bookworm or later)" >&2
        exit 1
    fi
    echo "$version"
}

deb_tree() {
    local name=$1 dir=$CACHE/$1 deb
    shift
    if [[ ! -d $dir/root ]]; then
        mkdir -p "$CACHE"
        exec 8>"$dir.lock"
        flock 8
        if [[ ! -d $dir/root ]]; then
            echo "fetching Debian's $* into $dir" >&2
            rm -rf "$dir.tmp"
            mkdir -p "$dir.tmp/debs" "$dir.tmp/root"
            # As root, apt would hand the download to its unprivileged user, who may not
            # write here.
            (cd "$dir.tmp/debs" && apt-get download -o APT::Sandbox::User="$(id -un)" "$@" >&2)
            for deb in "$dir.tmp"/debs/*.deb; do
                dpkg -x "$deb" "$dir.tmp/root"
            done
            rm -rf "$dir.tmp/debs"
            mv "$dir.tmp" "$dir"
        fi
        exec 8>&-
    fi
    echo "$dir"
}
