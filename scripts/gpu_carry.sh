#!/usr/bin/env bash
# Pack vLLM 0.24.0 and TRL 1.16 for the lent GPU machine (Python 3.12, torch 2.11.0+cu130,
# no network), in parts small enough to ride along with the checkout on each `run` call.
#
#   bash scripts/gpu_carry.sh            # here, with network: download, pack, split, print
#
# Downloads, for cp312 manylinux x86-64, vllm==0.24.0 and trl==1.16.0 with every dependency,
# then drops what the GPU image already has (scripts/gpu_image_packages.txt, read from the
# device tool's package list: its CUDA libraries among them) and always torch, torchvision,
# torchaudio and triton (vLLM 0.24.0 pins the machine's own torch 2.11.0; carrying torch would
# replace it). CUDA packages the image lacks (vLLM's cudnn frontend, cutlass DSL) are carried.
# Nothing is slimmed inside a wheel: no test shows that a part a dense decoder never loads is
# safe to drop. Where the index cannot meet every pin at once, scripts/carry.py fetch-relaxed
# downloads package by package and lists the pins it relaxed in .carry/relaxed.txt.
# The wheels go into one tar, cut into parts under .carry/parts/ (git-ignored) with a manifest
# of sha256s (scripts/carry.py). Re-runnable: downloads already present are kept.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >> "$exclude"
wheels=.carry/wheels
mkdir -p "$wheels" .carry/dropped
if ! python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$wheels" vllm==0.24.0 trl==1.16.0; then
    # The index cannot meet every pin at once (vLLM 0.24.0 wants llguidance >= 1.7, newer than
    # the index's newest): one package at a time, relaxing such pins; they are listed in
    # .carry/relaxed.txt, and the set installs with --no-deps there.
    echo "gpu_carry: the set does not resolve at once; fetching package by package" >&2
    python3 scripts/carry.py fetch-relaxed "$wheels" scripts/gpu_image_packages.txt \
        vllm==0.24.0 trl==1.16.0 | tee .carry/relaxed.txt || exit 1
fi
norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
declare -A image=()
while read -r name; do [ -n "$name" ] && image[$(norm "$name")]=1; done < scripts/gpu_image_packages.txt
for whl in "$wheels"/*.whl; do
    name=$(norm "$(basename "$whl" | cut -d- -f1)")
    case "$name" in torch | torchvision | torchaudio | triton) why="the image's own torch" ;;
    *) why=${image[$name]:+"in the image"} ;; esac
    if [ -n "${why:-}" ]; then mv "$whl" .carry/dropped/ && echo "dropped $(basename "$whl"): $why"; fi
    why=
done
python3 scripts/carry.py missing "$wheels" scripts/gpu_image_packages.txt || true
tree_mib=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{print int($1/1048576)+1}')
part_mib=$((60 - tree_mib))
tar -C .carry -cf .carry/gpu-wheels.tar.tmp wheels && mv .carry/gpu-wheels.tar.tmp .carry/gpu-wheels.tar
rm -rf .carry/parts
python3 scripts/carry.py split .carry/gpu-wheels.tar .carry/parts --part-mib "$part_mib"
echo "total $(du -m .carry/gpu-wheels.tar | cut -f1) MB; the tree itself ${tree_mib} MiB; parts of ${part_mib} MiB"
echo "run calls, back to back (the machine keeps /tmp while warm, about 30 s idle):"
for part in .carry/parts/part-*; do
    echo "  run carry=[\".carry/parts/$(basename "$part")\", \".carry/parts/manifest.json\"]" \
        "command='mkdir -p /tmp/crossrl-carry && cp .carry/parts/* /tmp/crossrl-carry/'"
done
echo "  run command='OUT=\$OUT bash scripts/gpu_checks.sh install vllm'"
