#!/usr/bin/env bash
# Pack vLLM 0.24.0, TRL 1.16 and Liger-Kernel 0.8.5 (hal.kernels) for the lent GPU machine (Python 3.12, torch 2.11.0+cu130,
# no network), in parts small enough to ride along with the checkout on each `run` call.
#
#   bash scripts/gpu_carry.sh            # here, with network: download, pack, split, print
#
# Downloads, for cp312 manylinux x86-64, vllm==0.24.0 and trl==1.16.0 with every dependency,
# then drops what the GPU image already has (scripts/gpu_image_packages.txt, read from the
# device tool's package list: its CUDA libraries among them) and always torch, torchvision,
# torchaudio and triton (vLLM 0.24.0 pins the machine's own torch 2.11.0; carrying torch would
# replace it). Then the wheels scripts/gpu_carry_slim.txt names (FlashInfer, MLA, CuTe DSL
# and TileLang kernels: 720 MB that a dense decoder on FLASH_ATTN never imports) are left out,
# and scripts/carry_closure.py checks, from the modules the engine loads (scripts/
# vllm_engine_modules.txt, traced on the vLLM CPU lane, plus the CUDA-only modules of
# scripts/vllm_cuda_roots.txt), that no import that runs needs one of them: the script stops
# if one does. Nothing is slimmed inside a wheel. Where the index cannot meet every pin at once, scripts/carry.py fetch-relaxed
# downloads package by package and lists the pins it relaxed in .carry/relaxed.txt.
# The kept wheels go unpacked into one tar.xz, cut into parts under .carry/parts/ (git-ignored)
# with a manifest of sha256s (scripts/carry.py). Re-runnable: downloads already present are kept.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >> "$exclude"
wheels=.carry/wheels
mkdir -p "$wheels" .carry/dropped .carry/slimmed
mv .carry/slimmed/*.whl "$wheels"/ 2>/dev/null || true  # a rerun starts from the whole set
if ! python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$wheels" vllm==0.24.0 trl==1.16.0 liger-kernel==0.8.5; then
    # The index cannot meet every pin at once (vLLM 0.24.0 wants llguidance >= 1.7, newer than
    # the index's newest): one package at a time, relaxing such pins; they are listed in
    # .carry/relaxed.txt, and the set installs with --no-deps there.
    echo "gpu_carry: the set does not resolve at once; fetching package by package" >&2
    python3 scripts/carry.py fetch-relaxed "$wheels" scripts/gpu_image_packages.txt \
        vllm==0.24.0 trl==1.16.0 liger-kernel==0.8.5 | tee .carry/relaxed.txt || exit 1
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
# The slim set: what a dense decoder never imports goes to .carry/slimmed (gpu_carry_slim.txt),
# then the import closure of the engine's modules must hold without it.
declare -A slim=()
while read -r name _; do
    case "$name" in '#'* | '') continue ;; esac
    slim[$(norm "$name")]=1
done < scripts/gpu_carry_slim.txt
for whl in "$wheels"/*.whl; do
    name=$(norm "$(basename "$whl" | cut -d- -f1)")
    if [ -n "${slim[$name]:-}" ]; then mv "$whl" .carry/slimmed/ && echo "slimmed $(basename "$whl")"; fi
done
roots=()
while read -r root; do [ -n "$root" ] && roots+=(--root "$root"); done < scripts/vllm_cuda_roots.txt
if ! python3 scripts/carry_closure.py "$wheels" scripts/vllm_engine_modules.txt \
    --dropped .carry/slimmed --image scripts/gpu_image_packages.txt "${roots[@]}" > .carry/closure.txt; then
    grep -v '^in the image' .carry/closure.txt
    echo "gpu_carry: the slim set misses a package the engine imports (above)" >&2
    exit 1
fi
grep -v '^in the image' .carry/closure.txt
tree_mib=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{print int($1/1048576)+1}')
part_mib=$((60 - tree_mib))
# Installed here (each wheel unpacked into one site tree, as pip --no-deps --target would: a
# wheel's .data holds only scripts in this set) and recompressed with xz: 318 MB of wheels
# become 231 MB, 4 parts instead of 6.
rm -rf .carry/site && mkdir -p .carry/site
for whl in "$wheels"/*.whl; do python3 -m zipfile -e "$whl" .carry/site; done
rm -rf .carry/site/*.data
tar -C .carry/site -cf - . | xz -T2 -6 > .carry/gpu-site.tar.xz.tmp
mv .carry/gpu-site.tar.xz.tmp .carry/gpu-site.tar.xz && rm -rf .carry/site
rm -rf .carry/parts
python3 scripts/carry.py split .carry/gpu-site.tar.xz .carry/parts --part-mib "$part_mib"
echo "total $(du -m .carry/gpu-site.tar.xz | cut -f1) MB; the tree itself ${tree_mib} MiB; parts of ${part_mib} MiB"
echo "run calls, back to back (the machine keeps /tmp while warm, about 30 s idle):"
for part in .carry/parts/part-*; do
    echo "  run carry=[\".carry/parts/$(basename "$part")\", \".carry/parts/manifest.json\"]" \
        "command='mkdir -p /tmp/crossrl-carry && cp .carry/parts/* /tmp/crossrl-carry/'"
done
echo "  run command='OUT=\$OUT bash scripts/gpu_checks.sh tier2'   # install vllmtests vllmjob peer"
