#!/usr/bin/env bash
# The llama-cpp-python source, trimmed to what a CUDA build needs (about 5 MB), as .peer/llama-src.tgz for the device
# (gpu_check.sh's llamabuild stage): the vendored llama.cpp without its model vocabularies, docs, web UI, tests,
# examples and the other GPU backends. Usage (repo root): bash scripts/pack_llama_src.sh [VERSION]
set -euo pipefail
VERSION=${1:-0.3.36}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION" >/dev/null
tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
P=llama_cpp_python-$VERSION
V=$P/vendor/llama.cpp
ex=(--exclude="$P/.git" --exclude="$P/examples" --exclude="$P/docker")
for d in models docs benches media tools/ui tools/server .git .github tests examples conversion scripts gguf-py \
         ggml/src/ggml-vulkan ggml/src/ggml-sycl ggml/src/ggml-metal ggml/src/ggml-opencl ggml/src/ggml-cann \
         ggml/src/ggml-webgpu ggml/src/ggml-hexagon ggml/src/ggml-et ggml/src/ggml-openvino ggml/src/ggml-virtgpu; do
  ex+=(--exclude="$V/$d")
done
mkdir -p .peer
tar czf .peer/llama-src.tgz "${ex[@]}" -C "$work" "$P"
grep -qx '/.peer/' .git/info/exclude 2>/dev/null || echo '/.peer/' >> .git/info/exclude
ls -la .peer/llama-src.tgz
