#!/usr/bin/env bash
# An aarch64 Python with torch, run under qemu-user, where test_cpu_isa runs the CPU kernels'
# NEON paths (cross-compiled with g++-aarch64-linux-gnu) against the float64 reference: the
# Arm machines people have (Apple Silicon under Linux, Graviton) without one here.
#
#   tests/arm_sysroot.sh [DEST]     (default: $WORKBENCH_ARM_SYSROOT, else
#                                    ~/.cache/workbench/arm-sysroot)
#
# DEST/root: Debian's arm64 Python and the libraries it and torch load (packages downloaded,
# unpacked, never installed: apt's arm64 architecture is added for the download and removed
# after). DEST/site: torch and transformers for aarch64 (pip --target --platform). torch is
# 2.7.1, the newest aarch64 wheel on PyPI without CUDA (later ones need NVIDIA's libraries);
# the kernels' sources build against it as against the host's. DEST/abi: its C++ ABI flag.
# DEST/ready: written last, once `import torch, transformers` ran under qemu.
# Needs root (apt), qemu-user and network access to Debian and PyPI; about 200 MB, a minute.
set -euo pipefail
dest=${1:-${WORKBENCH_ARM_SYSROOT:-$HOME/.cache/workbench/arm-sysroot}}
[ -f "$dest/ready" ] && exit 0
command -v qemu-aarch64 >/dev/null || { echo "arm_sysroot: no qemu-aarch64 (apt-get install qemu-user)"; exit 1; }
py=python3.11                        # Debian 12's Python; the wheels below are for it
grep -q '^12' /etc/debian_version 2>/dev/null || { echo "arm_sysroot: written for Debian 12"; exit 1; }
rm -rf "$dest" && mkdir -p "$dest/root" "$dest/debs"
debs=(libc6 "$py-minimal" "lib$py-minimal" "lib$py-stdlib" zlib1g libexpat1 libssl3 libffi8
      libbz2-1.0 liblzma5 libgcc-s1 libstdc++6 libgomp1 libcrypt1 libuuid1 libsqlite3-0
      libncursesw6 libtinfo6 libreadline8 libnsl2 libtirpc3 libdb5.3 libgssapi-krb5-2 libkrb5-3
      libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1)
added=0
dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64; added=1; }
restore() { if [ $added = 1 ]; then dpkg --remove-architecture arm64 && apt-get update -qq; fi; }
trap restore EXIT
apt-get update -qq
(cd "$dest/debs" && apt-get download -qq "${debs[@]/%/:arm64}" 2>/dev/null)
for d in "$dest"/debs/*.deb; do dpkg -x "$d" "$dest/root"; done
rm -rf "$dest/debs"
target=(--target "$dest/site" --only-binary=:all: --python-version 3.11 --implementation cp
        --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
        --platform manylinux2014_aarch64 -q)
# torch without its dependencies (pip would read their markers for this machine, x86_64, and
# ask for CUDA's), then its pure-Python ones, transformers (the host's version) and gguf.
pip install "${target[@]}" --no-deps torch==2.7.1
tf=$(python -c "import transformers; print(transformers.__version__)" 2>/dev/null || echo "")
pip install "${target[@]}" "transformers${tf:+==$tf}" gguf filelock typing-extensions sympy \
    networkx jinja2 fsspec
qemu-aarch64 -L "$dest/root" -E PYTHONPATH="$dest/site" "$dest/root/usr/bin/$py" -c \
    "import torch, transformers; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))" > "$dest/abi"
echo "$py" > "$dest/ready"
echo "arm_sysroot: ready in $dest (torch $(ls "$dest/site" | grep -o 'torch-[0-9.]*[0-9]' | head -1))"
