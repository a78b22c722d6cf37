#!/usr/bin/env bash
# Regenerates the committed Python stubs in serve/_proto/ (or in OUT_DIR) from
# serve/proto/zspeed/serve/v1/serve.proto. Needs grpcio-tools (users of the
# stubs do not).
#
#   usage: serve/proto/gen.sh [OUT_DIR]
#
# protoc names the generated modules after the proto's path under -I
# (zspeed/serve/v1/serve_pb2.py) and the gRPC stubs import the messages by
# that absolute name (`from zspeed.serve.v1 import serve_pb2`), which is not a
# module of this package. The proto keeps its path (so the descriptor pool and
# server reflection see `zspeed/serve/v1/serve.proto`); the generated files are
# moved flat into serve/_proto/ and that one import is made relative.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/../_proto}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python -m grpc_tools.protoc -I "$here" \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  zspeed/serve/v1/serve.proto

gen="$tmp/zspeed/serve/v1"
grep -q '^from zspeed\.serve\.v1 import serve_pb2 as ' "$gen/serve_pb2_grpc.py" \
  || { echo "gen.sh: protoc's import line changed; update the rewrite below" >&2; exit 1; }
sed -i 's/^from zspeed\.serve\.v1 import serve_pb2 as /from . import serve_pb2 as /' "$gen/serve_pb2_grpc.py"
if grep -q 'zspeed\.serve\.v1 import' "$gen"/*.py "$gen"/*.pyi; then
  echo "gen.sh: an absolute import of zspeed.serve.v1 is left in the stubs" >&2
  exit 1
fi

mkdir -p "$out"
cp "$gen/serve_pb2.py" "$gen/serve_pb2.pyi" "$gen/serve_pb2_grpc.py" "$out/"
cat > "$out/__init__.py" <<'PY'
"""Generated gRPC stubs of ``zspeed.serve.v1`` (serve/proto/zspeed/serve/v1/serve.proto).

Do not edit; regenerate with ``serve/proto/gen.sh``.
"""
PY
echo "wrote $(cd "$out" && pwd)"
