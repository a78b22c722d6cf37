"""Generated gRPC stubs of ``zspeed.serve.v1`` (serve/proto/zspeed/serve/v1/serve.proto).

Do not edit; regenerate with ``serve/proto/gen.sh``.
"""
