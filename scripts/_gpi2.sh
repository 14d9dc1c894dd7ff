# Sourced by test.sh from the repository root: GPI-2 for the optional GASPI transport.
# A GPI-2 that the build finds already (pkg-config module GPI2) is used as it is, and so is the prefix
# in $GPI2_ROOT. Otherwise GPI-2's release source, when it lies beside the repository
# (../shared/third_party, or $GPI2_TARBALL), is built once (TCP device) into a cache directory outside
# the repository. GPI-2 is GPL-3: the product never contains it and only links to such an install.
# Exports SKBUILD_CMAKE_DEFINE so that the product builds against it; without GPI-2 nothing changes.
GPI2_VERSION=1.6.0

gpi2_build() {  # gpi2_build TARBALL PREFIX: configure, build and install the library (about a minute)
  local tarball=$1 prefix=$2 work stage
  if ! command -v autoreconf >/dev/null || ! command -v libtoolize >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      echo "GPI-2: autoconf, automake and libtool are missing (and cannot be installed without" \
        "root and apt-get): the GASPI transport is not built and its tests are skipped" >&2
      return 1
    fi
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq autoconf automake libtool make gcc >/dev/null
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/tnt-gpi2-build.XXXXXX")
  stage=$work/stage
  echo "GPI-2: building $tarball into $prefix" >&2
  if ! (
    set -e
    tar -xzf "$tarball" -C "$work" --strip-components=1
    cd "$work"
    ./autogen.sh >build.log 2>&1
    ./configure --prefix="$prefix" --with-ethernet --without-fortran CFLAGS="-fPIC -O2" \
      >>build.log 2>&1
    make -C src -j"$(nproc)" >>build.log 2>&1
    make -C src install prefix="$stage" >>build.log 2>&1  # (GPI2.pc keeps the real prefix)
  ); then
    echo "GPI-2: the build failed; the end of its log:" >&2
    tail -n 30 "$work/build.log" >&2 || true
    rm -rf "$work"
    return 1
  fi
  # Staged, then moved in one step: another test run may have finished the same build meanwhile
  # (then its copy stays), and an interrupted build leaves no half-installed prefix.
  mv -T "$stage" "$prefix" 2>/dev/null || [ -f "$prefix/include/GASPI.h" ]
  local moved=$?
  rm -rf "$work"
  return $moved
}

gpi2_prefix=${GPI2_ROOT:-}
if [ -z "$gpi2_prefix" ] && ! pkg-config --exists GPI2 2>/dev/null; then
  gpi2_tarball=${GPI2_TARBALL:-$PWD/../shared/third_party/GPI-2-$GPI2_VERSION.tar.gz}
  gpi2_cache=${XDG_CACHE_HOME:-$HOME/.cache}/tnt_notebook/gpi2-$GPI2_VERSION
  if [ -f "$gpi2_cache/include/GASPI.h" ]; then
    gpi2_prefix=$gpi2_cache
  elif [ -f "$gpi2_tarball" ]; then
    mkdir -p "$(dirname "$gpi2_cache")"
    gpi2_build "$gpi2_tarball" "$gpi2_cache" && gpi2_prefix=$gpi2_cache
  else
    echo "GPI-2: not installed and no release source at $gpi2_tarball:" \
      "the GASPI transport is not built and its tests are skipped" >&2
  fi
fi
if [ -n "$gpi2_prefix" ]; then
  export SKBUILD_CMAKE_DEFINE="${SKBUILD_CMAKE_DEFINE:+$SKBUILD_CMAKE_DEFINE;}GPI2_ROOT=$gpi2_prefix"
fi
