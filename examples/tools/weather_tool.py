"""An example tool server: `weather`, an inferx.v1.ToolService answering
{"city": ..., "sky": ...} for {"city": ...}, registered in etcd for as long as it runs.

It takes the flags every InferX service takes for transport security:

    python examples/tools/weather_tool.py --etcd 127.0.0.1:2379 \\
        --tls-ca .inferx/tls/ca.pem --tls-cert .inferx/tls/service.pem --tls-key .inferx/tls/service.key \\
        --etcd-ca .inferx/tls/ca.pem --etcd-cert .inferx/tls/service.pem --etcd-key .inferx/tls/service.key

(what `inferx up` generates), or `--insecure` against a stack started with
`inferx up --insecure`. With TLS it registers as a TLS endpoint (`"tls": true`) and
accepts only callers with a certificate from the CA: the router, with its own.
"""

from __future__ import annotations

import json

import grpc

from inferx.toolserver import run_tool_server
from inferx.v1 import tool_pb2, tool_pb2_grpc


class WeatherTool(tool_pb2_grpc.ToolServiceServicer):
    async def Invoke(self, request, context):
        city = json.loads(request.arguments_json or "{}").get("city", "")
        if not city:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "argument 'city' is required")
        if city == "Atlantis":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such city: Atlantis")
        return tool_pb2.ToolResponse(result_json=json.dumps({"city": city, "sky": "clear"}))


def main() -> None:
    run_tool_server("weather", WeatherTool)


if __name__ == "__main__":
    main()
