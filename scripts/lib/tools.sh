# Sourced (from the repo root) by the scripts/install-* scripts, which any number of runs may run
# at once (the test harness runs them from every test process): a run takes .tools/<name>.lock
# (flock) before it checks again and installs, installs into a fresh dir of its own inside
# .tools, and renames that into place. So a tool's dir in place is always complete, and no run
# deletes or moves one another run is using.

# tools_lock NAME: waits for .tools/NAME.lock and holds it until this script exits, then removes
# what runs that died while installing NAME left behind.
tools_lock() {
  if ! command -v flock >/dev/null; then
    echo "$0: flock is missing (on Debian it comes with util-linux: apt-get install util-linux)" >&2
    exit 1
  fi
  mkdir -p .tools
  exec 9>>".tools/$1.lock"
  flock 9
  rm -rf ".tools/.$1.staging."*
}

# tools_stage NAME (with NAME's lock held): a fresh, empty dir inside .tools to install into, in
# TOOLS_STAGE; removed when this script exits unless tools_place moved it.
tools_stage() {
  TOOLS_STAGE="$(mktemp -d ".tools/.$1.staging.XXXXXX")"
  chmod "$(umask -S)" "${TOOLS_STAGE}"
  trap 'rm -rf "${TOOLS_STAGE}"' EXIT
}

# tools_place DEST: renames the staged dir to DEST. A DEST already there (one that failed its
# check) is first renamed aside, then removed.
tools_place() {
  if [ -e "$1" ]; then
    mv -T "$1" "${TOOLS_STAGE}.old"
    mv -T "${TOOLS_STAGE}" "$1"
    rm -rf "${TOOLS_STAGE}.old"
  else
    mv -T "${TOOLS_STAGE}" "$1"
  fi
}

# python_tag: the ABI of the python3 on PATH ("cpython-311"), which the compiled modules of a
# --target install are built for; a dir holding them is named after it, so another Python gets
# its own install.
python_tag() {
  if ! command -v python3 >/dev/null; then
    echo "$0: python3 is missing (on Debian: apt-get install python3)" >&2
    exit 1
  fi
  python3 -c 'import sys; i = sys.implementation
print((i.cache_tag or "%s-%d%d" % ((i.name,) + tuple(sys.version_info[:2]))) + getattr(sys, "abiflags", ""))'
}
