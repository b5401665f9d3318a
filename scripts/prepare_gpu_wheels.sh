#!/usr/bin/env bash
# Prepare .gpu_wheels/: the cp312 wheels scripts/gpu_smoke.sh installs on a GPU machine that has
# Python 3.12, torch and transformers but no network (the lent H200: torch 2.11.0+cu130,
# transformers 5.17). Carry the folder with the working tree (`carry: [".gpu_wheels"]`); it must
# stay under the 64 MiB that travel. Run it here, where PyPI is reachable.
#
# The four libraries the project builds on, pinned as in pyproject.toml, and the small
# dependencies of theirs and of ours the import chain reaches (torch, numpy, transformers and
# their own dependencies are the machine's). Installed with --no-deps, into a venv that sees the
# machine's packages, so nothing here replaces its torch.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu_wheels
LIMIT_MIB=48  # the working tree itself and the toy data need the rest of the 64 MiB
WHEELS=(
    torchtitan==0.3.0 torchrl==0.14.1 tensordict==0.14.3 torchdata==0.11.0
    cloudpickle orjson pyvers importlib_metadata zipp hoptorch spmd_types==0.2.3 torch_checkpointing
    einops tyro docstring_parser typeguard
    xxhash tensorboard tensorboard-data-server absl-py markdown werkzeug markupsafe protobuf
    matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six pillow
)
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download --quiet --dest "$DEST" --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
size_mib=$(du -sm "$DEST" | cut -f1)
echo "prepare_gpu_wheels: $(ls "$DEST" | wc -l) wheels, ${size_mib} MiB in ${DEST}/"
if ((size_mib > LIMIT_MIB)); then
    echo "prepare_gpu_wheels: ${size_mib} MiB is over the ${LIMIT_MIB} MiB budget" >&2
    exit 1
fi
