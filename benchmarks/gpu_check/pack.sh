#!/usr/bin/env bash
# Run here, before a GPU check: the packages the lent GPU machine lacks, into .whl/ (git-ignored) for `carry`.
# Its image has torch, transformers, scikit-learn, typer, rich... but not Ray, diffusers or pydantic, and it
# reaches no package index. Ray's wheel (79 MB) is over the 64 MiB carry limit, so Ray travels without its
# Java jars and the libraries dovetail does not import, xz-compressed (about 30 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl /tmp/dovetail-ray && mkdir -p .whl /tmp/dovetail-ray
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
download -d .whl diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 importlib-metadata==10.2.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1 peft==0.21.2 accelerate==1.16.0
download -d /tmp/dovetail-ray ray==2.60.0
(cd /tmp/dovetail-ray && unzip -q ray-*.whl && rm -rf ray-*.whl ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/llm \
  && tar -cf - . | xz -T0 -6 > "$OLDPWD/.whl/ray-slim.tar.xz")
du -sh .whl
